"""Entry points and token helpers shared by every generating model (transformers, vLLM).

``generate``/``agenerate`` build a run with ``self._generation(max_new_tokens,
on_error, options)`` — the one method each model supplies — add one invoke
and execute it; ``to_tokens``/``token_id``/``decode`` use ``self._tok()``.
"""

from __future__ import annotations

_NOTHING = object()


class GeneratingModel:
    """Mixin for a :class:`~asyncinterp.model.Model` that generates text step by step."""

    def generate(self, input=_NOTHING, *fns, max_new_tokens: int = 20, on_error: str = "stop", **options):
        """Generate with interventions; each forward pass (engine step) is one step of the tasks.

        ``model.generate(prompt, fn, max_new_tokens=20)`` returns the invoke's
        result object (``.result``, ``.tokens``, ``.text``).
        ``model.generate(max_new_tokens=...)`` without a prompt returns the run
        for a ``with`` block (``run.invoke(prompt, fn)`` per prompt). Decoding
        is greedy unless sampling keywords say otherwise; other keywords go to
        the model's own generation call.
        """
        run = self._generation(_checked_max_new_tokens(max_new_tokens), on_error, options)
        if input is _NOTHING and not fns:
            return run
        inv = run.invoke(None if input is _NOTHING else input, *fns)
        run.run()
        return inv

    async def agenerate(self, input=_NOTHING, *fns, max_new_tokens: int = 20, on_error: str = "stop", **options):
        """:meth:`generate` for async code: runs in a worker thread; cancelling stops it at the next step."""
        from ..aio import run_in_thread
        if input is _NOTHING:
            raise TypeError("agenerate needs a prompt; for several prompts use "
                            "`async with model.generate(...) as run:` and run.invoke(...)")
        run = self._generation(_checked_max_new_tokens(max_new_tokens), on_error, options)
        inv = run.invoke(input, *fns)
        await run_in_thread(self, run)
        return inv

    def to_tokens(self, text: str) -> list:
        """Token ids of ``text`` with this model's tokenizer (no special tokens added)."""
        return list(self._tok()(text, add_special_tokens=False)["input_ids"])

    def token_id(self, text: str) -> int:
        """The id of ``text``, which must be exactly one token (e.g. ``" Paris"``)."""
        ids = self.to_tokens(text)
        if len(ids) != 1:
            raise ValueError(f"{text!r} is {len(ids)} tokens ({ids}), not one")
        return ids[0]

    def decode(self, ids) -> str:
        """Text of token ids (an int, a list or a tensor)."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return self._tok().decode(ids)

    def _tok(self):
        return self.tokenizer


def _checked_max_new_tokens(n):
    if n is not None and (not isinstance(n, int) or n < 1):
        raise ValueError(f"max_new_tokens must be a positive int, got {n!r}")
    return n
