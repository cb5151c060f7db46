"""DiffusionModel on two tiny random pipelines (a UNet one and a transformer one), against hand-written hooks."""

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

import asyncinterp as ai  # noqa: E402
from asyncinterp.models.tiny_diffusion import tiny_pixart, tiny_sd  # noqa: E402

STEPS = 3
SD_KW = dict(height=8, width=8, guidance_scale=3.0)
PIXART_KW = dict(height=8, width=8, guidance_scale=3.0, clean_caption=False, use_resolution_binning=False,
                 max_sequence_length=16)

# each pipeline: (builder, call keywords, envoy of a denoiser block, its module)
PIPES = {
    "unet": (tiny_sd, SD_KW, lambda m: m.unet.mid_block, lambda p: p.unet.mid_block),
    "transformer": (tiny_pixart, PIXART_KW, lambda m: m.transformer.transformer_blocks[0],
                    lambda p: p.transformer.transformer_blocks[0]),
}


@pytest.fixture(scope="module", params=sorted(PIPES))
def case(request):
    build, kw, block, block_module = PIPES[request.param]
    pipe = build()
    return ai.DiffusionModel(pipe), pipe, kw, block, block_module


def _gens(seed, rows):
    g = torch.Generator().manual_seed(seed)
    return [g] * rows


def record(block):
    async def fn(m):
        seen = []
        async for step in m.steps():
            h = await block(m).output
            lat = await m.latents
            seen.append((step, h.clone(), lat.clone()))
        return seen
    return fn


def test_envoy_tree_mirrors_components(case):
    model, pipe, *_ = case
    assert model.denoiser.module is (pipe.unet if hasattr(pipe, "unet") else pipe.transformer)
    assert model.vae.module is pipe.vae and model.text_encoder.module is pipe.text_encoder


def test_steps_seen_and_reads_equal_hand_written_hooks(case):
    model, pipe, kw, block, block_module = case
    got = model.generate(["a red fox"], record(block), num_inference_steps=STEPS, seed=3, output_type="np", **kw)
    assert [s for s, _, _ in got.result] == list(range(STEPS))

    seen, lats = [], []
    handle = block_module(pipe).register_forward_hook(lambda mod, a, out: seen.append(out.clone()))
    try:
        out = pipe(prompt=["a red fox"], generator=_gens(3, 1), num_inference_steps=STEPS, output_type="np",
                   callback_on_step_end=_lat_cb(lats) if "unet" in model.denoiser_name else None,
                   **({"callback": lambda i, t, x: lats.append(x.clone()), "callback_steps": 1}
                      if model.denoiser_name == "transformer" else {}), **kw)
    finally:
        handle.remove()
    assert len(seen) == STEPS
    for (_, h, lat), ref, ref_lat in zip(got.result, seen, lats):
        torch.testing.assert_close(h, ref, atol=1e-6, rtol=0)
        torch.testing.assert_close(lat, ref_lat, atol=1e-6, rtol=0)
    np.testing.assert_allclose(np.stack(got.images), out.images, atol=1e-6)


def _lat_cb(store):
    def cb(pipe, i, t, kwargs):
        store.append(kwargs["latents"].clone())
        return {}
    return cb


def test_batched_equals_solo(case):
    model, pipe, kw, block, _ = case
    fn = record(block)
    with model.generate(num_inference_steps=STEPS, num_images_per_prompt=2, output_type="np", **kw) as tr:
        a = tr.invoke("a cat", fn, seed=1)
        b = tr.invoke(["a dog", "a bird"], fn, seed=2)
    solo_a = model.generate("a cat", fn, num_inference_steps=STEPS, num_images_per_prompt=2, seed=1,
                            output_type="np", **kw)
    solo_b = model.generate(["a dog", "a bird"], fn, num_inference_steps=STEPS, num_images_per_prompt=2, seed=2,
                            output_type="np", **kw)
    for inv, solo, rows in ((a, solo_a, 2), (b, solo_b, 4)):
        assert len(inv.images) == rows
        assert len(inv.result) == STEPS
        for (_, h, lat), (_, h2, lat2) in zip(inv.result, solo.result):
            assert h.shape[0] == 2 * rows and lat.shape[0] == rows      # CFG: uncond + cond rows of this invoke
            torch.testing.assert_close(h, h2, atol=1e-5, rtol=0)
            torch.testing.assert_close(lat, lat2, atol=1e-5, rtol=0)
        np.testing.assert_allclose(np.stack(inv.images), np.stack(solo.images), atol=1e-5)
    assert not np.allclose(np.stack(a.images)[:1], np.stack(b.images)[:1])


@pytest.mark.parametrize("k", [1])
def test_block_edit_at_step_k_equals_hand_written_hook(case, k):
    model, pipe, kw, block, block_module = case

    async def edit(m):
        async for step in m.steps():
            h = await block(m).output
            if step == k:
                h += 0.5

    with model.generate(num_inference_steps=STEPS, output_type="np", **kw) as tr:
        edited = tr.invoke("a cat", edit, seed=1)
        plain = tr.invoke("a dog", seed=2)

    calls = [0]

    def hook(mod, args, out):
        if calls[0] == k:
            out = out + 0.5
        calls[0] += 1
        return out
    handle = block_module(pipe).register_forward_hook(hook)
    try:
        ref = pipe(prompt=["a cat"], generator=_gens(1, 1), num_inference_steps=STEPS, output_type="np", **kw)
    finally:
        handle.remove()
    ref_plain = pipe(prompt=["a dog"], generator=_gens(2, 1), num_inference_steps=STEPS, output_type="np", **kw)
    np.testing.assert_allclose(np.stack(edited.images), ref.images, atol=1e-5)
    np.testing.assert_allclose(np.stack(plain.images), ref_plain.images, atol=1e-5)
    assert not np.allclose(ref.images, model.generate("a cat", num_inference_steps=STEPS, seed=1,
                                                      output_type="np", **kw).images[0][None])


def test_latents_edit_changes_the_next_step(case):
    model, pipe, kw, *_ = case

    async def halve(m):
        async for step in m.steps():
            lat = await m.latents
            if step == 0:
                lat *= 0.5

    got = model.generate("a cat", halve, num_inference_steps=STEPS, seed=1, output_type="np", **kw)

    async def halve_by_assignment(m):
        async for step in m.steps():
            lat = await m.latents
            if step == 0:
                m.latents = lat * 0.5

    again = model.generate("a cat", halve_by_assignment, num_inference_steps=STEPS, seed=1, output_type="np", **kw)
    np.testing.assert_allclose(np.stack(again.images), np.stack(got.images), atol=1e-6)

    if model.denoiser_name == "unet":
        def cb(p, i, t, kwargs):
            return {"latents": kwargs["latents"] * 0.5} if i == 0 else {}
        extra = {"callback_on_step_end": cb}
    else:
        def old_cb(i, t, x):
            if i == 0:
                x.mul_(0.5)
        extra = {"callback": old_cb, "callback_steps": 1}
    ref = pipe(prompt=["a cat"], generator=_gens(1, 1), num_inference_steps=STEPS, output_type="np", **kw, **extra)
    np.testing.assert_allclose(np.stack(got.images), ref.images, atol=1e-5)


def test_split_cfg_and_errors(case):
    model, pipe, kw, block, _ = case

    async def pair(m):
        h = await block(m).output
        uncond, cond = ai.models.diffusion.split_cfg(h)
        return uncond.shape[0], cond.shape[0]

    assert model.generate("x", pair, num_inference_steps=1, seed=0, **kw).result == (1, 1)
    with pytest.raises(TypeError, match="model.generate"):
        model.trace("x")
    with pytest.raises(TypeError, match="prompt"):
        model.generate(3, pair, num_inference_steps=1, **kw)
    with pytest.raises(TypeError, match="generator"):
        model.generate("x", pair, generator=torch.Generator(), **kw)


def test_text_encoder_rows_per_prompt(case):
    """The text encoder runs per prompt (before num_images_per_prompt repeats): each invoke sees its prompts."""
    model, pipe, kw, *_ = case

    async def enc(m):
        out = await m.text_encoder.encoder.output if model.denoiser_name == "unet" else \
            await m.text_encoder.encoder.final_layer_norm.output
        return (out[0] if isinstance(out, tuple) else getattr(out, "last_hidden_state", out)).clone()

    with model.generate(num_inference_steps=1, num_images_per_prompt=2, **kw) as tr:
        a = tr.invoke("a cat", enc, seed=1)
        b = tr.invoke(["a dog", "a bird"], enc, seed=2)
    solo = model.generate(["a dog", "a bird"], enc, num_inference_steps=1, num_images_per_prompt=2, seed=2, **kw)
    assert a.result.shape[0] == 1 and b.result.shape[0] == 2
    torch.testing.assert_close(b.result, solo.result, atol=1e-5, rtol=0)
    assert tr.layout.prompt_spans == [slice(0, 1), slice(1, 3)] and tr.layout.cfg_spans[1] == slice(4, 12)


def test_break_keeps_denoising_and_stop_ends_the_call(case):
    model, pipe, kw, block, block_module = case

    async def edit_then_leave(m):
        async for step in m.steps():
            h = await block(m).output
            h += 0.5
            break                    # only step 0 is edited; the pipeline goes on

    got = model.generate("a cat", edit_then_leave, num_inference_steps=STEPS, seed=1, output_type="np", **kw)
    calls = [0]

    def hook(mod, args, out):
        calls[0] += 1
        return out + 0.5 if calls[0] == 1 else out
    handle = block_module(pipe).register_forward_hook(hook)
    try:
        ref = pipe(prompt=["a cat"], generator=_gens(1, 1), num_inference_steps=STEPS, output_type="np", **kw)
    finally:
        handle.remove()
    np.testing.assert_allclose(np.stack(got.images), ref.images, atol=1e-5)

    async def stop_at_1(m):
        async for step in m.steps():
            if step == 1:
                m.stop()
        return "stopped"

    out = model.generate("a cat", stop_at_1, num_inference_steps=STEPS, seed=1, **kw)
    assert out.result == "stopped"
    with pytest.raises(RuntimeError, match="stopped"):
        out.images
