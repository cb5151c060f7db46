"""``VisionLanguageModel``: a transformers image-text-to-text model (LLaVA, Qwen2-VL) with its processor.

    import asyncinterp as ai
    model = ai.VisionLanguageModel(hf_model, processor)   # or ai.LanguageModel(hf_model, processor)

    async def patch17(m):
        h = await m.language_model.layers[1].output        # [rows, seq, hidden] of this invoke
        m.image_tokens(h)[:, 17] = 0                       # image token 17 of this invoke's image
        return await m.logits

    with model.trace() as tr:
        a = tr.invoke("<image> What is this?", patch17, images=[cat])
        b = tr.invoke("<image> And this?", patch17, images=[dog])

Each invoke takes its own text and images; the processor runs per invoke
and the results are batched per model family (see :mod:`.vision_inputs`).
The envoy tree mirrors the transformers model; ``m.vision_tower``,
``m.projector`` and ``m.language_model`` name the three parts in every
family (LLaVA: ``model.vision_tower``, ``model.multi_modal_projector``,
``model.language_model``; Qwen2-VL: ``model.visual``,
``model.visual.merger``, ``model.language_model``), and the standard names
(``m.layers``, ``m.embed``, ``m.final_norm``) reach the language model.

Inside the vision tower and the projector an invoke sees its own images
(LLaVA: rows of ``[images, ...]`` values; Qwen2-VL: its patches / merged
tokens of the flat ``[patches, ...]`` sequence); in the language model it
sees its own prompt rows, unpadded, as with a text model.
``m.image_tokens(h)`` is the view of ``h`` at this invoke's image tokens.
"""

from __future__ import annotations

from ...engine import describe_invoke
from ...invoke import Invoke
from ...kernel.errors import NotInRunError
from ...kernel.scheduler import current_run, current_task
from ..generating import _NOTHING as _NO_PROMPT
from .inputs import check_length
from .language import LanguageModel
from .runs import GenerateRun, Generation, LMRun, _device_of
from .vision_inputs import build_vision_batch, check_vision_input, process_invoke

__all__ = ["VisionLanguageModel", "VisionForwardEngine", "VisionGenerateEngine", "is_vision_language_model"]

#: family -> (vision tower path, projector path, language model path) below the root
_PARTS = {
    "llava": ("model.vision_tower", "model.multi_modal_projector", "model.language_model"),
    "qwen2_vl": ("model.visual", "model.visual.merger", "model.language_model"),
}
_PLACEHOLDER = {"llava": "<image>", "qwen2_vl": "<|vision_start|><|image_pad|><|vision_end|>"}
#: family -> the transformers model types whose inputs batch as that family does (checked by the tests)
_MODEL_TYPES = {"llava": ("llava",), "qwen2_vl": ("qwen2_vl", "qwen2_5_vl")}


def _get(module, path):
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def family_of(model) -> str | None:
    """``"llava"`` or ``"qwen2_vl"`` from the module structure of a transformers model, or ``None``."""
    import torch
    for family, paths in _PARTS.items():
        if all(isinstance(_get(model, p), torch.nn.Module) for p in paths):
            return family
    return None


def is_vision_language_model(model) -> bool:
    """Whether ``model`` has the parts of a vision-language model (a vision tower, a projector, a language model).

    ``ai.LanguageModel(model, processor)`` makes a :class:`VisionLanguageModel` of it, which refuses model
    types whose inputs it does not know how to batch.
    """
    return hasattr(model, "config") and family_of(model) is not None


class VisionLanguageModel(LanguageModel):
    """A transformers vision-language model plus its processor, ready for interventions (see the module docs)."""

    def __init__(self, model, processor=None, envoys: dict | None = None):
        family = family_of(model)
        if family is None:
            raise TypeError(f"VisionLanguageModel supports LLaVA-style (model.vision_tower, multi_modal_projector) "
                            f"and Qwen2-VL-style (model.visual with a merger) models, got {type(model).__name__}; "
                            "use ai.LanguageModel for a text model")
        model_type = getattr(model.config, "model_type", None)
        if model_type not in _MODEL_TYPES[family]:
            supported = [t for types in _MODEL_TYPES.values() for t in types]
            raise TypeError(f"VisionLanguageModel supports the model types {supported}; {type(model).__name__} "
                            f"(model_type {model_type!r}) has {family}-style parts but its own image inputs "
                            "(tiling, image sizes, videos), which are not handled; wrap it with ai.wrap(model) to "
                            "read its modules without per-invoke images")
        if processor is not None and not hasattr(processor, "image_processor"):
            raise TypeError(f"a vision-language model needs its processor (AutoProcessor.from_pretrained(path): "
                            f"tokenizer and image processor), got {type(processor).__name__}")
        LanguageModel.__init__(self, model, getattr(processor, "tokenizer", None), envoys=envoys)
        init = object.__setattr__
        config = model.config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        from .inputs import context_length
        init(self, "context_length", context_length(text_config))
        init(self, "processor", processor)
        init(self, "family", family)
        init(self, "image_token_id", int(getattr(config, "image_token_id", None)
                                          if getattr(config, "image_token_id", None) is not None
                                          else config.image_token_index))
        vision_config = getattr(config, "vision_config", None)
        init(self, "merge_size", int(getattr(vision_config, "spatial_merge_size", 1) or 1))
        vision_path, projector_path, language_path = _PARTS[family]
        init(self, "part_paths", {"vision_tower": vision_path, "projector": projector_path,
                                  "language_model": language_path})
        vision = {id(m) for p in (vision_path, projector_path) for m in _get(model, p).modules()}
        init(self, "vision_modules", frozenset(vision))
        init(self, "_vision_engines", None)
        from ...hooks.aliases import set_alias
        for name, rel in (("layers", "layers"), ("embed", "embed_tokens"), ("final_norm", "norm")):
            if _get(model, f"{language_path}.{rel}") is not None:
                set_alias(self, name, f"{language_path}.{rel}")

    @classmethod
    def from_pretrained(cls, path, processor=None, **hf_kwargs) -> "VisionLanguageModel":
        """Load an image-text-to-text model (``AutoModelForImageTextToText``) and its processor from ``path``."""
        from transformers import AutoModelForImageTextToText, AutoProcessor
        model = AutoModelForImageTextToText.from_pretrained(path, **hf_kwargs).eval()
        if processor is None:
            processor = AutoProcessor.from_pretrained(path)
        return cls(model, processor)

    # ------------------------------------------------------------------ the three parts
    def _part(self, name):
        envoy = self
        for part in self.part_paths[name].split("."):
            envoy = envoy.child(part)
        return envoy

    @property
    def vision_tower(self):
        """The vision encoder's envoy (LLaVA: ``model.vision_tower``; Qwen2-VL: ``model.visual``)."""
        return self._part("vision_tower")

    @property
    def projector(self):
        """The envoy of the module that maps vision features to the language model's width
        (LLaVA: ``model.multi_modal_projector``; Qwen2-VL: ``model.visual.merger``)."""
        return self._part("projector")

    @property
    def language_model(self):
        """The language model's envoy (``model.language_model``: ``.layers[i]``, ``.norm``, ...)."""
        return self._part("language_model")

    @property
    def image_placeholder(self) -> str:
        """What to write in the text where an image goes (one per image)."""
        return _PLACEHOLDER[self.family]

    # ------------------------------------------------------------------ engines and entry points
    def engine(self, kind: str = "trace"):
        """The engine of this model's jobs: ``"trace"`` (one forward) or ``"generate"``."""
        engines = self._vision_engines
        if engines is None or engines["trace"].model is not self:
            engines = {"trace": VisionForwardEngine(self), "generate": VisionGenerateEngine(self)}
            object.__setattr__(self, "_vision_engines", engines)
        try:
            return engines[kind]
        except KeyError:
            raise ValueError(f"a VisionLanguageModel runs jobs of kind 'trace' or 'generate', not {kind!r}") from None

    def generate(self, input=_NO_PROMPT, *fns, images=None, **options):
        """``LanguageModel.generate``; ``images=``: the images of this prompt (or use ``tr.invoke(..., images=)``)."""
        if images is not None:
            input = _with_images(input, images)
        return LanguageModel.generate(self, input, *fns, **options)

    async def agenerate(self, input=_NO_PROMPT, *fns, images=None, **options):
        if images is not None:
            input = _with_images(input, images)
        return await LanguageModel.agenerate(self, input, *fns, **options)

    # ------------------------------------------------------------------ inside a run only
    def image_positions(self) -> list:
        """Inside an intervention: per row of this invoke, the ``slice`` of sequence positions of each image.

        Positions are those of the invoke's view of a language-model value in
        the prompt pass (its rows, unpadded), in image order.
        """
        run, group = _vision_run()
        return [[slice(a, b) for a, b in row] for row in run.vision.positions[group]]

    def image_tokens(self, h, image: int | None = None):
        """The view of ``h`` (``[rows, seq, ...]``, this invoke's language-model value) at its image tokens.

        ``image``: which image of each row (default: all of them, when they
        are adjacent). A real view: in-place edits reach the model, so
        ``m.image_tokens(h)[:, 17] = x`` patches image token 17.
        """
        run, group = _vision_run()
        rows = run.vision.positions[group]
        length = run.vision.prompt_len[group]
        if h.dim() < 2 or h.shape[1] != length:
            raise ValueError(f"m.image_tokens takes this invoke's [rows, seq, ...] value of a language-model point in "
                             f"the prompt pass ({length} positions); got shape {tuple(h.shape)} (in a generation the "
                             "image tokens are in step 0; later steps see only the new token)")
        spans = set()
        for row in rows:
            if not row:
                raise ValueError("this invoke has no images (no image tokens); pass images=[...] with its text")
            if image is None:
                if any(a[1] != b[0] for a, b in zip(row, row[1:])):
                    raise ValueError(f"this invoke's images are not adjacent ({len(row)} images); pick one with "
                                     "m.image_tokens(h, image=i)")
                spans.add((row[0][0], row[-1][1]))
            else:
                if not -len(row) <= image < len(row):
                    raise IndexError(f"image {image} out of range: a row of this invoke has {len(row)} image(s)")
                spans.add(row[image])
        if len(spans) > 1:
            raise ValueError("this invoke's rows have their image tokens at different positions; use "
                             "m.image_positions() and index each row")
        start, stop = spans.pop()
        return h[:, start:stop]


LanguageModel._variants.append((is_vision_language_model, VisionLanguageModel))


def _with_images(input, images):
    if input is _NO_PROMPT:
        raise TypeError("images= needs a prompt; with several invokes pass images= to each tr.invoke(...)")
    if isinstance(input, dict):
        raise TypeError("images given twice (in the input dict and as images=)")
    return {"text": input, "images": images}


def _vision_run():
    run = current_run()
    task = current_task()
    if task is None or not isinstance(run, _VisionHost):
        raise NotInRunError("m.image_tokens / m.image_positions are only available inside an intervention of a "
                            "VisionLanguageModel run")
    return run, task.group


# ----------------------------------------------------------------------- engines
class VisionForwardEngine:
    """Takes ``"trace"`` jobs of a :class:`VisionLanguageModel`: one forward over every invoke's text and images."""

    invoke_class = Invoke

    def __init__(self, model):
        self.model = model

    def make_invoke(self, index, input, fns, kwargs, deferred):
        images = kwargs.pop("images", None) if kwargs else None
        if not fns and callable(input):   # invoke(fn): no input, the whole batch
            input, fns = None, (input,)
        if input is not None:
            input, images = check_vision_input(self.model, index, input, images)
        elif images is not None:
            raise TypeError(f"invoke {index}: images= needs the text that goes with them")
        options = {"images": tuple(images)} if images else None
        return describe_invoke(index, input, fns, kwargs, deferred, self.invoke_class, options)

    def start(self, job):
        return VisionRun(self.model, job)


class VisionGenerateEngine(VisionForwardEngine):
    """Takes ``"generate"`` jobs of a :class:`VisionLanguageModel`: transformers' ``generate``, a step per pass."""

    invoke_class = Generation

    def make_invoke(self, index, input, fns, kwargs, deferred):
        if kwargs and set(kwargs) - {"images"}:
            raise TypeError(f"generation invokes take only images= (got {sorted(kwargs)}); pass generation options "
                            "to model.generate(...)")
        return VisionForwardEngine.make_invoke(self, index, input, fns, kwargs, deferred)

    def start(self, job):
        return VisionGenerateRun(self.model, job)


# ----------------------------------------------------------------------- runs
class _VisionHost:
    """What a vision-language run adds to a language-model run: the image inputs and the vision side's layout.

    While a module of the vision tower or the projector fires, the run's
    layout is the image layout (rows are images or patches there); else it
    is the padded text layout.
    """

    vision = None

    def _batch(self, extra_tokens: int = 0):
        if self.batch is not None:
            return self.batch
        lm = self.model
        prompts = []
        for inv in self.invokes:
            spec = inv.spec
            if spec.input is None:
                prompts.append(None)
                continue
            prompts.append(process_invoke(lm, spec.input, list(spec.options.get("images", ()))))
        vision = self.vision = build_vision_batch(lm, prompts, _device_of(lm.module))
        batch = vision.text
        for inv, prompt in zip(self.invokes, batch.prompts):
            if prompt is not None and isinstance(inv.spec.input, str):
                prompt.single = True    # one text (the processor made it a batch of one)
        check_length([p for p in batch.prompts if p is not None], lm.context_length, extra_tokens)
        self.batch = batch
        self.layout = batch.layout
        return batch

    def output_hook(self, point):
        return self._in_region(point, super().output_hook(point))

    def input_hook(self, point):
        return self._in_region(point, super().input_hook(point))

    def fire(self, point, value, interrupt: bool = True):
        # extension points (gradients, semantic parts) of a vision module fire outside its module hooks
        envoy = getattr(point, "envoy", None)
        vision = self.vision
        if vision is None or envoy is None or id(envoy.module) not in self.model.vision_modules \
                or self.layout is vision.image_layout:
            return super().fire(point, value, interrupt)
        text, self.layout = self.layout, vision.image_layout
        try:
            return super().fire(point, value, interrupt)
        finally:
            self.layout = text

    def _in_region(self, point, hook):
        if id(point.envoy.module) not in self.model.vision_modules or point.envoy.attached:
            return hook

        def vision_hook(*args):
            text, self.layout = self.layout, self.vision.image_layout
            try:
                return hook(*args)
            finally:
                self.layout = text
        return vision_hook


class VisionRun(_VisionHost, LMRun):
    """The kernel's host for one forward pass of a :class:`VisionLanguageModel`."""

    def prepare(self):
        batch = self._batch()
        lm = self.model
        call = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        call.update(self.vision.image_kwargs)
        if lm.family == "qwen2_vl":   # M-RoPE positions, counting real tokens only (as a solo run would)
            kw = self.vision.image_kwargs
            call["position_ids"], _ = lm.module.model.get_rope_index(
                batch.input_ids, mm_token_type_ids=kw["mm_token_type_ids"], image_grid_thw=kw.get("image_grid_thw"),
                attention_mask=batch.attention_mask)
        elif lm.takes_position_ids:
            call["position_ids"] = batch.position_ids
        from ...hooks.batching import forward_kwargs
        from ...hooks.keywords import check_forward_kwargs
        module = lm.module
        extra = forward_kwargs(self.invokes)
        if extra:
            check_forward_kwargs(module, extra)     # unknown keywords are refused, never dropped (issue 33)
            call.update(extra)
        return lambda: module(**call)


class VisionGenerateRun(_VisionHost, GenerateRun):
    """The kernel's host for a generation of a :class:`VisionLanguageModel` (one kernel step per pass)."""

    def prepare(self):
        self._batch(extra_tokens=self.generate_kwargs.get("max_new_tokens") or 0)
        self.generate_kwargs.update(self.vision.image_kwargs)
        return GenerateRun.prepare(self)
