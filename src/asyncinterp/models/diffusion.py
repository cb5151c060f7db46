"""``DiffusionModel``: a diffusers pipeline whose denoising trajectory interventions can read and steer.

    import asyncinterp as ai
    model = ai.DiffusionModel(pipeline)              # StableDiffusionPipeline, PixArtSigmaPipeline, ...

    async def steer(m):
        async for step in m.steps():                 # one step per denoiser call
            h = await m.unet.mid_block.output
            h += 0.1
            lat = await m.latents                    # the latents after the scheduler step (editable)

    out = model.generate("a red fox", steer, num_inference_steps=4, seed=0)
    out.images                                       # this invoke's PIL images

The envoy tree mirrors the pipeline's torch components (``m.unet`` or
``m.transformer``, ``m.vae``, ``m.text_encoder``...). Several invokes (prompts)
run in ONE pipeline call; each sees only its rows (see :class:`DiffusionLayout`
for classifier-free guidance and ``num_images_per_prompt``) and draws its
noise from its own seeded generator, so its results equal a run of its own.
"""

from __future__ import annotations

import inspect

import torch

from ..engine import describe_invoke
from ..hooks.envoy import Envoy, HookPoint
from ..hooks.views import BatchLayout, map_tensors
from ..invoke import Invoke
from ..job import Trace
from ..model import Model
from ..run import Run
from .generating import generation_point

__all__ = ["DiffusionEngine", "DiffusionInvoke", "DiffusionLayout", "DiffusionModel", "DiffusionRun", "split_cfg"]

_NOTHING = object()


# ----------------------------------------------------------------------- rows per invoke
class DiffusionLayout(BatchLayout):
    """Which rows of a pipeline's batch each invoke owns.

    Invoke ``i`` has ``p_i`` prompts and ``n`` images per prompt, so ``r_i =
    p_i * n`` image rows; the pipeline batch has ``B = sum(r_i)`` rows, in
    invoke order (``spans``): what the latents and the VAE see. The text
    encoder runs on the prompts before they are repeated ``n`` times: there
    invoke ``i`` owns its ``p_i`` prompt rows (``prompt_spans``).

    With classifier-free guidance the denoiser gets ``2B`` rows, the pipeline's
    order being ``[uncond rows of all invokes; cond rows of all invokes]``.
    While the denoiser runs, the run reorders those rows invoke by invoke
    (and back afterwards), so inside it invoke ``i`` owns the contiguous rows
    ``cfg_spans[i]`` = ``[its r_i uncond rows; its r_i cond rows]``: exactly
    what a run of that invoke alone sees, and a real view (in-place edits
    reach the model). :func:`split_cfg` splits such a view into its pair.
    """

    def __init__(self, rows, prompts=None):
        offsets = [0]
        for r in rows:
            offsets.append(offsets[-1] + r)
        batch = offsets[-1]
        super().__init__([(offsets[i], offsets[i + 1]) for i in range(len(rows))], batch)
        self.rows = list(rows)
        self.cfg_spans = [slice(2 * offsets[i], 2 * offsets[i + 1]) for i in range(len(rows))]
        # denoiser row j (invoke-major) holds pipeline row order[j]
        order = []
        for i in range(len(rows)):
            order += range(offsets[i], offsets[i + 1])
            order += range(batch + offsets[i], batch + offsets[i + 1])
        self.order = torch.tensor(order, dtype=torch.long)
        self.inverse = torch.argsort(self.order)
        self.reorders = order != list(range(2 * batch))
        # the text encoder runs once per prompt (before the images are repeated): invoke i owns prompt rows
        prompts = list(rows) if prompts is None else list(prompts)
        starts = [0]
        for p in prompts:
            starts.append(starts[-1] + p)
        self.prompt_count = starts[-1]
        self.prompt_spans = [slice(starts[i], starts[i + 1]) for i in range(len(prompts))]

    def covers_all(self, group) -> bool:
        return len(self.rows) == 1

    def index(self, tensor, group):
        if tensor.dim() == 0:
            return None
        n = tensor.shape[0]
        if n == self.batch_size:
            return self.spans[group]
        if n == 2 * self.batch_size:
            return self.cfg_spans[group]
        if n == self.prompt_count:
            return self.prompt_spans[group]
        return None

    def view(self, value, group):
        def cut(t):
            idx = self.index(t, group)
            return t if idx is None else t[idx]
        return map_tensors(cut, value)

    def to_invoke_order(self, value):
        """The denoiser's arguments with CFG rows reordered invoke by invoke (a no-op without CFG)."""
        return self._permute(value, self.order)

    def to_pipeline_order(self, value):
        """The denoiser's output back in the pipeline's ``[uncond; cond]`` order."""
        return self._permute(value, self.inverse)

    def _permute(self, value, order):
        n = 2 * self.batch_size

        def perm(t):
            if t.dim() == 0 or t.shape[0] != n:
                return t
            return t.index_select(0, order.to(t.device))
        return map_tensors(perm, value)

    def __repr__(self):
        return f"DiffusionLayout(rows={self.rows})"


def split_cfg(value):
    """``(uncond, cond)``: an invoke's view of a denoiser value under classifier-free guidance, split in two."""
    if not isinstance(value, torch.Tensor) or value.shape[0] % 2:
        raise ValueError("split_cfg takes a denoiser tensor of an invoke under classifier-free guidance "
                         "(an even number of rows: its uncond rows, then its cond rows)")
    return value.chunk(2)


# ----------------------------------------------------------------------- the latents point
class _Identity(torch.nn.Module):
    """Called with the latents at the end of each denoising step: something hooks attach to."""

    def forward(self, value):
        return value


class _LatentsPoint(HookPoint):
    """``m.latents``: fires after the scheduler step of every denoising step (after every denoiser module)."""

    __slots__ = ("rank",)

    def __init__(self, envoy):
        HookPoint.__init__(self, envoy, "output")
        self.rank = 1

    def describe(self) -> str:
        return "latents"


# ----------------------------------------------------------------------- the model
def _components(pipeline) -> torch.nn.Module:
    """An ``nn.Module`` holding the pipeline's torch components under their names (the modules are not changed)."""
    root = torch.nn.Module()
    for name, comp in pipeline.components.items():
        if isinstance(comp, torch.nn.Module):
            root.add_module(name, comp)
    return root


class DiffusionModel(Model):
    """A diffusers pipeline ready for interventions (see the module docs)."""

    latents = generation_point("the [rows, C, H, W] latents at the end of each denoising step (after the scheduler "
                               "step; this invoke's rows, no CFG doubling). Edit in place or assign "
                               "`m.latents = new`: the next step starts from it")

    def __init__(self, pipeline, envoys: dict | None = None):
        if not hasattr(pipeline, "components") or not callable(pipeline):
            raise TypeError(f"DiffusionModel wraps a diffusers pipeline (with .components), got "
                            f"{type(pipeline).__name__}; use ai.wrap(module) for a torch module")
        root = _components(pipeline)
        denoiser = next((n for n in ("unet", "transformer") if isinstance(getattr(root, n, None), torch.nn.Module)),
                        None)
        if denoiser is None:
            raise TypeError(f"{type(pipeline).__name__} has no `unet` or `transformer` component; DiffusionModel "
                            "supports pipelines with one denoiser")
        params = inspect.signature(pipeline.__call__).parameters
        if "prompt" not in params:
            raise TypeError(f"{type(pipeline).__name__} takes no `prompt`; DiffusionModel supports text-to-image "
                            "pipelines")
        Model.__init__(self, root, envoys=envoys)
        init = object.__setattr__
        init(self, "pipeline", pipeline)
        init(self, "denoiser_name", denoiser)
        init(self, "call_params", frozenset(params))
        tap = Envoy(_Identity(), "latents", root=self)
        init(self, "generation_points", {"latents": _LatentsPoint(tap)})
        init(self, "_diffusion_engine", None)
        init(self, "_call_finished", False)   # the pipeline call being recorded returned (see below)

    def finish_order_recording(self, recorder) -> None:
        # Nothing calls the root (a container of the components), so the recorder never sees the call end by
        # itself: one pipeline call that returned is the complete order (text encoder, denoiser, VAE).
        recorder.stop()
        if self._call_finished:
            recorder.order.complete = True
        else:
            object.__setattr__(self, "call_order", None)
        object.__setattr__(self, "_call_finished", False)

    @property
    def denoiser(self) -> Envoy:
        """The envoy of the denoiser (``m.unet`` or ``m.transformer``)."""
        return getattr(self, self.denoiser_name)

    def engine(self, kind: str = "trace"):
        """The engine of this model's jobs: only ``"generate"`` (a pipeline call)."""
        if kind != "generate":
            raise ValueError("a DiffusionModel runs pipeline calls: use model.generate(prompt, fn, ...) "
                             "(kind 'generate'), not a trace")
        engine = self._diffusion_engine
        if engine is None:
            engine = DiffusionEngine(self)
            object.__setattr__(self, "_diffusion_engine", engine)
        return engine

    def trace(self, *args, **kwargs):
        raise TypeError("a DiffusionModel has no single forward pass: use model.generate(prompt, fn, "
                        "num_inference_steps=...) and `async for step in m.steps()`")

    def generate(self, prompt=_NOTHING, *fns, num_inference_steps: int = 4, guidance_scale: float | None = None,
                 seed: int | None = None, num_images_per_prompt: int = 1, on_error: str = "stop",
                 **pipeline_kwargs):
        """Run the pipeline with interventions; each denoiser call is one step of the tasks.

        ``model.generate(prompt, fn, ...)`` returns the invoke's result
        (``.result``, ``.images``); without a prompt it returns the trace (``Trace``) for a
        ``with`` block (``tr.invoke(prompt, fn, seed=...)`` per prompt, all in
        one pipeline call). ``seed``: the default seed of every invoke (each
        invoke draws its noise from its own ``torch.Generator``). Other
        keywords go to the pipeline call (``height``, ``width``, ...).
        """
        if not isinstance(num_inference_steps, int) or num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be a positive int, got {num_inference_steps!r}")
        if not isinstance(num_images_per_prompt, int) or num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt must be a positive int, got {num_images_per_prompt!r}")
        _check_seed(seed)
        for name in ("prompt", "generator", "latents", "prompt_embeds", "num_inference_steps", "callback",
                     "callback_on_step_end"):
            if name in pipeline_kwargs:
                raise TypeError(f"{name}= is set by the run (prompts come from invokes, noise from their seeds); "
                                "remove it")
        options = dict(pipeline_kwargs, num_inference_steps=num_inference_steps, seed=seed,
                       num_images_per_prompt=num_images_per_prompt)
        if guidance_scale is not None:
            options["guidance_scale"] = guidance_scale
        tr = Trace(self, "generate", on_error, generation=options)
        if prompt is _NOTHING and not fns:
            return tr
        inv = tr.invoke(None if prompt is _NOTHING else prompt, *fns)
        tr.run()
        return inv


def _check_seed(seed):
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise TypeError(f"seed must be an int, got {seed!r}")


def _prompts(input, index):
    if isinstance(input, str):
        return [input]
    if isinstance(input, (list, tuple)) and input and all(isinstance(p, str) for p in input):
        return list(input)
    raise TypeError(f"invoke {index}: a DiffusionModel invoke takes a prompt (a string or a list of strings), "
                    f"got {type(input).__name__}")


# ----------------------------------------------------------------------- engine, invoke, run
class DiffusionInvoke(Invoke):
    """An invoke of a pipeline call: its intervention's result plus its images."""

    keeps_run = True   # the images are read from the run afterwards

    @property
    def result(self):
        """The intervention's return value (``None`` without one; a tuple for several)."""
        if not self.fns:
            self._check_done()
            return None
        return Invoke.result.fget(self)

    @property
    def images(self) -> list:
        """This invoke's images (PIL images unless ``output_type`` said otherwise): ``prompts x images_per_prompt``."""
        self._check_done()
        run = self.run
        if run.output is None:
            raise RuntimeError("the pipeline call was stopped (m.stop()) before it made images; leave the step "
                               "loop with `break` instead to let the remaining steps run")
        span = run.layout.spans[self.index]
        return list(run.output.images[span])

    def _check_done(self):
        if not self.done:
            raise RuntimeError("the pipeline has not run yet; leave the `with model.generate(...)` block first")

    def __repr__(self):
        return f"<DiffusionInvoke {self.index} ({'done' if self.done else 'not run'})>"


class DiffusionEngine:
    """Takes ``"generate"`` jobs of a :class:`DiffusionModel`: one pipeline call for all invokes."""

    def __init__(self, model):
        self.model = model

    def make_invoke(self, index, input, fns, kwargs, deferred):
        seed = kwargs.pop("seed", None)
        _check_seed(seed)
        if kwargs:
            raise TypeError(f"a diffusion invoke takes only seed= (got {sorted(kwargs)}); pass pipeline options "
                            "to model.generate(...)")
        inv = describe_invoke(index, input, fns, {}, deferred, DiffusionInvoke, {"seed": seed})
        if inv.spec.input is not None:
            _prompts(inv.spec.input, index)
        return inv

    def start(self, job) -> "DiffusionRun":
        return DiffusionRun(self.model, job)


class DiffusionRun(Run):
    """The kernel's host for one pipeline call: a step per denoiser call, ``m.latents`` per step."""

    def __init__(self, model, job):
        super().__init__(model, job)
        self.options = dict(job.generation)

    def left_step_loop(self, task) -> None:
        """Leaving ``m.steps()`` early does not end the pipeline call (the scheduler bounds the steps): the
        images are still made. ``m.stop()`` stops the call (and leaves no images)."""

    def already_ran(self, trap, current_point) -> bool:
        # within a step: every module, then m.latents
        mine, now = getattr(trap, "rank", 0), getattr(current_point, "rank", 0)
        if mine or now:
            return mine < now
        return super().already_ran(trap, current_point)

    def prepare(self):
        model = self.model
        pipe = model.pipeline
        opts = dict(self.options)
        n = opts.pop("num_images_per_prompt")
        default_seed = opts.pop("seed")
        prompts, rows, counts, generators = [], [], [], []
        for inv in self.invokes:
            if inv.spec.input is None:
                if inv.background:
                    rows.append(0)
                    counts.append(0)
                    continue
                raise TypeError(f"invoke {inv.index} has no prompt; a DiffusionModel invoke needs one")
            ps = _prompts(inv.spec.input, inv.index)
            prompts += ps
            rows.append(len(ps) * n)
            counts.append(len(ps))
            seed = inv.spec.options.get("seed")
            if seed is None:
                seed = default_seed
            if seed is None:
                seed = int(torch.randint(0, 2 ** 62, ()))
            g = torch.Generator().manual_seed(seed)
            generators += [g] * (len(ps) * n)
        layout = self.layout = DiffusionLayout(rows, counts)
        for i, inv in enumerate(self.invokes):
            if inv.background:   # persistent edits see the whole batch
                layout.spans[i] = None
                layout.cfg_spans[i] = layout.prompt_spans[i] = slice(None)
        tap = model.generation_points["latents"].envoy.module
        if "callback_on_step_end" in model.call_params:
            def on_step_end(pipeline, i, t, kwargs):
                return {"latents": tap(kwargs["latents"])}
            opts["callback_on_step_end"] = on_step_end
            opts["callback_on_step_end_tensor_inputs"] = ["latents"]
        elif "callback" in model.call_params:
            def on_step(i, t, latents):
                new = tap(latents)
                if new is not latents:
                    latents.copy_(new)
            opts["callback"] = on_step
            opts["callback_steps"] = 1
        denoiser = model.denoiser.module

        def forward():
            self.track_steps(denoiser)
            if layout.reorders:
                self._reorder_calls(denoiser, layout)
            out = pipe(prompt=prompts, generator=generators, num_images_per_prompt=n, **opts)
            object.__setattr__(model, "_call_finished", True)
            return out
        return forward

    def _reorder_calls(self, module, layout):
        """While the denoiser runs, its CFG rows are in invoke order (see :class:`DiffusionLayout`)."""
        call = type(module)._call_impl

        def reordered_call(*args, **kwargs):
            args, kwargs = layout.to_invoke_order((args, kwargs))
            return layout.to_pipeline_order(call(module, *args, **kwargs))
        object.__setattr__(module, "_call_impl", reordered_call)
        self.on_cleanup(_Restore(module))


class _Restore:
    """Removes the per-instance ``_call_impl`` of a denoiser at the end of the run."""

    def __init__(self, module):
        self.module = module

    def remove(self):
        self.module.__dict__.pop("_call_impl", None)
