"""Harvest reductions (issue 32 item 7): running mean/variance, top-k windows, histograms, difference of means.

Every result is checked against an independent reference over the concatenated activations (torch.mean /
torch.var, a brute-force sort, numpy.histogram), and every merge of partial states, in any split and any
order, against one reduction that saw every window: bit for bit. The steering vector goes through the
server's own ``--edit NAME=steer:@FILE`` path and is compared with a hand-written torch hook.
"""

import random

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import asyncinterp as ai
from asyncinterp.harvesting.batch import HarvestBatch
from asyncinterp.harvesting.reductions import Histogram, MeanVar, TopK, difference_of_means
from asyncinterp.harvesting.steering import SteeringVector

POINT = "blocks.1.hook_resid_post"


def batches(acts, size, point=POINT, first=0):
    """``acts`` ``[N, P, D]`` as HarvestBatches of ``size`` windows, window ids from ``first``."""
    out = []
    for s in range(0, acts.shape[0], size):
        a = acts[s:s + size]
        ids = torch.arange(first + s, first + s + a.shape[0])
        out.append(HarvestBatch(ids, torch.zeros(a.shape[0], 4, dtype=torch.int64), {point: a}))
    return out


def fed(make, bs):
    r = make()
    for b in bs:
        r.update(b)
    return r


def roundtrip(r, make, tmp_path, name="state"):
    """``r``'s state through a safetensors file, into a fresh reduction."""
    path = tmp_path / f"{name}.safetensors"
    state = r.state_dict()
    save_file(state, str(path)) if state else path.write_bytes(b"")
    fresh = make()
    fresh.load_state_dict(load_file(str(path)) if state else {})
    return fresh


def split_and_merge(make, bs, cuts, order):
    """Reductions over consecutive pieces of ``bs`` (cut at ``cuts``), merged in the order ``order``."""
    pieces = [bs[a:b] for a, b in zip([0, *cuts], [*cuts, len(bs)])]
    parts = [fed(make, p) for p in pieces]
    total = make()
    for i in order:
        total.merge(parts[i])
    return total


def assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture
def acts():
    g = torch.Generator().manual_seed(0)
    return torch.randn(37, 5, 12, generator=g) * torch.linspace(0.1, 4, 12) + torch.linspace(-3, 3, 12)


# ----------------------------------------------------------------------------- mean and variance
def test_mean_var_equals_torch_over_the_concatenated_activations(acts):
    r = fed(lambda: MeanVar(POINT), batches(acts, 4))
    flat = acts.reshape(-1, acts.shape[-1]).double()
    res = r.result()
    assert int(res["count"]) == flat.shape[0]
    torch.testing.assert_close(res["mean"], flat.mean(0), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(res["var"], flat.var(0), rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(res["std"], flat.std(0), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("cuts,order", [([3], [0, 1]), ([3], [1, 0]), ([1, 2, 7], [2, 0, 3, 1]), ([5], [1, 0])])
def test_mean_var_merges_of_any_split_are_bit_equal_to_one_pass(acts, cuts, order, tmp_path):
    make = lambda: MeanVar(POINT)   # noqa: E731
    one = fed(make, batches(acts, 4)).result()
    merged = split_and_merge(make, batches(acts, 4), cuts, order)
    assert_same(merged.result(), one)
    # other batch sizes give the same bits too (statistics are per window), and through a saved state
    assert_same(roundtrip(fed(make, batches(acts, 7)), make, tmp_path).result(), one)


def test_mean_var_resumes_from_a_saved_state(acts, tmp_path):
    make = lambda: MeanVar(POINT)   # noqa: E731
    bs = batches(acts, 4)
    half = roundtrip(fed(make, bs[:4]), make, tmp_path)
    for b in bs[4:]:
        half.update(b)
    assert_same(half.result(), fed(make, bs).result())


def test_mean_var_is_stable_under_a_large_offset():
    g = torch.Generator().manual_seed(1)
    # fp32 activations around 1e9, spread 200: the naive E[x^2] - E[x]^2 loses everything in float64
    acts = (1e9 + torch.randn(64, 16, 6, generator=g, dtype=torch.float64) * 200).to(torch.float32)
    flat = acts.reshape(-1, 6).double()
    want = ((flat - flat.mean(0)) ** 2).sum(0) / (flat.shape[0] - 1)       # two-pass reference
    assert torch.allclose(flat.var(0), want, rtol=1e-9)
    naive = ((flat ** 2).sum(0) - flat.sum(0) ** 2 / flat.shape[0]) / (flat.shape[0] - 1)
    assert ((naive - want).abs() / want).max() > 1e-3                        # the naive formula fails here
    got = fed(lambda: MeanVar(POINT), batches(acts, 5)).result()["var"]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=0)


def test_mean_var_refuses_counting_a_window_twice(acts):
    a = fed(lambda: MeanVar(POINT), batches(acts, 4)[:3])
    b = fed(lambda: MeanVar(POINT), batches(acts, 4)[2:5])
    with pytest.raises(ValueError, match="counted already"):
        a.merge(b)
    with pytest.raises(ValueError, match="same reduction"):
        a.merge(MeanVar("blocks.0.hook_resid_post"))
    with pytest.raises(KeyError, match="no point 'blocks.0.hook_resid_post'"):
        MeanVar("blocks.0.hook_resid_post").update(batches(acts, 4)[0])
    with pytest.raises(ValueError, match="no windows"):
        MeanVar(POINT).result()


# ----------------------------------------------------------------------------- top-k windows
def reference_topk(acts, k, directions=None, first=0):
    """Brute force: every window's score (max over positions), sorted by value descending then window id."""
    if directions is None:
        scores = acts.transpose(1, 2)                                     # [N, F, P]
    else:
        scores = torch.stack([directions @ w.T for w in acts])            # [N, F, P]
    best, _ = scores.max(-1)
    out = []
    for f in range(best.shape[1]):
        rows = sorted(range(best.shape[0]), key=lambda w: (-float(best[w, f]), w))[:k]
        pos = [int((scores[w, f] == best[w, f]).nonzero()[0]) for w in rows]
        out.append(([float(best[w, f]) for w in rows], [w + first for w in rows], pos))
    return out


def check_topk(res, ref):
    for f, (vals, ids, pos) in enumerate(ref):
        assert res["window_ids"][f].tolist() == ids
        assert res["values"][f].tolist() == vals
        assert res["positions"][f].tolist() == pos


@pytest.mark.parametrize("shape", [None, "vector", "matrix"])
def test_topk_equals_a_brute_force_sort(acts, shape):
    g = torch.Generator().manual_seed(2)
    directions = {None: None, "vector": torch.randn(12, generator=g),
                  "matrix": torch.randn(3, 12, generator=g)}[shape]
    r = fed(lambda: TopK(POINT, k=4, directions=directions), batches(acts, 6))
    dirs = None if directions is None else directions.reshape(-1, 12)
    check_topk(r.result(), reference_topk(acts, 4, dirs))


def test_topk_ties_go_to_the_lower_window_whatever_the_order(tmp_path):
    # quantised values: many windows tie for first place; positions tie inside windows too
    g = torch.Generator().manual_seed(3)
    acts = torch.randint(0, 3, (40, 4, 5), generator=g).float()
    make = lambda: TopK(POINT, k=6)   # noqa: E731
    bs = batches(acts, 3)
    one = fed(make, bs).result()
    check_topk(one, reference_topk(acts, 6))
    shuffled = bs[:]
    random.Random(0).shuffle(shuffled)
    assert_same(fed(make, shuffled).result(), one)
    for cuts, order in (([4], [1, 0]), ([2, 9, 11], [3, 1, 0, 2])):
        merged = split_and_merge(make, bs, cuts, order)
        assert_same(roundtrip(merged, make, tmp_path).result(), one)
    with pytest.raises(ValueError, match="counted twice"):
        fed(make, bs).merge(fed(make, bs[:2]))


def test_topk_with_fewer_windows_than_k_pads_and_refuses_nan(acts):
    r = fed(lambda: TopK(POINT, k=50), batches(acts, 8))
    res = r.result()
    assert res["window_ids"].shape == (12, 50)
    assert (res["window_ids"][:, 37:] == -1).all() and torch.isinf(res["values"][:, 37:]).all()
    bad = acts.clone()
    bad[9, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN activation in window 9"):
        fed(lambda: TopK(POINT, k=2), batches(bad, 8))
    with pytest.raises(ValueError, match="directions of width 5"):
        fed(lambda: TopK(POINT, k=2, directions=torch.ones(5)), batches(acts, 8))


class JumpReLUSAE(torch.nn.Module):
    """SAELens's JumpReLU layout, as docs/attach.md builds it."""

    def __init__(self, d_in, d_sae):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.W_enc = torch.nn.Parameter(torch.randn(d_in, d_sae, generator=g) / d_in ** 0.5)
        self.b_enc = torch.nn.Parameter(torch.randn(d_sae, generator=g) * 0.1)
        self.W_dec = torch.nn.Parameter(torch.randn(d_sae, d_in, generator=g) / d_sae ** 0.5)
        self.b_dec = torch.nn.Parameter(torch.zeros(d_in))
        self.threshold = torch.nn.Parameter(torch.full((d_sae,), 0.05))
        self.hook_sae_acts_post = torch.nn.Identity()

    def encode(self, x):
        pre = (x - self.b_dec) @ self.W_enc + self.b_enc
        return self.hook_sae_acts_post(torch.relu(pre) * (pre > self.threshold))

    def forward(self, x):
        return self.encode(x) @ self.W_dec + self.b_dec


def test_topk_per_sae_feature_read_at_the_spliced_sae(gpt2_hf, tmp_path):
    """The SAE attached and spliced in at blocks.1.hook_resid_post (docs/attach.md); its feature point feeds TopK."""
    model = ai.wrap(gpt2_hf)
    sae = JumpReLUSAE(32, 24)
    model.attach("sae", sae)
    feature_point = "sae.hook_sae_acts_post"

    async def splice(m):
        features = await ai.spawn(m.sae.hook_sae_acts_post.output)
        point = m.at(POINT)
        point.replace(m.sae(await point))
        return (await features).clone()

    g = torch.Generator().manual_seed(5)
    windows = torch.randint(0, 100, (10, 7), generator=g)
    r = TopK(feature_point, k=3)
    feats = []
    with torch.no_grad():
        for s in range(0, 10, 4):
            ids = windows[s:s + 4]
            f = model.trace(ids, splice)
            feats.append(f)
            r.update(HarvestBatch(torch.arange(s, s + ids.shape[0]), ids, {feature_point: f}))
    # the reference: the SAE's encoder applied by hand to the residual read by a plain torch hook
    seen = []
    h = gpt2_hf.transformer.h[1].register_forward_hook(
        lambda mod, a, out: seen.append(out[0] if isinstance(out, tuple) else out))
    with torch.no_grad():
        gpt2_hf(windows)
        want = sae.encode(seen[0])
    h.remove()
    torch.testing.assert_close(torch.cat(feats), want)
    check_topk(r.result(), reference_topk(torch.cat(feats), 3))

    # TopK(point, sae=...) reads the same features at the SAE's own point, from the harvested residual,
    # here through ai.harvest over the same windows (pre-tokenised rows), keeping only the reduction
    import datasets
    rows = datasets.Dataset.from_dict({"input_ids": windows.tolist()})
    by_sae = TopK(POINT, k=3, sae=sae)
    res = ai.harvest(ai.wrap(gpt2_hf), rows, [POINT], str(tmp_path / "h"), context_size=7, batch_size=4,
                     shard_windows=4, reductions=[by_sae], save_activations=False, progress=False)
    got = res.reductions[by_sae.name]
    want = r.result()
    assert got["window_ids"].tolist() == want["window_ids"].tolist()
    assert got["positions"].tolist() == want["positions"].tolist()
    torch.testing.assert_close(got["values"], want["values"])
    with pytest.raises(ValueError, match="no submodule 'nope'"):
        TopK(POINT, sae=sae, feature="nope")


# ----------------------------------------------------------------------------- histograms
def test_histogram_equals_numpy_and_merges_exactly(acts, tmp_path):
    edges = [-6.0, -2.0, -0.5, 0.0, 0.5, 1.0, 4.0]
    make = lambda: Histogram(POINT, edges)   # noqa: E731
    bs = batches(acts, 5)
    res = fed(make, bs).result()
    flat = acts.reshape(-1).double().numpy()
    want, _ = np.histogram(flat, bins=np.array(edges))
    assert res["counts"].tolist() == want.tolist()
    assert int(res["below"]) == int((flat < -6).sum()) and int(res["above"]) == int((flat > 4).sum())
    assert int(res["counts"].sum() + res["below"] + res["above"]) == flat.size
    merged = split_and_merge(make, bs, [2, 5], [2, 0, 1])
    assert_same(roundtrip(merged, make, tmp_path).result(), res)


def test_histogram_over_a_range_and_its_edge_cases():
    r = Histogram(POINT, bins=4, range=(0.0, 1.0))
    x = torch.tensor([0.0, 0.25, 0.5, 0.999, 1.0, 1.5, -0.1, float("nan")]).reshape(1, 8, 1)
    r.update(HarvestBatch(torch.tensor([0]), torch.zeros(1, 8, dtype=torch.int64), {POINT: x}))
    res = r.result()
    want, _ = np.histogram(x[~torch.isnan(x)].numpy(), bins=4, range=(0.0, 1.0))
    assert res["counts"].tolist() == want.tolist() == [1, 1, 1, 2]   # 1.0 falls in the last, closed bin
    assert (int(res["below"]), int(res["above"]), int(res["nan"])) == (1, 1, 1)
    for bad in ({"bins": 4}, {"edges": [1.0, 0.0]}, {"edges": [0.0, 1.0], "bins": 3, "range": (0, 1)}):
        with pytest.raises(ValueError, match="Histogram: "):
            Histogram(POINT, **bad)


# ----------------------------------------------------------------------------- difference of means -> --edit
def llama_windows(tok, texts):
    return [torch.tensor(tok(t)["input_ids"]) for t in texts]


def test_difference_of_means_loads_through_the_edit_option_and_steers(tmp_path):
    from asyncinterp.serve import Server
    from asyncinterp.serve.openai.model_names import install_from_options

    lm = ai.models.tiny("llama")
    layer = 1
    point = f"blocks.{layer}.hook_resid_post"
    g = torch.Generator().manual_seed(6)
    sets = [torch.randint(3, 50, (6, 8), generator=g), torch.randint(50, 100, (6, 8), generator=g)]
    reds = []
    for ids in sets:                          # each "dataset": its windows' resid_post through the model
        async def read(m):
            return (await m.at(point)).clone()
        with torch.no_grad():
            acts = lm.trace(ids, read)
        r = MeanVar(point)
        r.update(HarvestBatch(torch.arange(6), ids, {point: acts}))
        reds.append((r, acts))
    sv = difference_of_means(reds[0][0], reds[1][0])
    want_vec = (reds[0][1].reshape(-1, reds[0][1].shape[-1]).double().mean(0)
                - reds[1][1].reshape(-1, reds[1][1].shape[-1]).double().mean(0)).float()
    assert sv.point == point and torch.equal(sv.vector, want_vec)
    path = sv.save(str(tmp_path / "steer.json"), lm, strength=3.0)
    assert torch.equal(SteeringVector.load(path).vector, sv.vector)

    server = Server(lm, name="tiny")
    install_from_options(server, [f"toward=steer:@{path}"])
    edit = server.names.resolve("tiny:toward").edits[0]
    prompt = torch.tensor([[5, 9, 17, 33, 2]])
    # the installed edit, run as the server runs it (a whole-run intervention) ...
    with torch.no_grad():
        got = lm.trace(prompt, edit.fn)
    # ... equals a hand-written hook adding 3 * vector to layer 1's output, then the top tokens
    hf = lm.module
    handle = hf.model.layers[layer].register_forward_hook(
        lambda mod, a, out: (out[0] + 3.0 * want_vec,) + tuple(out[1:]) if isinstance(out, tuple)
        else out + 3.0 * want_vec)
    with torch.no_grad():
        logits = hf(prompt).logits[:, -1].float()
    handle.remove()
    p, ids = logits.softmax(-1).topk(10, dim=-1)
    assert torch.equal(got["ids"], ids)
    torch.testing.assert_close(got["probs"], p)
    with torch.no_grad():
        plain = hf(prompt).logits[:, -1]
    assert not torch.equal(plain.softmax(-1).topk(10).indices, ids)   # the vector does steer
    # and in process: model.edit(sv.edit(3.0)) gives the same next-token logits
    with torch.no_grad():
        in_proc = lm.edit(sv.edit(3.0)).trace(prompt, _last_logits)
    torch.testing.assert_close(in_proc, logits)


async def _last_logits(m):
    return (await m.lm_head.output)[:, -1].float().clone()


def test_a_steering_point_that_is_no_modules_output_is_refused(tmp_path):
    lm = ai.models.tiny("llama")
    sv = SteeringVector("blocks.1.hook_resid_pre", torch.ones(lm.config.hidden_size))
    with pytest.raises(ValueError, match="not a module's output"):
        sv.save(str(tmp_path / "x.json"), lm)


def test_the_reductions_page_runs():
    """docs/harvest-reductions.md, its blocks up to the Ray section (tests/test_harvest_ray.py runs them all)."""
    from docsnippets import python_blocks
    ns = {"__name__": "__docs__"}
    blocks = [b for b in python_blocks("harvest-reductions.md") if "ray=" not in b]
    assert len(blocks) >= 5
    for i, block in enumerate(blocks):
        exec(compile(block, f"harvest-reductions.md[block {i}]", "exec"), ns)  # noqa: S102 - our own docs
    assert ns["features"]["window_ids"].shape == (128, 3)
    assert ns["vector"].vector.shape == (64,)
