"""Skipping and replacing vLLM decoder layers with the residual stream (issue 9, item 5).

vLLM's decoder layers return ``(mlp_out, residual)``; a user gives the residual
stream ``[1, n, hidden]`` of their own request. ``layers[i].skip(h)``,
``layers[i].output = h``, ``.hidden = h`` and ``resid_post = h`` write it into
that request's rows of the flat layout as ``(h, 0)``. Checked against the
transformers engine on the same weights; other requests in the batch are
untouched; values that cannot be mapped raise a clear error in the
intervention and the engine goes on (one engine for the module, left clean by
every test).
"""

import pytest
import torch

import asyncinterp as ai
from asyncinterp.kernel.errors import OutOfOrderError, ReplacementError
from vllm_helpers import ENGINE, hf_model, make_tiny_dir, require_vllm
from vllm_helpers import tiny_dir, engines  # noqa: F401 - fixtures are found by name

pytestmark = pytest.mark.vllm

PROMPTS = ["The quick brown fox jumps", "Hello world, this is", "Once upon a time in a land far away"]


@pytest.fixture
def vm(engines):
    vm = engines[1]
    yield vm
    runner = vm.llm_engine.model_executor.driver_worker.worker.model_runner
    mods = list(runner.model.modules()) + [runner.sampler]
    assert sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in mods) == 0, "a run left hooks"
    assert not vm.llm_engine.has_unfinished_requests(), "a run left requests in the engine"


def _new_stream(x):
    """A value that is not the layer's own output (so that using it changes the logits)."""
    return x * 0.5 + 1.0


def skip_with(form):
    """Skip layer 1 with a stream made from layer 0's, given in ``form``; return the logits."""
    async def fn(m):
        x = (await m.layers[0].resid_post).clone()
        new = _new_stream(x)
        if form == "skip":
            m.layers[1].skip(new)
        elif form == "skip-pair":
            m.layers[1].skip((new - 0.25, torch.full_like(new, 0.25)))     # (mlp_out, residual): the sum counts
        else:
            await getattr(m.layers[1], {"output": "output", "hidden": "hidden", "resid_post": "resid_post"}[form])
            setattr(m.layers[1], form, new)
        args, _ = await m.model.norm.inputs               # the final norm gets (hidden, residual): the stream
        after = args[0] + args[1]
        return after, (await m.logits).clone()
    return fn


def hf_skip(lm, prompt):
    async def fn(m):
        x = (await m.layers[0].resid_post).clone()
        m.layers[1].skip(_new_stream(x))
        return (await m.logits).clone()
    with torch.no_grad():
        return lm.trace(prompt, fn)


@pytest.mark.parametrize("form", ["skip", "skip-pair", "output", "hidden", "resid_post"])
def test_stream_value_equals_transformers_skip(engines, vm, form):
    lm, _ = engines
    ref = hf_skip(lm, PROMPTS[0])
    after, logits = vm.trace(PROMPTS[0], skip_with(form))
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    x0 = vm.trace(PROMPTS[0], _layer0)
    torch.testing.assert_close(after, _new_stream(x0), rtol=1e-5, atol=1e-5)   # the stream is exactly the value
    clean = vm.trace(PROMPTS[0], _logits)
    assert (clean - logits).abs().max() > 1e-3


async def _layer0(m):
    return (await m.layers[0].resid_post).clone()


async def _logits(m):
    return (await m.logits).clone()


def test_skip_one_request_among_several_in_generation(engines, vm):
    lm, _ = engines

    async def skip_each_step(m):
        out = []
        async for _ in m.steps():
            x = await m.layers[0].resid_post
            m.layers[1].skip(_new_stream(x))
            out.append((await m.logits).clone())
        return out

    base = [inv.tokens.tolist() for inv in _generate(vm, [None, None, None])]
    invs = _generate(vm, [None, skip_each_step, None])
    assert invs[0].tokens.tolist() == base[0] and invs[2].tokens.tolist() == base[2]
    assert invs[1].tokens.tolist() != base[1]
    with torch.no_grad():
        ref = lm.generate(PROMPTS[1], skip_each_step, max_new_tokens=3)
    assert invs[1].tokens.tolist() == ref.tokens.tolist()[-3:]
    for got, want in zip(invs[1].result, ref.result):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def _generate(vm, fns, n=3):
    with vm.generate(max_new_tokens=n) as tr:
        invs = [tr.invoke(p, *([f] if f else [])) for p, f in zip(PROMPTS, fns)]
    return invs


def test_skip_from_an_invoke_without_prompt_takes_the_flat_stream(vm):
    async def whole(m):
        x = await m.model.layers[0].hidden             # [T, hidden]: every request's tokens back to back
        m.model.layers[1].skip(_new_stream(x))

    async def per_request(m):
        x = await m.model.layers[0].hidden
        m.model.layers[1].skip(_new_stream(x))

    with vm.trace() as tr:
        tr.invoke(whole)
        a = [tr.invoke(p, _logits) for p in PROMPTS[:2]]
    with vm.trace() as tr:
        b = [tr.invoke(p, per_request, _logits) for p in PROMPTS[:2]]
    clean = [vm.trace(p, _logits) for p in PROMPTS[:2]]
    for x, y, c in zip(a, b, clean):
        torch.testing.assert_close(x.result, y.result[1], rtol=1e-5, atol=1e-5)
        assert (x.result - c).abs().max() > 1e-3


# ----------------------------------------------------------------------------- values that cannot be mapped

BAD = {
    "one row (no batch dimension)": lambda x: x[0].clone(),
    "too few tokens": lambda x: x[:, 1:].clone(),
    "a pair of the wrong shapes": lambda x: (x.clone(), x[:, 1:].clone()),
    "a tuple of three": lambda x: (x.clone(), x.clone(), x.clone()),
    "a list of floats": lambda x: [0.0] * x.shape[-1],
    "a number": lambda x: 3.0,
    "another dtype": lambda x: x.double(),
}


@pytest.mark.parametrize("how", ["skip", "output", "hidden", "resid_post"])
@pytest.mark.parametrize("bad", list(BAD))
def test_bad_values_raise_clear_errors_and_the_engine_goes_on(vm, how, bad):
    if how in ("hidden", "resid_post") and bad.startswith("a pair"):
        pytest.skip("a pair is a valid form only for .output and skip")

    async def fn(m):
        x = await m.layers[0].resid_post
        value = BAD[bad](x)
        if how == "skip":
            m.layers[1].skip(value)
        else:
            await getattr(m.layers[1], how)
            setattr(m.layers[1], how, value)
        return (await m.logits).clone()

    with pytest.raises(ReplacementError) as info:
        vm.trace(PROMPTS[0], fn)
    msg = str(info.value)
    assert f"model.layers.1.{'skip(...)' if how == 'skip' else how}" in msg
    assert "(1, 5, 64)" in msg or "float32" in msg                    # what was expected
    assert "residual stream" in msg or "convert" in msg
    # the engine is unharmed: the next run computes as before
    torch.testing.assert_close(vm.trace(PROMPTS[1], _logits), _clean_logits(vm))


_CLEAN = {}


def _clean_logits(vm):
    if "logits" not in _CLEAN:
        _CLEAN["logits"] = vm.trace(PROMPTS[1], _logits)
    return _CLEAN["logits"]


def test_a_skip_checked_when_the_layer_runs_raises_in_the_intervention(vm):
    """Called before the step (rows unknown), a wrong value is raised at the task's await, not in the engine."""
    async def early(m):
        m.layers[1].skip(torch.zeros(1, 3, 64))          # the prompt has 5 tokens
        return (await m.logits).clone()

    with vm.trace(on_error="continue") as tr:
        bad = tr.invoke(PROMPTS[0], early)
        good = tr.invoke(PROMPTS[1], _logits)
    with pytest.raises(ReplacementError, match=r"(?s)model\.layers\.1\.skip.*\(1, 5, 64\)"):
        bad.result
    torch.testing.assert_close(good.result, _clean_logits(vm))


def test_skip_after_the_layer_ran_is_out_of_order(vm):
    async def late(m):
        x = await m.layers[1].resid_post
        m.layers[1].skip(x)

    with pytest.raises(OutOfOrderError, match=r"model\.layers\.1 already ran in this engine step"):
        vm.trace(PROMPTS[0], late)
