"""Steer a denoising trajectory: push the denoiser's middle block along a direction, and save before/after PNGs.

    python examples/diffusion_steering.py [OUT_DIR] [--pipeline unet|transformer] [--steps 4]

Runs offline on a tiny random pipeline (8x8 images, meaningless pixels: it
shows the mechanics). Both images come from ONE pipeline call: two invokes
with the same seed, one steered, one not.
"""

import argparse
import pathlib
import tempfile

import torch

import asyncinterp as ai
from asyncinterp.models.tiny_diffusion import tiny_pixart, tiny_sd

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("out", nargs="?", default=None, help="directory for the PNGs (default: a new temp dir)")
parser.add_argument("--pipeline", choices=("unet", "transformer"), default="unet")
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--scale", type=float, default=2.0)
args = parser.parse_args()
torch.set_grad_enabled(False)

if args.pipeline == "unet":
    model = ai.DiffusionModel(tiny_sd())
    block = lambda m: m.unet.mid_block   # noqa: E731
    extra = {}
else:
    model = ai.DiffusionModel(tiny_pixart())
    block = lambda m: m.transformer.transformer_blocks[0]   # noqa: E731
    extra = dict(clean_caption=False, use_resolution_binning=False, max_sequence_length=16)


async def direction_of(m):
    """The block's mean activation at the first step (per channel): the direction to push along."""
    h = await block(m).output
    return h.mean(dim=tuple(range(2, h.dim())) if h.dim() == 4 else 1, keepdim=True)[-1:].clone()


d = model.generate("a bright sunny sky", direction_of, num_inference_steps=1, seed=0, height=8, width=8,
                   **extra).result
d = d / d.norm()


async def steer(m):
    """Add scale * d to the block's output at every step; returns the mean latent norm per step."""
    norms = []
    async for step in m.steps():
        h = await block(m).output
        h += args.scale * d
        norms.append(float((await m.latents).norm()))
    return norms


with model.generate(num_inference_steps=args.steps, seed=1, height=8, width=8, **extra) as tr:
    before = tr.invoke("a quiet lake")
    after = tr.invoke("a quiet lake", steer)

out = pathlib.Path(args.out) if args.out else pathlib.Path(tempfile.mkdtemp(prefix="asyncinterp-diffusion-"))
out.mkdir(parents=True, exist_ok=True)
before.images[0].save(out / "before.png")
after.images[0].save(out / "after.png")
print(f"latent norms per step (steered): {[round(n, 2) for n in after.result]}")
print(f"wrote {out / 'before.png'} and {out / 'after.png'}")
