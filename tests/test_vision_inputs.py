"""Vision-language invokes: the forms of input, whole-batch invokes, several prompts per invoke, edits, generation points.

Tiny random LLaVA and Qwen2-VL; references are the transformers model on the processor's output.
"""

import asyncio

import pytest
import torch

pytest.importorskip("PIL")

import asyncinterp as ai  # noqa: E402
from asyncinterp.models.hf.tiny_vision import random_image, tiny_llava, tiny_qwen2_vl  # noqa: E402

TOL = dict(atol=1e-5, rtol=1e-5)
CAT, DOG = random_image(20, 30, seed=1), random_image(40, 24, seed=2)


@pytest.fixture(scope="module", params=["llava", "qwen2_vl"])
def vlm(request):
    torch.set_grad_enabled(False)
    hf, processor = {"llava": tiny_llava, "qwen2_vl": tiny_qwen2_vl}[request.param]()
    yield ai.VisionLanguageModel(hf, processor), hf, processor
    torch.set_grad_enabled(True)


async def last_logits(m):
    return (await m.lm_head.output)[:, -1].clone()


def test_input_forms_agree(vlm):
    """text + images=, {'text', 'images'} and the processor's own output give the same logits as transformers."""
    model, hf, processor = vlm
    text = model.image_placeholder + " What is it?"
    inputs = processor(text=[text], images=[CAT], return_tensors="pt")
    ref = hf(**inputs).logits[:, -1]
    for got in (model.trace(text, last_logits, images=[CAT]),
                model.trace(text, last_logits, images=CAT),                      # one image, not in a list
                model.trace({"text": text, "images": [CAT]}, last_logits),
                model.trace(dict(inputs), last_logits)):
        torch.testing.assert_close(got, ref, **TOL)


def test_whole_batch_invoke_sees_every_image(vlm):
    model, hf, processor = vlm
    ph = model.image_placeholder

    async def rows(m):
        p = await m.projector.output
        h = await m.layers[0].output
        return p.shape[0], h.shape[0]

    with model.trace() as tr:
        tr.invoke(ph + " one", last_logits, images=[CAT])
        tr.invoke("two " + ph + " and " + ph, last_logits, images=[CAT, DOG])
        everything = tr.invoke(rows)                      # no input: the whole batch
    n_tokens = {"llava": 3, "qwen2_vl": 8 + 8 + 15}[model.family]   # LLaVA: image rows; Qwen2-VL: merged tokens
    assert everything.result == (n_tokens, 2)


def test_several_prompts_in_one_invoke(vlm):
    """An invoke of two texts (images in placeholder order) = each text alone, rows padded against each other."""
    model, hf, processor = vlm
    ph = model.image_placeholder
    texts = [ph + " short", "a much longer prompt with " + ph + " in it"]

    async def both(m):
        h = await m.layers[1].output
        positions = m.image_positions()
        return (await m.lm_head.output)[:, -1].clone(), h.shape, positions

    with model.trace() as tr:
        other = tr.invoke(ph + " other", last_logits, images=[DOG])
        pair = tr.invoke(texts, both, images=[CAT, DOG])
    logits, shape, positions = pair.result
    for row, (text, img) in enumerate(zip(texts, [CAT, DOG])):
        ref = hf(**processor(text=[text], images=[img], return_tensors="pt")).logits[:, -1]
        torch.testing.assert_close(logits[row:row + 1], ref, **TOL)
    assert shape[0] == 2 and len(positions) == 2 and all(len(r) == 1 for r in positions)
    assert positions[0][0] != positions[1][0]             # the rows' images sit at different positions
    ref = hf(**processor(text=[ph + " other"], images=[DOG], return_tensors="pt")).logits[:, -1]
    torch.testing.assert_close(other.result, ref, **TOL)


def test_persistent_edit_on_image_tokens(vlm):
    """model.edit: zeroing the image tokens of every invoke = a hand-written hook zeroing those positions."""
    model, hf, processor = vlm
    text = "Look at " + model.image_placeholder + " now"

    async def blind(m):
        h = await m.layers[0].output
        m.image_tokens(h).zero_()

    edited = model.edit(blind)
    got = edited.trace(text, last_logits, images=[CAT])
    inputs = processor(text=[text], images=[CAT], return_tensors="pt")
    where = inputs["input_ids"][0] == model.image_token_id

    def hook(mod, args, out):
        out[:, where] = 0
    handle = hf.model.language_model.layers[0].register_forward_hook(hook)
    try:
        ref = hf(**inputs).logits[:, -1]
    finally:
        handle.remove()
    torch.testing.assert_close(got, ref, **TOL)
    assert (got - model.trace(text, last_logits, images=[CAT])).abs().max() > 1e-3   # the original is unedited


def test_generation_points_and_agenerate(vlm):
    model, hf, processor = vlm
    text = model.image_placeholder + " Say"

    async def watch(m):
        chosen = []
        async for _ in m.steps():
            scores = await m.logits
            tok = await m.tokens
            chosen.append((int(scores[0].argmax()), int(tok[0])))
        return chosen

    out = asyncio.run(model.agenerate(text, watch, images=[CAT], max_new_tokens=3))
    assert len(out.result) == 3 and all(a == b for a, b in out.result)       # greedy: the argmax is chosen
    assert out.tokens.tolist() == [b for _, b in out.result]
    inputs = processor(text=[text], images=[CAT], return_tensors="pt")
    ref = hf.generate(**inputs, max_new_tokens=3, do_sample=False, min_new_tokens=3)
    assert out.tokens.tolist() == ref[0, inputs["input_ids"].shape[1]:].tolist()


def test_bad_inputs_say_what_to_do(vlm):
    model, _, processor = vlm
    ph = model.image_placeholder
    with pytest.raises(ValueError, match="2 image placeholder"):
        model.trace(f"{ph} and {ph}", last_logits, images=[CAT])
    with pytest.raises(ValueError, match="keys"):
        model.trace({"txt": ph}, last_logits)
    with pytest.raises(TypeError, match="images given twice"):
        model.trace({"text": ph, "images": [CAT]}, last_logits, images=[CAT])
    with pytest.raises(TypeError, match="already holds its images"):
        model.trace(dict(processor(text=[ph], images=[CAT], return_tensors="pt")), last_logits, images=[CAT])
    with pytest.raises(TypeError, match="only images="):
        with model.generate(max_new_tokens=2) as tr:
            tr.invoke(ph, last_logits, images=[CAT], temperature=0.5)
    with pytest.raises(TypeError, match="cannot use int"):
        model.trace(3, last_logits)


def test_gradient_at_the_projector_is_per_invoke(vlm):
    """``await m.projector.output.grad`` gives each invoke the gradient of its own image features (= solo autograd)."""
    model, hf, processor = vlm
    ph = model.image_placeholder
    cases = [(ph + " one", [CAT]), ("a longer " + ph + " two", [DOG])]

    async def grad_of_features(m):
        g = await ai.spawn(m.projector.output.grad)      # resumed during the backward pass
        return (await g).clone()

    async def backward(m):                               # no input: the whole batch (last column: real tokens)
        out = await m.lm_head.output
        await m.backward(out[:, -1].logsumexp(-1).sum())

    torch.set_grad_enabled(True)
    try:
        with model.trace() as tr:
            got = [tr.invoke(text, grad_of_features, images=imgs) for text, imgs in cases]
            tr.invoke(backward)
        for inv, (text, imgs) in zip(got, cases):
            seen = []

            def keep(mod, args, out):
                out.register_hook(lambda g: seen.append(g.clone()))
            handle = model.projector.module.register_forward_hook(keep)
            try:
                out = hf(**processor(text=[text], images=imgs, return_tensors="pt")).logits
                out[:, -1].logsumexp(-1).sum().backward()
            finally:
                handle.remove()
            torch.testing.assert_close(inv.result, seen[0], **TOL)
    finally:
        hf.zero_grad(set_to_none=True)
        torch.set_grad_enabled(False)


def test_unknown_model_types_and_uncropped_images_are_refused():
    """A LLaVA-style model of another type (LLaVA-NeXT tiles images) is refused by name; images processed to
    different sizes cannot share a LLaVA vision tower: a clear error, not a wrong batch."""
    import copy

    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    hf, processor = tiny_llava()
    other = copy.copy(hf.config)
    other.model_type = "llava_next"
    original = hf.config
    hf.config = other
    try:
        with pytest.raises(TypeError, match="model_type 'llava_next'"):
            ai.LanguageModel(hf, processor)
    finally:
        hf.config = original
    uncropped = copy.copy(processor)
    uncropped.image_processor = CLIPImageProcessorPil(size={"shortest_edge": 16}, do_center_crop=False)
    model = ai.VisionLanguageModel(hf, uncropped)
    with pytest.raises(ValueError, match="different sizes"):
        with model.trace() as tr:
            tr.invoke("<image> a", last_logits, images=[CAT])
            tr.invoke("<image> b", last_logits, images=[DOG])
