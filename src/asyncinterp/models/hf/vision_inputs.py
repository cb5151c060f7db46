"""Invoke inputs of a vision-language model: text plus images, processed per invoke, batched per model family.

Each invoke brings its own text and images. They go through the model's
processor one invoke at a time (so an invoke gets exactly the tokens and
pixels a run of its own would), then the token rows are left-padded into one
batch like a text model's (:func:`.inputs.build_batch`) and the image inputs
are joined the way the family's vision tower takes them:

* LLaVA-style: ``pixel_values`` ``[images, 3, H, W]`` stacked along dim 0
  (the processor resizes every image to the tower's size);
* Qwen2-VL-style: ``pixel_values`` are the images' flattened patches
  ``[patches, C*T*P*P]``, concatenated, with ``image_grid_thw`` ``[images, 3]``
  (each image keeps its own size: nothing to pad, the vision tower attends
  within each image); ``mm_token_type_ids`` follows the padded token rows.

Inside the vision tower and the projector the rows of a value are images (or
patches), not prompts, so they get their own layout: :class:`ImageLayout`
(LLaVA: rows are images) or :class:`PatchLayout` (Qwen2-VL: rows are patches
before the merger, image tokens after it). The run switches to it while
those modules fire (see :mod:`.vision`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ...hooks.views import WHOLE_BATCH, BatchLayout, map_tensors
from .inputs import build_batch

__all__ = ["ImageLayout", "PatchLayout", "VisionBatch", "VisionPrompt", "build_vision_batch", "check_vision_input",
           "process_invoke"]

_PROCESSED = ("input_ids", "attention_mask", "pixel_values", "image_grid_thw", "mm_token_type_ids", "image_sizes")


@dataclass
class VisionPrompt:
    """One invoke's processed input: token mapping for the batcher plus its image tensors."""

    tokens: dict                 # {"input_ids", "attention_mask"} as the processor made them
    pixel_values: object         # tensor or None
    grid: object                 # [images, 3] (Qwen2-VL family) or None
    images: int                  # how many images


def _short(value, limit=50):
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 4] + "...'"


def _as_images(images):
    if images is None:
        return []
    if isinstance(images, (list, tuple)):
        return list(images)
    return [images]


def check_vision_input(model, index, input, images):
    """``(input, images)`` of invoke ``index`` in one form, checked; raise a clear error for bad input."""
    if isinstance(input, Mapping) and "input_ids" in input:
        if images is not None:
            raise TypeError(f"invoke {index}: a processor output already holds its images (pixel_values); "
                            "do not pass images= as well")
        unknown = sorted(set(input) - set(_PROCESSED))
        if unknown:
            raise ValueError(f"invoke {index}: a processor output may hold {list(_PROCESSED)}, not {unknown}")
        return dict(input), None
    if isinstance(input, Mapping):
        unknown = sorted(set(input) - {"text", "images"})
        if unknown or "text" not in input:
            raise ValueError(f"invoke {index}: a vision-language invoke input is a string, a list of strings, "
                             f"{{'text': ..., 'images': [...]}} or a processor output (with 'input_ids'); got keys "
                             f"{sorted(input)}")
        if images is not None and input.get("images") is not None:
            raise TypeError(f"invoke {index}: images given twice (in the input and as images=)")
        images = input.get("images") if images is None else images
        input = input["text"]
    if isinstance(input, str):
        texts = [input]
    elif isinstance(input, (list, tuple)) and input and all(isinstance(t, str) for t in input):
        texts = list(input)
    else:
        raise TypeError(f"invoke {index}: cannot use {type(input).__name__} as a vision-language input; give the "
                        "text (a string or a list of strings) with images=[...], a dict {'text': ..., 'images': "
                        "[...]}, or a processor output")
    images = _as_images(images)
    token = model.processor.image_token
    count = sum(t.count(token) for t in texts)
    if count != len(images):
        example = _short(model.image_placeholder + " Describe the image.")
        raise ValueError(f"invoke {index}: {len(images)} image(s) but {count} image placeholder(s) in the text; put "
                         f"{model.image_placeholder!r} in the text where each image goes, e.g. {example}")
    return (texts[0] if isinstance(input, str) else texts), images


def process_invoke(model, input, images) -> VisionPrompt:
    """Run the processor on one invoke's text and images (or take its processor output as is)."""
    if isinstance(input, dict):
        out = input
    else:
        texts = [input] if isinstance(input, str) else list(input)
        kwargs = {"padding": True} if len(texts) > 1 else {}
        out = model.processor(text=texts, images=images or None, return_tensors="pt", **kwargs)
    tokens = {"input_ids": out["input_ids"]}
    if out.get("attention_mask") is not None:
        tokens["attention_mask"] = out["attention_mask"]
    pixels = out.get("pixel_values")
    grid = out.get("image_grid_thw")
    if pixels is None:
        n = 0
    elif grid is not None:
        n = int(grid.shape[0])
    else:
        n = int(pixels.shape[0])
    return VisionPrompt(tokens, pixels, grid, n)


# ----------------------------------------------------------------------- layouts of the vision side
class ImageLayout(BatchLayout):
    """LLaVA-style vision tower: dim 0 counts images; invoke ``g`` owns its images' rows ``spans[g]``."""

    def __repr__(self):
        return f"ImageLayout(spans={self.spans}, images={self.batch_size})"


class PatchLayout(BatchLayout):
    """Qwen2-VL-style vision tower: one flat sequence of every image's patches along dim 0.

    Invoke ``g`` owns ``spans[g]`` of the ``batch_size`` patches (before the
    merger), ``token_spans[g]`` of the merged image tokens (the merger's
    output, ``patches / merge**2`` rows) and ``image_spans[g]`` of per-image
    tensors (``grid_thw``). Which one a tensor uses is read from its dim 0.
    """

    def __init__(self, spans, patches, token_spans, tokens, image_spans, images):
        super().__init__(spans, patches)
        self.token_spans = [None if s is None else slice(*s) for s in token_spans]
        self.tokens = tokens
        self.image_spans = [None if s is None else slice(*s) for s in image_spans]
        self.images = images

    def index(self, tensor, group):
        if self.spans[group] is None or tensor.dim() == 0:
            return None
        n = tensor.shape[0]
        if n == self.batch_size:
            return self.spans[group]
        if n == self.tokens:
            return self.token_spans[group]
        if n == self.images:
            return self.image_spans[group]
        return None

    def view(self, value, group):
        if self.spans[group] is None:
            return value

        def cut(t):
            idx = self.index(t, group)
            return t if idx is None else t[idx]
        return map_tensors(cut, value)

    def __repr__(self):
        return f"PatchLayout(patches={self.spans}, tokens={self.token_spans}, images={self.image_spans})"


def _offsets(counts):
    spans, start = [], 0
    for c in counts:
        if c is None:
            spans.append(None)
            continue
        spans.append((start, start + c))
        start += c
    return spans, start


# ----------------------------------------------------------------------- one batch
@dataclass
class VisionBatch:
    """The text batch (:class:`.inputs.Batch`), the image inputs, the vision layout and each invoke's image tokens."""

    text: object                 # inputs.Batch (left-padded ids, mask, padded layout, spans)
    image_kwargs: dict           # pixel_values, image_grid_thw, mm_token_type_ids for the forward / generate
    image_layout: object         # the layout of values inside the vision tower and projector
    positions: list              # per invoke: per row of its view, a list of (start, stop) per image
    prompt_len: list             # per invoke: its view's sequence length in the prompt pass


def build_vision_batch(model, prompts, device=None) -> VisionBatch:
    """One batch of every invoke's :class:`VisionPrompt` (``None``: an invoke without input)."""
    text = build_batch([None if p is None else p.tokens for p in prompts], model.tokenizer, device)
    given = [p for p in prompts if p is not None]
    with_images = [p for p in given if p.images]
    kwargs = {}
    family = model.family
    image_id = model.image_token_id
    if with_images:
        pixels = [p.pixel_values for p in with_images]
        if family == "llava" and len({tuple(p.shape[1:]) for p in pixels}) > 1:
            shapes = sorted({tuple(p.shape[1:]) for p in pixels})
            raise ValueError(f"the invokes' images were processed to different sizes {shapes}; a LLaVA vision tower "
                             "takes one size (let the processor resize them: do_resize/do_center_crop)")
        kwargs["pixel_values"] = torch.cat(pixels, dim=0)
        if family == "qwen2_vl":
            kwargs["image_grid_thw"] = torch.cat([p.grid for p in with_images], dim=0)
    if family == "qwen2_vl":
        kwargs["mm_token_type_ids"] = (text.input_ids == image_id).long()
    if device is not None:
        kwargs = {k: v.to(device) for k, v in kwargs.items()}
    # the vision side's layout
    whole = len(prompts) == 1
    counts = [None if p is None else p.images for p in prompts]
    image_spans, images = _offsets(counts)
    if whole or not images:
        layout = WHOLE_BATCH
    elif family == "llava":
        layout = ImageLayout(image_spans, images)
    else:
        merge = model.merge_size ** 2
        patches = [None if p is None else (int(p.grid.prod(-1).sum()) if p.images else 0) for p in prompts]
        patch_spans, n_patches = _offsets(patches)
        token_spans, n_tokens = _offsets([None if n is None else n // merge for n in patches])
        layout = PatchLayout(patch_spans, n_patches, token_spans, n_tokens, image_spans, images)
    positions, lengths = _image_positions(model, text, prompts)
    return VisionBatch(text, kwargs, layout, positions, lengths)


def _image_positions(model, text, prompts):
    """Per invoke, per row of its view: the ``(start, stop)`` positions of each of its images' tokens."""
    ids = text.input_ids
    width = ids.shape[1]
    is_image = ids == model.image_token_id
    where_rows = [[] for _ in range(ids.shape[0])]
    for r, c in is_image.nonzero().tolist():       # one pass over the batch (row-major: positions in order)
        where_rows[r].append(c)
    real = text.attention_mask.sum(-1).tolist()
    merge = model.merge_size ** 2
    out, lengths = [], []
    for g, prompt in enumerate(prompts):
        span = text.spans[g]
        rows = range(ids.shape[0]) if span is None else range(span[0], span[1])
        pad = 0 if span is None else width - max(real[r] for r in rows)
        if prompt is None or not prompt.images:
            sizes = []
        elif model.family == "qwen2_vl":
            sizes = [int(n) // merge for n in prompt.grid.prod(-1).tolist()]
        else:
            total = sum(len(where_rows[r]) for r in rows)
            sizes = [total // prompt.images] * prompt.images
        sizes = iter(sizes)
        per_row = []
        for r in rows:
            where = where_rows[r]
            found, i = [], 0
            while i < len(where):
                n = next(sizes, None)
                if n is None:   # image tokens the processor did not account for (a processor output given as is)
                    n = len(where) - i
                found.append((where[i] - pad, where[i] - pad + n))
                i += n
            per_row.append(found)
        out.append(per_row)
        lengths.append(width - pad)
    return out, lengths
