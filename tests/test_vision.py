"""Vision-language models (LLaVA, Qwen2-VL, Qwen2.5-VL; tiny random configs) against hand-written torch hooks on the same model.

The reference of every check is the transformers model run on one invoke's
processor output alone, with ``register_forward_hook`` hooks written by hand:
batched invokes (different prompt lengths, different image sizes, a text-only
invoke) must equal it per invoke, an edit at the image tokens must change the
output as the same hand-written edit does, and generation must see one step
per forward pass.
"""

import pytest
import torch

pytest.importorskip("PIL")

import asyncinterp as ai  # noqa: E402
from asyncinterp.models.hf.tiny_vision import random_image, tiny_llava, tiny_qwen2_5_vl, tiny_qwen2_vl  # noqa: E402
from asyncinterp.models.hf.vision import VisionLanguageModel  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module", params=["llava", "qwen2_vl", "qwen2_5_vl"])
def vlm(request):
    torch.set_grad_enabled(False)
    hf, processor = {"llava": tiny_llava, "qwen2_vl": tiny_qwen2_vl, "qwen2_5_vl": tiny_qwen2_5_vl}[request.param]()
    yield ai.LanguageModel(hf, processor), hf, processor
    torch.set_grad_enabled(True)


def parts(hf, family):
    """(a vision block, the projector, language layer 1, lm_head): the modules read by hand."""
    if family == "llava":
        return (hf.model.vision_tower.encoder.layers[0], hf.model.multi_modal_projector,
                hf.model.language_model.layers[1], hf.lm_head)
    return hf.model.visual.blocks[0], hf.model.visual.merger, hf.model.language_model.layers[1], hf.lm_head


def first(x):
    return x[0] if isinstance(x, tuple) else x


def hand_run(hf, processor, text, images, edits=None):
    """Solo forward on the processor's output with hand-written hooks: ``(outputs read, logits)``.

    ``edits``: ``{module: fn(output) -> new output or None}``.
    """
    inputs = processor(text=[text], images=images or None, return_tensors="pt")
    seen = {}
    handles = []
    family = "qwen2_vl" if hasattr(hf.model, "visual") else "llava"
    read = list(parts(hf, family) if images else parts(hf, family)[2:])
    for mod in read + [m for m in (edits or {}) if m not in read]:
        def hook(module, args, out, mod=mod):
            new = edits[mod](out) if edits and mod in edits else None
            seen[mod] = first(out if new is None else new).clone()
            return new
        handles.append(mod.register_forward_hook(hook))
    try:
        logits = hf(**inputs).logits
    finally:
        for h in handles:
            h.remove()
    return seen, logits, inputs


def prompts(model):
    ph = model.image_placeholder
    return [(f"{ph} What is in the picture?", [random_image(20, 30, seed=1)]),
            (f"Look: {ph} and tell me, in a few words, what it shows", [random_image(40, 24, seed=2)]),
            ("A prompt without any image", [])]


async def read_all(m):
    family = m.family
    vision = m.vision_tower.encoder.layers[0] if family == "llava" else m.vision_tower.blocks[0]
    if m.image_positions()[0]:
        v = first(await vision.output).clone()
        p = (await m.projector.output).clone()
    else:
        v = p = None
    h = (await m.language_model.layers[1].output).clone()
    return v, p, h, (await m.lm_head.output).clone()


def test_wraps_with_processor(vlm):
    model, hf, processor = vlm
    assert isinstance(model, VisionLanguageModel)
    assert model.layers[1].module is hf.model.language_model.layers[1]   # standard names reach the language model
    assert model.language_model.module is hf.model.language_model
    assert model.projector.module is parts(hf, model.family)[1]
    with pytest.raises(TypeError, match="needs its processor"):
        ai.VisionLanguageModel(hf, processor.tokenizer)


def test_batched_equals_solo_hand_hooks(vlm):
    """Three invokes in one batch (padding, different image sizes, text only) = each alone with torch hooks."""
    model, hf, processor = vlm
    cases = prompts(model)
    with model.trace() as tr:
        got = [tr.invoke(text, read_all, images=imgs) for text, imgs in cases]
    vision, proj, layer, head = parts(hf, model.family)
    sizes = set()
    for inv, (text, imgs) in zip(got, cases):
        v, p, h, logits = inv.result
        seen, ref_logits, inputs = hand_run(hf, processor, text, imgs)
        torch.testing.assert_close(h, seen[layer], **TOL)
        torch.testing.assert_close(logits, ref_logits, **TOL)
        if imgs:
            torch.testing.assert_close(v, seen[vision], **TOL)
            torch.testing.assert_close(p, seen[proj], **TOL)
            sizes.add(tuple(v.shape))
        else:
            assert v is None
    assert len(sizes) == (2 if model.family == "qwen2_vl" else 1)   # Qwen2-VL keeps each image's size


def _image_positions(inputs, model):
    return (inputs["input_ids"][0] == model.image_token_id).nonzero().flatten()


def test_patch_image_token_equals_hand_hook(vlm):
    """``m.image_tokens(h)[:, k] = donor`` in one invoke of a batch = the same edit by a hand-written hook."""
    model, hf, processor = vlm
    (text_a, imgs_a), (text_b, imgs_b), _ = prompts(model)
    k = 3
    donor = torch.linspace(-2, 2, hf.config.get_text_config().hidden_size)

    async def patch(m):
        h = await m.language_model.layers[0].output
        m.image_tokens(h)[:, k] = donor
        return (await m.lm_head.output).clone()

    async def plain(m):
        return (await m.lm_head.output).clone()

    with model.trace() as tr:
        a = tr.invoke(text_a, plain, images=imgs_a)
        b = tr.invoke(text_b, patch, images=imgs_b)
    layer0 = hf.model.language_model.layers[0]
    inputs = processor(text=[text_b], images=imgs_b, return_tensors="pt")
    pos = int(_image_positions(inputs, model)[k])

    def hand_patch(out):
        out = first(out)
        out[:, pos] = donor
        return out
    _, ref, _ = hand_run(hf, processor, text_b, imgs_b, edits={layer0: hand_patch})
    _, unedited, _ = hand_run(hf, processor, text_b, imgs_b)
    torch.testing.assert_close(b.result, ref, **TOL)
    assert (b.result - unedited).abs().max() > 1e-3        # the edit changed the output
    _, ref_a, _ = hand_run(hf, processor, text_a, imgs_a)
    torch.testing.assert_close(a.result, ref_a, **TOL)    # the other invoke is untouched


def test_zero_projector_rows_of_one_invoke(vlm):
    """Zeroing an invoke's projected image features (vision side layout) = a hand hook zeroing them solo."""
    model, hf, processor = vlm
    (text_a, imgs_a), (text_b, imgs_b), _ = prompts(model)

    async def zero(m):
        (await m.projector.output).zero_()
        return (await m.lm_head.output).clone()

    async def plain(m):
        return (await m.lm_head.output).clone()

    with model.trace() as tr:
        a = tr.invoke(text_a, zero, images=imgs_a)
        b = tr.invoke(text_b, plain, images=imgs_b)
    proj = parts(hf, model.family)[1]
    _, ref_a, _ = hand_run(hf, processor, text_a, imgs_a, edits={proj: lambda out: out.zero_()})
    _, ref_b, _ = hand_run(hf, processor, text_b, imgs_b)
    _, unedited_a, _ = hand_run(hf, processor, text_a, imgs_a)
    torch.testing.assert_close(a.result, ref_a, **TOL)
    torch.testing.assert_close(b.result, ref_b, **TOL)
    assert (a.result - unedited_a).abs().max() > 1e-3


def test_generation_steps_and_tokens(vlm):
    """Generation: one step per forward pass (the vision tower only in step 0), batched tokens = solo HF generate,
    and a per-step edit at the last position = the same edit by a hand-written hook."""
    model, hf, processor = vlm
    cases = prompts(model)[:2]
    n = 4
    bump = torch.linspace(0, 3, hf.config.get_text_config().hidden_size)

    async def count(m):
        steps, vision_calls = 0, 0
        async for step in m.steps():
            if step == 0:
                await m.projector.output
                vision_calls += 1
            h = await m.language_model.layers[0].output
            h[:, -1] += bump
            steps += 1
        return steps, vision_calls

    with model.generate(max_new_tokens=n) as tr:
        got = [tr.invoke(text, count, images=imgs) for text, imgs in cases]
    layer0 = hf.model.language_model.layers[0]
    proj = parts(hf, model.family)[1]
    for inv, (text, imgs) in zip(got, cases):
        assert inv.result == (n, 1)
        calls = {"layer": 0, "proj": 0}

        def hook(mod, args, out):
            calls["layer"] += 1
            first(out)[:, -1] += bump

        def count_proj(mod, args, out):
            calls["proj"] += 1
        handles = [layer0.register_forward_hook(hook), proj.register_forward_hook(count_proj)]
        try:
            inputs = processor(text=[text], images=imgs, return_tensors="pt")
            ref = hf.generate(**inputs, max_new_tokens=n, do_sample=False, min_new_tokens=n)
        finally:
            for h in handles:
                h.remove()
        assert calls == {"layer": n, "proj": 1}
        assert inv.tokens.tolist() == ref[0, inputs["input_ids"].shape[1]:].tolist()


def test_image_tokens_errors(vlm):
    model, hf, processor = vlm
    (text, imgs), _, (plain_text, _) = prompts(model)
    with pytest.raises(ValueError, match="image placeholder"):
        model.trace("no placeholder here", lambda m: None, images=imgs)

    async def no_images(m):
        return m.image_tokens(await m.language_model.layers[0].output)
    with pytest.raises(ValueError, match="no images"):
        model.trace(plain_text, no_images)

    async def decode_step(m):
        async for step in m.steps():
            h = await m.language_model.layers[0].output
            if step == 1:
                return m.image_tokens(h)
    with pytest.raises(ValueError, match="prompt pass"):
        model.generate(text, decode_step, images=imgs, max_new_tokens=2)

    with pytest.raises(ai.NotInRunError):
        model.image_tokens(torch.zeros(1, 3, 4))
