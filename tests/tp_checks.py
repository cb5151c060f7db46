"""The checks of tests/test_tp.py, run on every rank of one 2-process job (gloo, CPU).

``tests/test_tp.py`` starts this script once per test module with the
launcher (``asyncinterp.distributed.launch``), so the process group and the
models are made once; each rank writes what it measured to
``OUT/rank<r>.json`` and pytest asserts on it. Every check compares the
tensor-parallel model (``tp_plan="auto"`` or column/row-parallel layers) with
the same weights loaded unsharded in the same process (TP=1).

The last phase makes rank 1 fail on purpose (an intervention that raises on
rank 1 only) and records what rank 0 got.
"""

import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

import asyncinterp as ai
from asyncinterp import distributed as tp

PROMPTS = ["The quick brown fox jumps over", "Hello world"]
RESULTS = {}


def check(fn):
    t0 = time.perf_counter()
    try:
        RESULTS[fn.__name__] = fn()
    except Exception:  # noqa: BLE001 - reported to pytest, which fails the test with this text
        RESULTS[fn.__name__] = {"error": traceback.format_exc()}
    RESULTS[fn.__name__]["seconds"] = round(time.perf_counter() - t0, 2)
    return fn


def tensors(value):
    """The tensors in a (nested) hook value, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in tensors(v)]
    if hasattr(value, "to_tuple"):
        return tensors(value.to_tuple())
    return []


def compare(a, b):
    """``(shapes equal, max abs difference)`` of two lists of tensors."""
    ta, tb = tensors(a), tensors(b)
    if [tuple(t.shape) for t in ta] != [tuple(t.shape) for t in tb]:
        return False, float("inf"), [tuple(t.shape) for t in ta], [tuple(t.shape) for t in tb]
    diff = max((float((x.detach().float() - y.detach().float()).abs().max()) for x, y in zip(ta, tb) if x.numel()),
               default=0.0)
    return True, diff, None, None


# ----------------------------------------------------------------------------- models


def build_llama_dir(path):
    """A tiny random Llama (4 heads, 2 key/value heads, 2 layers) saved with the GPT-2 tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from asyncinterp.models.hf.bundled import gpt2_tokenizer
    tok = gpt2_tokenizer()
    vocab = len(tok) + len(tok) % 2          # lm_head is split over 2 ranks: an even vocabulary
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)


def load_pair(path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    one = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    two = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", attn_implementation="eager").eval()
    return ai.LanguageModel(one, tok), ai.LanguageModel(two, tok)


# ----------------------------------------------------------------------------- interventions

LAYER_POINTS = ("resid_pre", "attn.q", "attn.k", "attn.v", "attn.pattern", "resid_mid", "mlp.pre", "mlp.post",
                "resid_post")


def point(m, layer, name):
    e = m.model.layers[layer]
    for part in name.split("."):
        e = getattr(e, part)
    return e


async def read_points(m):
    out = {}
    for layer in range(2):
        for name in LAYER_POINTS:
            out[f"{layer}.{name}"] = (await point(m, layer, name)).detach().clone()
    out["logits"] = (await m.lm_head.output).detach().clone()
    return out


async def edit_in_place(m):
    q = await m.model.layers[0].self_attn.q_proj.output       # column-parallel: gathered, edited, re-sharded
    q[..., 16:32] = 0.0                                        # head 1 (held by rank 0 at TP=2)
    q[..., 40:48] *= -2.0                                      # part of head 2 (rank 1)
    pre = await m.model.layers[0].mlp.pre
    pre.mul_(0.5)
    k = await m.model.layers[1].attn.k
    k[:, :, 1] = 0.0                                           # key/value head 1
    return (await m.lm_head.output).detach().clone()


async def edit_replace(m):
    o_in = await m.model.layers[0].self_attn.o_proj.input     # row-parallel input
    m.model.layers[0].self_attn.o_proj.input = o_in * 1.5
    v = await m.model.layers[1].attn.v
    m.model.layers[1].attn.v = v.flip(-1)
    up = await m.model.layers[1].mlp.up_proj.output
    m.model.layers[1].mlp.up_proj.output = torch.tanh(up)
    return (await m.lm_head.output).detach().clone()


async def plain_logits(m):
    return (await m.lm_head.output).detach().clone()


async def local_q(m):
    full = (await m.model.layers[0].self_attn.q_proj.output).detach().clone()
    return full


async def local_q_shard(m):
    return (await tp.local_shard(m.model.layers[0].self_attn.q_proj.output)).detach().clone()


async def steer(m):
    seen = []
    async for step in m.steps():
        q = await m.model.layers[0].self_attn.q_proj.output
        seen.append(list(q.shape))
        q[..., :16] *= 3.0                                     # a sharded edit at every step
        h = await m.model.layers[1].resid_post
        h[:, -1] += 0.5 * step
    return seen


# ----------------------------------------------------------------------------- checks on Llama


def llama_checks(one, two):
    ids = torch.tensor([[5, 17, 99, 3, 250, 1000, 42]])

    @check
    def llama_every_module():
        out = {}
        for mode in ("grad", "no_grad"):
            ctx = torch.no_grad() if mode == "no_grad" else torch.enable_grad()
            with ctx:
                c1 = ai.cache(one, ids, None, inputs=True)
                c2 = ai.cache(two, ids, None, inputs=True)
            bad, worst = [], 0.0
            for key in c1.keys():
                same, diff, s1, s2 = compare(c1[key], c2[key])
                if not same:
                    bad.append([key, s1, s2])
                else:
                    worst = max(worst, diff)
            out[mode] = {"keys": len(list(c1.keys())), "keys_tp": len(list(c2.keys())), "shape_mismatch": bad,
                         "max_diff": worst,
                         "sharded_seen": [k for k in c1.keys() if k.endswith("q_proj.output")]}
        return out

    @check
    def llama_points():
        def run(model):
            with model.trace() as t:
                a = t.invoke(PROMPTS[0], read_points)
                b = t.invoke(PROMPTS[1], read_points)
            return [a.result, b.result]
        r1, r2 = run(one), run(two)
        bad, worst = [], 0.0
        for d1, d2 in zip(r1, r2):
            for key in d1:
                same, diff, s1, s2 = compare(d1[key], d2[key])
                if not same:
                    bad.append([key, s1, s2])
                worst = max(worst, diff) if same else worst
        return {"points": len(r1[0]) * 2, "shape_mismatch": bad, "max_diff": worst,
                "q_shape": list(r2[0]["0.attn.q"].shape)}

    @check
    def llama_edits():
        base = one.trace(ids, plain_logits)
        out = {}
        for fn in (edit_in_place, edit_replace):
            l1, l2 = one.trace(ids, fn), two.trace(ids, fn)
            out[fn.__name__] = {"max_diff": float((l1 - l2).abs().max()), "effect": float((l1 - base).abs().max())}
        return out

    @check
    def llama_local_shard():
        full = two.trace(ids, local_q)
        mine = two.trace(ids, local_q_shard)
        r, w = tp.rank(), tp.world_size()
        n = full.shape[-1] // w
        return {"full": list(full.shape), "local": list(mine.shape),
                "is_my_slice": bool(torch.equal(mine, full[..., r * n:(r + 1) * n]))}

    @check
    def llama_generate():
        g1 = one.generate(PROMPTS[0], steer, max_new_tokens=6)
        g2 = two.generate(PROMPTS[0], steer, max_new_tokens=6)
        plain = one.generate(PROMPTS[0], max_new_tokens=6)
        return {"tokens_tp1": g1.tokens.tolist(), "tokens_tp2": g2.tokens.tolist(), "plain": plain.tokens.tolist(),
                "q_shapes_tp2": g2.result, "q_shapes_tp1": g1.result}

    @check
    def llama_sampling():
        # no seed given: the ranks take rank 0's (else each would draw its own tokens)
        g = two.generate(PROMPTS[0], max_new_tokens=8, do_sample=True)
        return {"tokens": g.tokens.tolist()}

    @check
    def llama_generate_cache():
        c1 = ai.Cache("model.layers.*.self_attn.q_proj")
        c2 = ai.Cache("model.layers.*.self_attn.q_proj")
        one.generate(PROMPTS[1], c1, max_new_tokens=3)
        two.generate(PROMPTS[1], c2, max_new_tokens=3)
        key = "model.layers.1.self_attn.q_proj.output"
        a, b = c1.all(key), c2.all(key)
        return {"steps": [len(a), len(b)], "shapes": [[list(t.shape) for t in a], [list(t.shape) for t in b]],
                "max_diff": max(float((x - y).abs().max()) for x, y in zip(a, b))}


# ----------------------------------------------------------------------------- column/row-parallel model


def colrow_checks():
    torch.manual_seed(1)
    full = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    sharded = torch.nn.Sequential(
        tp.ColumnParallelLinear.from_linear(full[0]), tp.Elementwise(torch.nn.GELU()),
        tp.RowParallelLinear.from_linear(full[2]), torch.nn.Tanh(),
        tp.ColumnParallelLinear.from_linear(full[4]), tp.Elementwise(torch.nn.ReLU()),
        tp.RowParallelLinear.from_linear(full[6]))
    one, two = ai.wrap(full), tp.wrap(sharded)
    x = torch.randn(3, 8)

    async def read_all(m):
        out = []
        for i in range(7):
            out.append((await m[i].input).detach().clone())
            out.append((await m[i].output).detach().clone())
        return out

    async def edit(m):
        h = await m[0].output
        h[:, 5:20] = 0.0
        a = await m[5].output
        m[5].output = a * 3.0
        return (await m[6].output).detach().clone()

    async def local(m):
        return (await tp.local_shard(m[4].output)).detach().clone(), (await m[6].input).detach().clone()

    @check
    def colrow():
        r1, r2 = one.trace(x, read_all), two.trace(x, read_all)
        same, diff, s1, s2 = compare(r1, r2)
        e1, e2 = one.trace(x, edit), two.trace(x, edit)
        shard, down_in = two.trace(x, local)
        return {"shapes_equal": same, "shapes": [s1, s2], "max_diff": diff,
                "edit_diff": float((e1 - e2).abs().max()), "edit_effect": float((e1 - one.trace(x, read_all)[-1]).abs().max()),
                "local": list(shard.shape), "full_down_input": list(down_in.shape)}


# ----------------------------------------------------------------------------- a DTensor handed on


class ToDTensor(torch.nn.Module):
    """Hands on this rank's columns of its input as a ``DTensor`` sharded on dim 1 (a style with local output off)."""

    def __init__(self, mesh):
        super().__init__()
        self.mesh = mesh

    def forward(self, x):
        from torch.distributed.tensor import DTensor, Shard
        n = x.shape[1] // tp.world_size()
        return DTensor.from_local(x[:, tp.rank() * n:(tp.rank() + 1) * n], self.mesh, [Shard(1)], run_check=False)


class FromDTensor(torch.nn.Module):
    def forward(self, d):
        return d.full_tensor() * 2.0


def dtensor_checks():
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (tp.world_size(),))
    model = tp.wrap(torch.nn.Sequential(ToDTensor(mesh), FromDTensor()))
    x = torch.arange(12.0).reshape(2, 6)

    async def edit(m):
        d = await m[0].output                       # the full [2, 6] tensor, not a DTensor shard
        seen = (type(d).__name__, list(d.shape), bool(torch.equal(d, x)))
        d[:, 0] = 100.0                             # rank 0's column: written back into the DTensor
        d[:, 5] = -1.0                              # rank 1's column
        return seen, (await m[1].output).clone()

    @check
    def dtensor():
        seen, out = model.trace(x, edit)
        want = x.clone()
        want[:, 0], want[:, 5] = 100.0, -1.0
        return {"type": seen[0], "shape": seen[1], "equal_input": seen[2],
                "after_edit": bool(torch.equal(out, want * 2.0))}


# ----------------------------------------------------------------------------- GPT-2


def gpt2_check(path):
    @check
    def gpt2_plan():
        from transformers import GPT2Config, GPT2LMHeadModel
        if tp.rank() == 0:
            torch.manual_seed(0)
            GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)).save_pretrained(path)
        dist.barrier()
        try:
            m = GPT2LMHeadModel.from_pretrained(path, tp_plan="auto").eval()
        except Exception as exc:  # noqa: BLE001 - what transformers says is the finding
            return {"loaded": False, "error": f"{type(exc).__name__}: {exc}"[:400]}
        from torch.distributed.tensor import DTensor
        ref = GPT2LMHeadModel.from_pretrained(path).eval()
        ids = torch.tensor([[1, 2, 3, 4]])

        async def read(m):
            return [(await m.transformer.h[i].attn.c_attn.output).detach().clone() for i in range(2)] + \
                [(await m.lm_head.output).detach().clone()]
        same, diff, _, _ = compare(ai.LanguageModel(ref).trace(ids, read), ai.LanguageModel(m).trace(ids, read))
        return {"loaded": True, "tp_size": m.tp_size, "wrapped": type(ai.LanguageModel(m)).__name__,
                "sharded_params": sum(isinstance(p, DTensor) for p in m.parameters()),
                "plan": dict(m.tp_plan), "reads_equal": same and diff < 1e-5}


# ----------------------------------------------------------------------------- a failing rank


async def fails_on_rank_1(m):
    await m.model.layers[0].self_attn.q_proj.output
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    await m.model.layers[1].self_attn.q_proj.output            # rank 0 goes on: a collective rank 1 never joins
    return (await m.lm_head.output).sum().item()


def failure_phase(two, out_dir):
    ids = torch.tensor([[5, 17, 99, 3]])
    t0 = time.perf_counter()
    try:
        two.trace(ids, fails_on_rank_1)
        got = {"raised": None}
    except Exception as exc:  # noqa: BLE001 - what each rank got is the finding
        got = {"raised": type(exc).__name__, "message": str(exc)[:3000],
               "failures": sorted(getattr(exc, "failures", {}))}
    got["seconds"] = round(time.perf_counter() - t0, 2)
    RESULTS["failure"] = got
    write(out_dir)


def docs_check(path):
    @check
    def docs_page():
        from docsnippets import python_blocks, run_page
        ns = run_page("tensor-parallel.md", {"MODEL_DIR": path})
        return {"blocks": len(python_blocks("tensor-parallel.md")), "top": ns["top"].tolist(),
                "generated": ns["gen"].tokens.tolist()}


def write(out_dir):
    with open(os.path.join(out_dir, f"rank{tp.rank()}.json"), "w") as f:
        json.dump(RESULTS, f)


def main(out_dir):
    t0 = time.perf_counter()
    tp.init()
    path = os.path.join(out_dir, "llama")
    if tp.rank() == 0:
        build_llama_dir(path)
    dist.barrier()
    one, two = load_pair(path)
    RESULTS["wrapped"] = type(two).__name__
    RESULTS["setup_seconds"] = round(time.perf_counter() - t0, 2)
    llama_checks(one, two)
    colrow_checks()
    dtensor_checks()
    gpt2_check(os.path.join(out_dir, "gpt2"))
    docs_check(path)
    write(out_dir)
    failure_phase(two, out_dir)


if __name__ == "__main__":
    main(sys.argv[1])
