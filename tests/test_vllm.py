"""asyncinterp on a real vLLM engine (CPU, in process) with a tiny random Llama made by a fixture.

One engine for the whole module (vLLM starts in ~5-20 s). Each test leaves it
clean: no hook, no request left behind (checked by ``clean_engine``).
"""

import anyio
import pytest
import torch

import asyncinterp as ai
from vllm_helpers import ENGINE, hf_model, make_tiny_dir, require_vllm
from vllm_helpers import tiny_dir  # noqa: F401 - fixtures are found by name

pytestmark = pytest.mark.vllm

PROMPTS = ["The quick brown fox jumps", "Hello", "Once upon a time in a land far away there lived"]


@pytest.fixture(scope="module")
def vm(tiny_dir):
    require_vllm()
    # a 32-token budget per step: long prompts are prefilled in chunks, mixed with decodes
    model = ai.VLLM(tiny_dir, max_num_batched_tokens=32, **ENGINE)
    yield model
    model.close()


@pytest.fixture(scope="module")
def hf(tiny_dir):
    return hf_model(tiny_dir)


def _hooks(vm):
    runner = vm.llm_engine.model_executor.driver_worker.worker.model_runner
    mods = list(runner.model.modules()) + [runner.sampler]
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in mods)


@pytest.fixture
def clean_engine(vm):
    yield vm
    assert _hooks(vm) == 0, "a run left hooks on the model"
    assert not vm.llm_engine.has_unfinished_requests(), "a run left requests in the engine"


def _greedy(vm, prompts=PROMPTS, n=6, fns=None, **kw):
    fns = fns or [None] * len(prompts)
    with vm.generate(max_new_tokens=n, **kw) as tr:
        invs = [tr.invoke(p, *([f] if f else [])) for p, f in zip(prompts, fns)]
    return [inv.tokens.tolist() for inv in invs], invs


# ----------------------------------------------------------------------------- structure


def test_closing_the_last_engine_gives_torch_set_num_threads_back(tiny_dir):
    """vLLM's CPU worker disables torch.set_num_threads process-wide (to keep its thread binding) and changes
    oneDNN's float32 matmul precision; once the engine is closed, the user's own torch.set_num_threads works
    again and the precision is what it was. (First in this module: no other engine is open.)"""
    n = torch.get_num_threads()
    precision = torch.backends.mkldnn.matmul.fp32_precision
    vm = ai.VLLM(tiny_dir, **ENGINE)
    vm.close()
    assert torch.backends.mkldnn.matmul.fp32_precision == precision
    try:
        torch.set_num_threads(1)
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(n)


def test_an_engine_runs_after_torch_threads_were_lowered(tiny_dir):
    """vLLM's CPU attention refuses a step whose OpenMP thread count differs between building its metadata and
    running its kernel; the engine loop's own thread must take torch's count from its first step, whatever
    the user (or an earlier tensor-parallel engine) set it to. (No other engine is open here.)"""
    n = torch.get_num_threads()
    if n < 2:
        pytest.skip("needs 2 or more cores: with one, every thread count is the same")

    async def logits(m):
        return (await m.logits).clone()

    torch.set_num_threads(1)
    try:
        with ai.VLLM(tiny_dir, **ENGINE) as vm:
            out = vm.trace(PROMPTS[0], logits)
    finally:
        torch.set_num_threads(n)
    assert torch.isfinite(out).all()


def test_envoy_tree_mirrors_vllm_model(vm):
    text = repr(vm)
    assert "LlamaDecoderLayer" in text and "logits_processor" in text
    layer = vm.model.layers[0]
    assert type(layer).__name__ == "LayerEnvoy"
    assert layer.self_attn.qkv_proj.path == "model.layers.0.self_attn.qkv_proj"
    assert vm.layers[1].path == "model.layers.1"          # standard names work too
    assert vm.logits.describe() == "logits" and vm.tokens.describe() == "tokens"
    with pytest.raises(ai.ModulePathError, match="qkv_proj"):
        vm.model.layers[0].self_attn.q_proj


def test_hooks_impossible_settings_are_refused_before_start(tiny_dir):
    require_vllm()
    from asyncinterp.models.vllm import HooksUnavailableError
    with pytest.raises(HooksUnavailableError, match="enforce_eager"):
        ai.VLLM(tiny_dir, enforce_eager=False)
    with pytest.raises(HooksUnavailableError, match="compil"):
        ai.VLLM(tiny_dir, compilation_config=3)


# ----------------------------------------------------------------------------- reading


def test_hidden_states_equal_transformers(vm, hf, clean_engine):
    prompt = PROMPTS[2]
    n_layers = len(vm.model.layers)

    async def read(m):
        hs = [(await m.model.layers[i].hidden).clone() for i in range(n_layers)]
        final = (await m.output).clone()
        logits = (await m.logits).clone()
        return hs, final, logits

    hs, final, logits = vm.trace(prompt, read)
    ids = vm.tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    assert hs[0].shape == (1, ids.shape[1], hf.config.hidden_size)
    for i in range(n_layers - 1):      # HF's last entry is after the final norm
        torch.testing.assert_close(hs[i], ref.hidden_states[i + 1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final[0], ref.hidden_states[-1][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits, ref.logits[:, -1], atol=1e-4, rtol=1e-4)


def test_each_request_sees_only_its_tokens_and_equals_solo(vm, hf, clean_engine):
    async def last_hidden(m):
        h = await m.model.layers[1].hidden
        return h.clone()

    solo = [vm.trace(p, last_hidden) for p in PROMPTS]
    with vm.trace() as tr:
        invs = [tr.invoke(p, last_hidden) for p in PROMPTS]
    lens = [len(vm.tokenizer(p).input_ids) for p in PROMPTS]
    for inv, s, n in zip(invs, solo, lens):
        got = inv.result
        assert got.shape[0] == 1 and got.shape[1] <= n
        torch.testing.assert_close(got, s[:, :got.shape[1]], atol=1e-4, rtol=1e-4)


def test_whole_batch_invoke_sees_the_flat_layout(vm, clean_engine):
    seen = []

    async def watch(m):
        async for _ in m.steps():
            seen.append(tuple((await m.model.layers[0].output)[0].shape))

    with vm.generate(max_new_tokens=2) as tr:
        tr.invoke(watch)
        tr.invoke(PROMPTS[0])
        tr.invoke(PROMPTS[1])
    n0, n1 = (len(vm.tokenizer(p).input_ids) for p in PROMPTS[:2])
    assert seen[0] == (n0 + n1, 64) and seen[1] == (2, 64)


def test_logit_lens_matches_logits(vm, clean_engine):
    async def lens(m):
        h = await m.model.layers[-1].output
        stream = h[0] + h[1]
        mine = m.logits_of(stream[:, -1:])
        real = await m.logits
        return mine.clone(), real.clone()

    mine, real = vm.trace(PROMPTS[0], lens)
    torch.testing.assert_close(mine[:, 0], real, atol=1e-4, rtol=1e-4)


def test_gather_two_points_and_generated(vm, clean_engine):
    async def both(m):
        out = []
        async for _ in m.steps():
            attn, mlp = await ai.gather(m.model.layers[0].self_attn.output, m.model.layers[0].mlp.output)
            out.append((attn.shape[1], mlp.shape[1], m.generated.tokens.tolist()))
        return out

    gen = vm.generate(PROMPTS[0], both, max_new_tokens=3)
    n = len(vm.tokenizer(PROMPTS[0]).input_ids)
    toks = gen.tokens.tolist()
    assert gen.result == [(n, n, []), (1, 1, toks[:1]), (1, 1, toks[:2])]


# ----------------------------------------------------------------------------- steps and layout


def test_chunked_prefill_mixed_with_decode(vm, hf, clean_engine):
    long = " ".join([PROMPTS[2]] * 4)        # > 32 tokens: prefilled over several steps
    ids = vm.tokenizer(long).input_ids
    assert len(ids) > 40

    def recorder(store):
        async def fn(m):
            async for _ in m.steps():
                h = await m.model.layers[0].hidden
                store.append((m.request, h.clone()))
        return fn

    a, b = [], []
    with vm.generate(max_new_tokens=3) as tr:
        tr.invoke(PROMPTS[1], recorder(a))
        tr.invoke(long, recorder(b))
    # the short request decodes while the long one is still being prefilled
    assert [r.step for r, _ in a] == [0, 1, 2]
    assert b[0][0].prefill and not b[0][0].samples
    assert sum(1 for r, _ in b if r.prefill) >= 2
    prefill = torch.cat([h for r, h in b if r.prefill], dim=1)
    assert [p for r, _ in b if r.prefill for p in r.positions] == list(range(len(ids)))
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)
    torch.testing.assert_close(prefill, ref.hidden_states[1], atol=1e-4, rtol=1e-4)
    assert len(b) == sum(1 for r, _ in b if r.prefill) + 2


def test_pattern_over_chunked_prefill_and_decode(vm, hf, clean_engine):
    """attn.pattern at every chunk of a long prompt and at decode steps equals transformers' attentions."""
    long = " ".join([PROMPTS[2]] * 4)        # > 32 tokens: prefilled over several steps
    ids = vm.tokenizer(long).input_ids

    async def patterns(m):
        out = []
        async for _ in m.steps():
            p = await m.layers[1].attn.pattern
            out.append((m.request.positions, p.clone()))
        return out

    with vm.generate(max_new_tokens=2) as tr:
        tr.invoke(PROMPTS[1])
        gen = tr.invoke(long, patterns)
    steps = gen.result
    assert sum(1 for pos, _ in steps if pos.start < len(ids)) >= 2             # several prompt chunks
    full = ids + gen.tokens.tolist()[:1]
    with torch.no_grad():
        ref = hf(torch.tensor([full]), output_attentions=True).attentions[1]
    assert [p for pos, _ in steps for p in pos] == list(range(len(full)))
    for pos, p in steps:
        assert p.shape == (1, 2, len(pos), pos.stop)
        torch.testing.assert_close(p, ref[:, :, pos.start:pos.stop, :pos.stop], atol=1e-4, rtol=1e-4)


def test_requests_finishing_early_leave_cleanly(vm, clean_engine):
    def looper(store):
        async def fn(m):
            n = 0
            async for _ in m.steps():
                await m.model.layers[0].output
                n += 1
            store.append(n)
            try:
                await m.model.layers[0].output
            except ai.MissedHookPoint as exc:
                store.append("missed: " + str(exc)[:20])
            return n
        return fn

    a, b = [], []
    with vm.generate(max_new_tokens=6) as tr:
        ia = tr.invoke(PROMPTS[0], looper(a), max_new_tokens=2)
        ib = tr.invoke(PROMPTS[1], looper(b))
    assert ia.result == 2 and ib.result == 6
    assert a[0] == 2 and a[1].startswith("missed") and b[0] == 6
    assert len(ia.tokens) == 2 and len(ib.tokens) == 6


def test_out_of_order_raises_at_once(vm, clean_engine):
    async def backwards(m):
        await m.model.layers[1].output
        await m.model.layers[0].output

    with pytest.raises(ai.OutOfOrderError, match="layers.0"):
        vm.trace(PROMPTS[0], backwards)


def test_missed_point_never_hangs(vm, clean_engine):
    async def after_logits(m):
        await m.tokens
        await m.model.layers[0].output       # only in a later step: must say so

    with pytest.raises((ai.MissedHookPoint, ai.OutOfOrderError)):
        vm.generate(PROMPTS[0], after_logits, max_new_tokens=3)


# ----------------------------------------------------------------------------- writing


def test_zeroing_one_request_changes_only_its_tokens(vm, clean_engine):
    base, _ = _greedy(vm)

    async def zero(m):
        async for _ in m.steps():
            h = await m.model.layers[0].hidden
            h.zero_()

    edited, _ = _greedy(vm, fns=[None, zero, None])
    assert edited[0] == base[0] and edited[2] == base[2]
    assert edited[1] != base[1]


def test_steering_by_replacement_and_removal_restores(vm, clean_engine):
    base, _ = _greedy(vm)
    direction = torch.randn(64, generator=torch.Generator().manual_seed(3))

    async def steer(m):
        async for _ in m.steps():
            h = await m.model.layers[1].hidden
            m.model.layers[1].hidden = h + 8.0 * direction

    steered, _ = _greedy(vm, fns=[steer, None, None])
    assert steered[0] != base[0] and steered[1:] == base[1:]
    again, _ = _greedy(vm)
    assert again == base


def test_logits_override_forces_tokens(vm, clean_engine):
    target = 1234

    async def force(m):
        async for _ in m.steps():
            logits = await m.logits
            logits[:, target] = 1e4

    async def force_by_assignment(m):
        async for _ in m.steps():
            logits = await m.logits
            new = torch.full_like(logits, -1e4)
            new[:, target + 1] = 0
            m.logits = new

    toks, _ = _greedy(vm, fns=[force, force_by_assignment, None], n=4)
    base, _ = _greedy(vm, n=4)
    assert toks[0] == [target] * 4 and toks[1] == [target + 1] * 4 and toks[2] == base[2]


def test_sampled_token_override_is_emitted_and_fed_back(vm, clean_engine):
    async def replace(m):
        fed = []
        async for step in m.steps():
            args, kwargs = await m.inputs           # what the model is fed for this request
            fed.append(kwargs["input_ids"][0, -1].item())
            t = await m.tokens
            assert t.shape == (1,)
            m.tokens = torch.tensor([42 + step])
        return fed

    toks, invs = _greedy(vm, prompts=PROMPTS[:2], fns=[replace, None], n=4)
    assert toks[0] == [42, 43, 44, 45]
    assert invs[0].result[1:] == [42, 43, 44]
    base, _ = _greedy(vm, prompts=PROMPTS[:2], n=4)
    assert toks[1] == base[1]


def test_skip_a_layer_for_one_request(vm, clean_engine):
    async def skip(m):
        async for _ in m.steps():
            args, kwargs = await m.model.layers[1].inputs
            pos, h, res = args
            m.model.layers[1].skip((h.clone(), res.clone()))

    base, _ = _greedy(vm, prompts=PROMPTS[:2], n=3)
    toks, _ = _greedy(vm, prompts=PROMPTS[:2], fns=[skip, None], n=3)
    assert toks[1] == base[1]


def test_per_invoke_sampling_parameters(vm, clean_engine):
    with vm.generate(max_new_tokens=5) as tr:
        a = tr.invoke(PROMPTS[0], temperature=1.0, seed=7)
        b = tr.invoke(PROMPTS[0])
    with vm.generate(max_new_tokens=5) as tr:
        c = tr.invoke(PROMPTS[0], temperature=1.0, seed=7)
    assert a.tokens.tolist() == c.tokens.tolist()
    greedy, _ = _greedy(vm, prompts=PROMPTS[:1], n=5)
    assert b.tokens.tolist() == greedy[0]


def test_persistent_edit_applies_to_every_request(vm, clean_engine):
    base, _ = _greedy(vm, n=3)

    async def zero_layer0(m):
        h = await m.model.layers[0].hidden
        h.zero_()

    edited = vm.edit(zero_layer0)
    toks, _ = _greedy(edited, n=3)
    assert all(t != b for t, b in zip(toks, base))
    assert _greedy(vm, n=3)[0] == base


def test_an_edit_keeps_no_generation_going(vm, clean_engine):
    """An edit is a background invoke of every job: leaving m.steps() ends the generation as without it."""
    async def noop(m):
        await m.model.layers[0].hidden

    async def until_step_2(m):
        async for step in m.steps():
            await m.tokens
            if step == 2:
                break
        return "left"

    plain = vm.generate(PROMPTS[0], until_step_2, max_new_tokens=8)
    edited = vm.edit(noop)
    assert edited.loop is vm.loop                       # one loop steps the engine, whichever copy submits
    assert edited.engine("generate").model is edited    # the copy's jobs run with the copy's envoys
    gen = edited.generate(PROMPTS[0], until_step_2, max_new_tokens=8)
    assert plain.stopped and gen.stopped and gen.result == "left"
    assert gen.tokens.tolist() == plain.tokens.tolist() and len(gen.tokens) < 8


# ----------------------------------------------------------------------------- control and errors


def test_stop_keeps_tokens_before_the_stopping_step(vm, clean_engine):
    async def stop_at_2(m):
        async for step in m.steps():
            await m.model.layers[0].output
            if step == 2:
                m.stop()
                return "stopped"

    gen = vm.generate(PROMPTS[0], stop_at_2, max_new_tokens=8)
    base, _ = _greedy(vm, prompts=PROMPTS[:1], n=8)
    assert gen.stopped and gen.result == "stopped"
    assert gen.tokens.tolist() == base[0][:2]


def test_error_surfaces_and_engine_stays_usable(vm, clean_engine):
    async def boom(m):
        await m.model.layers[0].output
        raise KeyError("mine")

    with pytest.raises(KeyError, match="mine") as info:
        vm.generate(PROMPTS[0], boom, max_new_tokens=4)
    assert any("layers.0" in n for n in getattr(info.value, "__notes__", []))
    base, _ = _greedy(vm, n=2)
    assert len(base[0]) == 2


def test_on_error_continue_fails_only_that_invoke(vm, clean_engine):
    async def boom(m):
        await m.model.layers[0].output
        raise ValueError("only me")

    async def fine(m):
        return (await m.logits).argmax().item()

    with vm.generate(max_new_tokens=2, on_error="continue") as tr:
        a = tr.invoke(PROMPTS[0], boom)
        b = tr.invoke(PROMPTS[1], fine)
    with pytest.raises(ValueError, match="only me"):
        a.result
    assert b.result == b.tokens[0].item()


def test_invoke_cancel_aborts_only_that_request(vm, clean_engine):
    async def cancel_self(m):
        async for step in m.steps():
            await m.model.layers[0].output
            if step == 1:
                tr.invokes[0].cancel()

    with vm.generate(max_new_tokens=5) as tr:
        a = tr.invoke(PROMPTS[0], cancel_self)
        b = tr.invoke(PROMPTS[1])
    with pytest.raises(ai.RunCancelled):
        a.result
    assert len(a.tokens) < 5 and len(b.tokens) == 5


def test_an_invoke_cancelled_before_its_job_starts_never_runs(vm, clean_engine):
    async def read(m):
        return (await m.logits).argmax().item()

    with vm.generate(max_new_tokens=3) as tr:
        a = tr.invoke(PROMPTS[0], read)
        b = tr.invoke(PROMPTS[1], read)
        a.cancel()
    with pytest.raises(ai.RunCancelled):
        a.result
    assert len(a.tokens) == 0 and len(b.tokens) == 3 and b.result == b.tokens[0].item()


def test_a_plain_job_runs_as_a_built_trace_does(vm, clean_engine):
    """A job is a value: submitted as it is (no result carriers), the engine makes them; same tokens."""
    job = ai.Job((ai.InvokeSpec(PROMPTS[0]), ai.InvokeSpec(PROMPTS[1], options={"max_new_tokens": 2})),
                 "generate", generation={"max_new_tokens": 4})
    live = vm.submit(job)
    live.wait()
    a, b = live.output
    assert a.token_ids == _greedy(vm, prompts=PROMPTS[:1], n=4)[0][0] and len(b.token_ids) == 2
    assert a.result is None and not live.stopped and live.layout is None
    live.wait()                                   # waiting again for a finished job returns at once
    with pytest.raises(RuntimeError, match="already submitted"):
        live.submit()


def test_atrace_and_cancellation(vm, clean_engine):
    async def slow(m):
        async for _ in m.steps():
            await m.model.layers[0].output

    async def main():
        h = await vm.atrace(PROMPTS[0], _read_logits)
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.05):
                await vm.agenerate(PROMPTS[2], slow, max_new_tokens=200)
        return h

    logits = anyio.run(main)
    assert logits.shape[0] == 1
    assert _greedy(vm, n=2)[0][0] == _greedy(vm, n=2)[0][0]


async def _read_logits(m):
    return (await m.logits).clone()


def test_bad_inputs(vm):
    async def fn(m):
        return None
    with pytest.raises(ValueError, match="one prompt per invoke"):
        vm.trace(["a", "b"], fn)
    with pytest.raises(ValueError, match="empty prompt"):
        vm.trace("", fn)
    with pytest.raises(TypeError, match="async def"):
        vm.trace("x", lambda_not_async)
    with pytest.raises(ValueError, match="no invoke has a prompt"):
        with vm.trace() as tr:
            tr.invoke(fn)
    with pytest.raises(ValueError, match="max_model_len"):
        vm.trace(list(range(300)), fn)
    with pytest.raises(ai.NotInRunError):
        vm.generated


def lambda_not_async(m):
    return None


def test_cleanup_over_many_runs(vm):
    import gc
    import weakref

    refs = []

    async def keep(m):
        h = await m.model.layers[0].hidden
        refs.append(weakref.ref(h))
        if len(refs) % 3 == 0:
            raise RuntimeError("fail some")

    for i in range(30):
        try:
            vm.trace(PROMPTS[i % 2], keep)
        except RuntimeError:
            pass
    gc.collect()
    assert _hooks(vm) == 0
    assert not vm.llm_engine.has_unfinished_requests()
    assert sum(r() is not None for r in refs) == 0


def test_request_waiting_for_the_token_budget_sits_steps_out(vm, hf, clean_engine):
    texts = [" ".join([PROMPTS[0]] * 3), " ".join([PROMPTS[2]] * 2), "The rain in Spain stays mainly"]
    lens = [len(vm.tokenizer(t).input_ids) for t in texts]
    assert sum(lens[:2]) > 32 and all(n < 32 for n in lens)

    def recorder(store):
        async def fn(m):
            async for step in m.steps():
                h = await m.model.layers[0].hidden
                store.append((step, m.request, h.clone()))
        return fn

    logs = [[], [], []]
    with vm.generate(max_new_tokens=2) as tr:
        invs = [tr.invoke(t, recorder(log)) for t, log in zip(texts, logs)]
    # with a 32-token budget not every request is scheduled in every step: a request's tasks sit
    # out the steps it is not in (their step loops do not advance), and see all its tokens
    steps = [[s for s, _, _ in log] for log in logs]
    assert all(a < b for st in steps for a, b in zip(st, st[1:]))
    assert any(b - a > 1 for st in steps for a, b in zip(st, st[1:])), steps
    for text, log, inv in zip(texts, logs, invs):
        ids = vm.tokenizer(text).input_ids
        prefill = [(r, h) for _, r, h in log if r.prefill]
        assert [p for r, _ in prefill for p in r.positions] == list(range(len(ids)))
        with torch.no_grad():
            ref = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[1]
        torch.testing.assert_close(torch.cat([h for _, h in prefill], dim=1), ref, atol=1e-4, rtol=1e-4)
        assert len(inv.tokens) == 2


def test_batcher_serves_vllm_requests(vm, clean_engine):
    from asyncinterp.serve import Batcher

    solo = [vm.generate(p, max_new_tokens=n).token_ids for p, n in ((PROMPTS[0], 3), (PROMPTS[1], 5))]

    async def stopper(m):
        async for step in m.steps():
            await m.model.layers[0].output
            if step == 1:
                m.stop()                       # ends this request only
                return "stopped"

    async def boom(m):
        await m.logits
        raise ValueError("bad request")

    async def main():
        results = {}

        async def go(key, coro):
            try:
                results[key] = await coro
            except Exception as exc:  # noqa: BLE001
                results[key] = exc

        async with Batcher(vm, max_batch=8, max_wait_ms=100) as b:
            async with anyio.create_task_group() as tg:
                tg.start_soon(go, "a", b.generate(PROMPTS[0], max_new_tokens=3))
                tg.start_soon(go, "b", b.generate(PROMPTS[1], stopper, max_new_tokens=5))
                tg.start_soon(go, "c", b.generate(PROMPTS[2], boom, max_new_tokens=2))
                tg.start_soon(go, "d", b.trace(PROMPTS[0], _read_logits))
            return results, dict(b.stats)

    res, stats = anyio.run(main)
    assert res["a"].tokens == solo[0] and res["a"].text == vm.decode(solo[0])
    assert res["b"].result == "stopped" and res["b"].tokens == solo[1][:1]
    assert isinstance(res["c"], ValueError)
    assert res["d"].shape == (1, vm.tokenizer.vocab_size) or res["d"].shape[0] == 1
    assert stats["max_batch_seen"] >= 3
