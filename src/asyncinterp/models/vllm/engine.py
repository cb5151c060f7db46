"""The engine of a :class:`~.driver.VLLM` model: the jobs' entry into the vLLM engine.

A vLLM model has one :class:`VLLMEngine` per kind of job (``model.engine(kind)``):
``"trace"`` (one new token per request) and ``"generate"``. While a job is
built, :meth:`VLLMEngine.make_invoke` checks each invoke at once, on the
caller's line: its prompt becomes token ids that must fit the engine, and its
sampling keywords (or ``sampling_params=``) must make valid ``SamplingParams``;
they are kept in the invoke's ``options``. Its result carrier is a
:class:`~.requests.VLLMInvoke`. :meth:`VLLMEngine.start` takes the frozen job
and returns the :class:`~.jobs.LiveJob` that joins the engine's live loop; the
requests' final sampling parameters are made then, from the job's generation
options with each invoke's own keywords on top (:func:`~.requests.request_params`).
"""

from __future__ import annotations

from ...engine import describe_invoke
from .jobs import LiveJob
from .requests import VLLMInvoke, prompt_ids, request_params

__all__ = ["VLLMEngine"]


class VLLMEngine:
    """Takes jobs of one kind (``"trace"`` or ``"generate"``) of a :class:`~.driver.VLLM` model."""

    def __init__(self, model, kind: str):
        self.model = model
        self.kind = kind

    def make_invoke(self, index, input, fns, kwargs, deferred) -> "VLLMInvoke":
        """Check a prompt (``None``: an invoke that sees every request of its job) and its interventions.

        ``kwargs``: ``sampling_params`` (a ``vllm.SamplingParams``) or keywords
        (``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed``,
        ``do_sample``, any ``SamplingParams`` field) for this request's own
        sampling; the rest come from the job (greedy by default). ``adapter``:
        the LoRA adapter of this request (a name of ``lora_modules``, see :mod:`.lora`).
        """
        sampling = dict(kwargs)
        adapter = sampling.pop("adapter", None)
        given = sampling.pop("sampling_params", None)
        options = sampling if given is None else {**sampling, "sampling_params": given}
        lora_request = None
        if adapter is not None:
            lora_request = self.model.lora.request(adapter)   # an unknown adapter fails here, on the caller's line
            options = {**options, "adapter": adapter}
        inv = describe_invoke(index, input, fns, None, deferred, VLLMInvoke, options)
        input = inv.spec.input   # (``invoke(fn)``: no prompt, describe_invoke moved fn to the interventions)
        if input is None:
            if options:
                raise TypeError("an invoke without a prompt has no request, so it takes no sampling parameters")
            return inv
        inv.prompt_ids = self.prompt_of(input)
        if given is not None and sampling:
            raise TypeError("give either sampling_params=SamplingParams(...) or sampling keywords, not both")
        # made once, now (a bad option fails on the caller's line); made again when the job starts only if the
        # job has generation options of its own for its invokes (a with-block's model.generate(...) keywords)
        inv.params = request_params(self.kind, {}, inv.spec.options)
        inv.lora_request = lora_request
        return inv

    def prompt_of(self, input) -> list:
        """``input`` as token ids that leave room for one new token in the engine."""
        ids = prompt_ids(input, self.model.tokenizer)
        limit = self.model.max_model_len
        if limit is not None and len(ids) >= limit:
            raise ValueError(f"a prompt of {len(ids)} tokens does not fit the engine's max_model_len "
                             f"of {limit} (it needs room for at least one new token)")
        return ids

    def start(self, job) -> LiveJob:
        """The job as it joins the engine's live loop (``wait()`` submits it and waits for its requests)."""
        return LiveJob(self, job)
