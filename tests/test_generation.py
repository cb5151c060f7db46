"""Generation with per-step control: steps, logits/tokens points, steering, stopping, errors."""

import anyio
import pytest
import torch

import asyncinterp as ai
from test_language import bounded

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def lm():
    return ai.models.tiny("llama")


@pytest.fixture(scope="module")
def reference(lm):
    """Plain transformers greedy generation of 10 tokens and hand-hooked layer reads."""
    reads = []

    def hook(module, args, output):
        reads.append(output[:, -1].clone())
    h = lm.module.model.layers[1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            enc = lm.tokenizer(PROMPT, return_tensors="pt")
            out = lm.module.generate(**enc, max_new_tokens=10, do_sample=False,
                                     pad_token_id=lm.tokenizer.pad_token_id)
    finally:
        h.remove()
    return out[0, enc["input_ids"].shape[1]:], reads


def test_per_step_reads_equal_hand_written_hooks(lm, reference):
    ref_tokens, ref_reads = reference
    steps = []

    async def per_step(m):
        reads = []
        async for step in m.steps():
            steps.append(step)
            reads.append((await m.model.layers[1].output)[:, -1].clone())
        return reads

    gen = lm.generate(PROMPT, per_step, max_new_tokens=10)
    assert steps == list(range(10))
    assert len(gen.result) == len(ref_reads) == 10
    for ours, theirs in zip(gen.result, ref_reads):
        assert torch.equal(ours, theirs)
    assert torch.equal(gen.tokens, ref_tokens)
    assert gen.text == lm.tokenizer.decode(ref_tokens, skip_special_tokens=True)
    assert not gen.stopped


def test_logits_and_tokens_points_per_step(lm, reference):
    ref_tokens, _ = reference

    async def watch(m):
        seen = []
        async for _ in m.steps():
            scores = await m.logits
            chosen = await m.tokens
            assert scores.shape == (1, lm.config.vocab_size)
            assert int(chosen) == int(scores.argmax(-1))
            seen.append(int(chosen))
            assert m.generated.tokens.tolist() == seen
        return seen
    gen = lm.generate(PROMPT, watch, max_new_tokens=10)
    assert gen.result == ref_tokens.tolist()


def test_editing_logits_forces_tokens(lm):
    target = lm.token_id(" the") if len(lm.to_tokens(" the")) == 1 else 5

    async def force(m):
        async for _ in m.steps():
            scores = await m.logits
            scores[:] = -1e9
            scores[:, target] = 0
    gen = lm.generate(PROMPT, force, max_new_tokens=4)
    assert gen.tokens.tolist() == [target] * 4

    async def replace(m):
        async for _ in m.steps():
            scores = await m.logits
            new = torch.full_like(scores, -1e9)
            new[:, target] = 0
            m.logits = new
    assert lm.generate(PROMPT, replace, max_new_tokens=3).tokens.tolist() == [target] * 3


class ForceEosAt:
    """A user logits processor that makes the model emit eos at generation step ``k``."""

    def __init__(self, k, eos, prompt_len):
        self.k, self.eos, self.prompt_len = k, eos, prompt_len

    def __call__(self, input_ids, scores):
        if input_ids.shape[1] - self.prompt_len == self.k:
            scores[:] = -float("inf")
            scores[:, self.eos] = 0
        return scores


def test_unbounded_step_loop_with_early_eos_ends_and_code_after_runs(lm, reference):
    ref_tokens, _ = reference
    eos = lm.tokenizer.eos_token_id
    prompt_len = len(lm.tokenizer(PROMPT)["input_ids"])
    after = []

    async def loop(m):
        n = 0
        async for _ in m.steps():
            await m.model.layers[0].output
            n += 1
        after.append(n)          # runs once generation is over
        return n

    gen = bounded(lambda: lm.generate(PROMPT, loop, max_new_tokens=10, eos_token_id=eos,
                                      logits_processor=[ForceEosAt(3, eos, prompt_len)]))
    assert after == [4]
    assert gen.result == 4
    assert gen.tokens.tolist() == ref_tokens[:3].tolist() + [eos]
    assert gen.text == lm.tokenizer.decode(ref_tokens[:3], skip_special_tokens=True)
    assert not gen.stopped


def test_early_eos_of_one_prompt_in_a_batch(lm, reference):
    """The batch goes on until every row is done; the finished row's result ends at its eos."""
    ref_tokens, _ = reference
    eos = lm.tokenizer.eos_token_id
    prompt_len = len(lm.tokenizer(PROMPT)["input_ids"])

    class OnlyRow0(ForceEosAt):
        def __call__(self, input_ids, scores):
            if input_ids.shape[1] - self.prompt_len == self.k:
                scores[0] = -float("inf")
                scores[0, self.eos] = 0
            return scores

    async def count(m):
        n = 0
        async for _ in m.steps():
            n += 1
        return n
    with lm.generate(max_new_tokens=6, eos_token_id=eos, logits_processor=[OnlyRow0(2, eos, prompt_len)]) as gen:
        a = gen.invoke(PROMPT, count)
        b = gen.invoke(PROMPT, count)
    assert a.tokens.tolist() == ref_tokens[:2].tolist() + [eos]
    assert b.tokens.tolist() == ref_tokens[:6].tolist()
    assert a.result == b.result == 6


def test_steering_changes_text_and_removing_it_restores_it(lm):
    base = lm.generate(PROMPT, max_new_tokens=8)
    direction = torch.randn(lm.config.hidden_size, generator=torch.Generator().manual_seed(1))

    async def steer(m):
        async for _ in m.steps():
            (await m.model.layers[0].output).add_(20.0 * direction)
    steered = lm.generate(PROMPT, steer, max_new_tokens=8)
    assert steered.text != base.text
    again = lm.generate(PROMPT, max_new_tokens=8)
    assert again.text == base.text
    assert torch.equal(again.tokens, base.tokens)


def test_stop_from_a_task_returns_what_was_generated(lm, reference):
    ref_tokens, _ = reference
    later = []

    async def stop_at_3(m):
        async for step in m.steps():
            await m.tokens
            if step == 3:
                m.stop()
                return step

    async def other(m):
        async for _ in m.steps():
            await m.model.layers[1].output
        later.append("after the loop")   # m.stop() ends step loops like the end of generation does
        return "done"

    with lm.generate(max_new_tokens=10) as gen:
        a = gen.invoke(PROMPT, stop_at_3)
        b = gen.invoke(PROMPT, other)
    assert a.result == 3
    assert a.stopped
    assert a.tokens.tolist() == ref_tokens[:4].tolist()
    assert b.tokens.tolist() == ref_tokens[:4].tolist()
    assert b.result == "done"
    assert later == ["after the loop"]

    # a task parked on a hook point when the model stops did not finish: its result raises RunStopped
    async def stop_at_1(m):
        async for step in m.steps():
            if step == 1:
                await m.model.layers[0].output
                m.stop()
                return step

    async def mid_step(m):
        async for step in m.steps():
            if step == 1:
                await m.model.layers[1].output
                later.append("unreachable")

    with lm.generate(max_new_tokens=10) as gen:
        a = gen.invoke(PROMPT, stop_at_1)
        c = gen.invoke(PROMPT, mid_step)
    assert a.result == 1
    with pytest.raises(ai.RunStopped):
        c.result
    assert later == ["after the loop"]


def test_stop_during_a_forward_keeps_tokens_of_finished_steps(lm, reference):
    ref_tokens, _ = reference

    async def stop_in_step_2(m):
        async for step in m.steps():
            await m.model.layers[0].output
            if step == 2:
                m.stop()
                return "stopped"
    gen = lm.generate(PROMPT, stop_in_step_2, max_new_tokens=10)
    assert gen.result == "stopped"
    assert gen.tokens.tolist() == ref_tokens[:2].tolist()


def test_batched_generation_equals_solo(lm):
    prompts = [PROMPT, "Hi", "The quick brown fox jumps over"]
    solo = [lm.generate(p, max_new_tokens=6) for p in prompts]

    async def last_hidden(m):
        out = []
        async for _ in m.steps():
            out.append((await m.model.layers[1].output)[:, -1].clone())
        return out
    solo_reads = [lm.generate(p, last_hidden, max_new_tokens=6).result for p in prompts]
    with lm.generate(max_new_tokens=6) as gen:
        invs = [gen.invoke(p, last_hidden) for p in prompts]
    for s, r, inv in zip(solo, solo_reads, invs):
        assert torch.equal(inv.tokens, s.tokens)
        assert inv.text == s.text
        for a, b in zip(inv.result, r):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_list_prompt_generation_gives_lists(lm):
    gen = lm.generate(["Hi", PROMPT], max_new_tokens=3)
    assert isinstance(gen.text, list) and len(gen.text) == 2
    assert isinstance(gen.tokens, list) and all(t.shape == (3,) for t in gen.tokens)
    assert gen.sequences.shape[0] == 2
    assert gen.result is None


def test_user_logits_processor_still_applies(lm):
    from transformers import LogitsProcessor

    class Ban(LogitsProcessor):
        def __init__(self, banned):
            self.banned = banned

        def __call__(self, input_ids, scores):
            scores[:, self.banned] = -float("inf")
            return scores
    base = lm.generate(PROMPT, max_new_tokens=1).tokens.tolist()

    async def see(m):
        return float((await m.logits)[0, base[0]])
    gen = lm.generate(PROMPT, see, max_new_tokens=1, logits_processor=[Ban(base[0])])
    assert gen.result == -float("inf")
    assert gen.tokens.tolist() != base


def test_agenerate_with_asyncio_and_trio(lm, reference):
    ref_tokens, _ = reference

    async def count(m):
        n = 0
        async for _ in m.steps():
            n += 1
        return n

    async def main():
        return await lm.agenerate(PROMPT, count, max_new_tokens=5)
    for backend in ("asyncio", "trio"):
        gen = anyio.run(main, backend=backend)
        assert gen.result == 5
        assert gen.tokens.tolist() == ref_tokens[:5].tolist()


def test_async_with_generation_builder(lm):
    async def main():
        async with lm.generate(max_new_tokens=2) as gen:
            a = gen.invoke("Hi")
        return a
    assert len(anyio.run(main).tokens) == 2


# ------------------------------------------------------------------ errors, never hangs

def test_out_of_order_inside_a_step_raises(lm):
    async def backwards(m):
        async for _ in m.steps():
            await m.model.layers[1].output
            await m.model.layers[0].output
    with pytest.raises(ai.OutOfOrderError, match=r"model\.layers\.0\.output.*already ran"):
        bounded(lambda: lm.generate(PROMPT, backwards, max_new_tokens=5))


def test_module_point_after_logits_is_out_of_order(lm):
    async def late(m):
        await m.logits
        await m.model.layers[0].output
    with pytest.raises(ai.OutOfOrderError, match="already ran"):
        bounded(lambda: lm.generate(PROMPT, late, max_new_tokens=5))

    async def tokens_then_logits(m):
        await m.tokens
        await m.logits
    with pytest.raises(ai.OutOfOrderError, match="logits"):
        bounded(lambda: lm.generate(PROMPT, tokens_then_logits, max_new_tokens=5))


def test_step_code_that_never_awaits_ends_cleanly(lm):
    async def idle(m):
        n = 0
        async for _ in m.steps():
            n += 1          # no hook point awaited in the body
        return n

    async def nothing(m):
        return "done"
    assert bounded(lambda: lm.generate(PROMPT, idle, max_new_tokens=4)).result == 4
    assert bounded(lambda: lm.generate(PROMPT, nothing, max_new_tokens=4)).result == "done"


def test_point_after_generation_ended_is_a_clear_error(lm):
    async def after(m):
        async for _ in m.steps():
            pass
        await m.model.layers[0].output
    with pytest.raises(ai.MissedHookPoint, match="run has already ended"):
        bounded(lambda: lm.generate(PROMPT, after, max_new_tokens=3))


def test_second_call_in_one_step_is_missed_not_bound_to_next_step(lm):
    async def twice(m):
        async for step in m.steps():
            if step == 1:
                await m.model.layers[0].output
                await m.model.layers[0].output   # layer 0 runs once per step
    with pytest.raises(ai.MissedHookPoint, match=r"call #2.*before its step ended.*m\.steps\(\)"):
        bounded(lambda: lm.generate(PROMPT, twice, max_new_tokens=5))


class PrefillProbe(torch.nn.Module):
    def forward(self, x):
        return x


@pytest.fixture(scope="module")
def probe_lm():
    """A tiny Llama with a module that only runs in the prefill pass (more than one new token)."""
    from asyncinterp.models.hf.bundled import tiny_llama
    hf, tok = tiny_llama()
    hf.probe = PrefillProbe()
    original = hf.forward

    def forward(input_ids=None, **kwargs):
        if input_ids is not None and input_ids.shape[1] > 1:
            hf.probe(input_ids)
        return original(input_ids=input_ids, **kwargs)
    hf.forward = forward
    return ai.LanguageModel(hf, tok)


def test_prefill_only_point_awaited_in_decode_is_a_clear_error(probe_lm):
    async def prefill_read(m):
        return (await m.probe.output).shape

    assert probe_lm.generate(PROMPT, prefill_read, max_new_tokens=3).result[0] == 1

    async def in_decode(m):
        async for step in m.steps():
            if step == 1:
                await m.probe.output
    with pytest.raises(ai.MissedHookPoint, match=r"probe\.output.*never ran before its step ended"):
        bounded(lambda: probe_lm.generate(PROMPT, in_decode, max_new_tokens=5))

    async def in_last_step(m):
        async for step in m.steps():
            if step == 2:
                await m.probe.output
    with pytest.raises(ai.MissedHookPoint, match=r"probe\.output.*never ran before the run ended"):
        bounded(lambda: probe_lm.generate(PROMPT, in_last_step, max_new_tokens=3))


def test_tokens_point_is_read_only(lm):
    async def replace(m):
        t = await m.tokens
        m.tokens = t + 1
    with pytest.raises(ai.ReplacementError, match="read-only"):
        bounded(lambda: lm.generate(PROMPT, replace, max_new_tokens=3))


def test_unsupported_generation_options(lm):
    with pytest.raises(ValueError, match="num_beams"):
        lm.generate(PROMPT, max_new_tokens=3, num_beams=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        lm.generate(PROMPT, max_new_tokens=0)
    with pytest.raises(TypeError, match="keyword"):
        with lm.generate(max_new_tokens=2) as gen:
            gen.invoke(PROMPT, logits_to_keep=1)


def test_generated_outside_generation(lm):
    async def peek(m):
        return m.generated
    with pytest.raises(ai.NotInRunError, match="generate"):
        lm.trace(PROMPT, peek)


# ------------------------------------------------------------------ cancellation and cleanup

def test_cancelling_agenerate_stops_at_next_step_and_cleans_up(lm):
    import time

    from conftest import hook_count

    async def slow(m):
        async for _ in m.steps():
            await m.model.layers[0].output
            time.sleep(0.02)            # a slow intervention: 200 steps would take > 4 s

    async def main():
        with anyio.fail_after(0.5):
            await lm.agenerate(PROMPT, slow, max_new_tokens=200)
    start = time.perf_counter()
    with pytest.raises(TimeoutError):
        anyio.run(main)
    assert time.perf_counter() - start < 3.0
    assert hook_count(lm.module) == 0
    assert lm.generate(PROMPT, max_new_tokens=2).tokens.shape == (2,)   # the model works as before


def test_no_references_left_after_many_generations(lm):
    import gc
    import weakref

    from conftest import hook_count

    class Marker:
        pass
    refs = []

    async def keeps(m):
        marker = Marker()
        refs.append(weakref.ref(marker))
        async for step in m.steps():
            h = await m.model.layers[0].output
            refs.append(weakref.ref(h))
            if step == 1 and len(refs) % 3 == 0:
                raise RuntimeError("fails sometimes")
        return None

    for _ in range(60):
        try:
            gen = lm.generate(["Hi", PROMPT], keeps, max_new_tokens=3)
            del gen
        except RuntimeError:
            pass
    gc.collect()
    assert sum(r() is not None for r in refs) == 0
    assert hook_count(lm.module) == 0
    assert all(hook_count(p.envoy.module) == 0 for p in lm.generation_points.values())


def test_step_slices(lm, reference):
    ref_tokens, _ = reference

    async def window(m):
        seen = []
        async for step in m.steps(2, 5):
            seen.append((step, int((await m.tokens)[0])))
        return seen

    async def first_three(m):
        return [step async for step in m.steps(3)]

    with lm.generate(max_new_tokens=8) as gen:
        a = gen.invoke(PROMPT, window)
        b = gen.invoke(PROMPT, first_three)
    assert a.result == [(s, int(ref_tokens[s])) for s in (2, 3, 4)]
    assert b.result == [0, 1, 2]
    assert a.tokens.tolist() == ref_tokens[:8].tolist()   # a loop that ends by its range does not stop generation
    with pytest.raises(ValueError, match="start at 0"):
        ai.Steps(-1, 2)


def test_break_out_of_steps_ends_the_generation(lm, reference):
    ref_tokens, _ = reference

    async def until_step_2(m):
        async for step in m.steps():
            await m.tokens
            if step == 2:
                break
        return "left"

    gen = lm.generate(PROMPT, until_step_2, max_new_tokens=10)
    assert gen.result == "left"
    assert gen.stopped
    assert gen.tokens.tolist() == ref_tokens[:3].tolist()

    # another intervention still iterating keeps the generation going
    async def all_steps(m):
        return len([s async for s in m.steps()])

    with lm.generate(max_new_tokens=6) as tr:
        a = tr.invoke(PROMPT, until_step_2)
        b = tr.invoke(PROMPT, all_steps)
    assert a.result == "left" and b.result == 6
    assert not a.stopped
    assert a.tokens.tolist() == ref_tokens[:6].tolist()
