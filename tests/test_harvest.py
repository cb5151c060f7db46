"""ai.harvest on transformers: values equal hand-written hooks, windows equal SAELens's, the output is what
datasets and SAELens read, inputs of every kind, resume and manifest checks, the reductions contract."""

import json
import os

import datasets
import numpy as np
import pytest
import torch

import asyncinterp as ai
from asyncinterp.harvesting.store import ManifestMismatch
from harvest_helpers import corpus, hook_values, sha256_tree, write_jsonl

CTX = 24


@pytest.fixture(scope="module")
def lm():
    from asyncinterp.models.hf.bundled import tiny_llama
    model, tok = tiny_llama(seed=0, num_hidden_layers=3)
    return ai.LanguageModel(model.eval(), tok)


@pytest.fixture(scope="module")
def docs():
    return corpus(60)


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory, docs):
    return write_jsonl(tmp_path_factory.mktemp("data") / "docs.jsonl", docs)


def _harvest(lm, data, points, out, **kw):
    kw.setdefault("context_size", CTX)
    kw.setdefault("batch_size", 4)
    kw.setdefault("shard_windows", 8)
    kw.setdefault("progress", False)
    return ai.harvest(lm, data, points, out, **kw)


def test_values_equal_hand_written_hooks_bit_for_bit(lm, jsonl, tmp_path):
    out = tmp_path / "h"
    points = ["blocks.1.hook_resid_post", "layers.2.mlp.post", "blocks.0.attn.hook_z"]
    res = _harvest(lm, jsonl, points, out)
    ds = datasets.load_from_disk(str(out))
    assert ds.column_names == ["blocks.1.hook_resid_post", "blocks.2.mlp.hook_post", "blocks.0.attn.hook_z",
                               "token_ids"]
    assert len(ds) == res.windows > 2 * 8               # several shards, the last one partial or full
    hf = lm.module.model
    hooks = {"blocks.1.hook_resid_post": (hf.layers[1], "output"),
             "blocks.2.mlp.hook_post": (hf.layers[2].mlp.down_proj, "input"),      # act(gate) * up
             "blocks.0.attn.hook_z": (hf.layers[0].self_attn.o_proj, "input")}    # heads before o_proj
    for start in range(0, len(ds), 4):
        rows = ds[start:start + 4]
        ref = hook_values(lm.module, torch.tensor(rows["token_ids"], dtype=torch.long), hooks)
        for name, want in ref.items():
            assert torch.equal(torch.tensor(np.array(rows[name])), want), (start, name)


def test_windows_follow_saelens_packing(lm, docs, jsonl, tmp_path):
    from sae_lens.tokenization_and_batching import concat_and_batch_sequences
    tok = lm.tokenizer
    for packing, concat_off in (("concat", False), ("truncate", True)):
        out = tmp_path / packing
        _harvest(lm, jsonl, ["blocks.0.hook_resid_post"], out, packing=packing)
        got = np.array(datasets.load_from_disk(str(out))["token_ids"])
        want = list(concat_and_batch_sequences(
            (torch.tensor(tok(d, add_special_tokens=False)["input_ids"]) for d in docs), CTX,
            begin_batch_token_id=tok.bos_token_id, sequence_separator_token_id=tok.bos_token_id,
            disable_concat_sequences=concat_off))
        assert got.shape == (len(want), CTX)
        assert np.array_equal(got, torch.stack(want).numpy()), packing


def test_positions_and_storage_dtypes(lm, jsonl, tmp_path):
    full = _harvest(lm, jsonl, ["blocks.1.hook_resid_post"], tmp_path / "full", max_windows=8)
    whole = ai.harvest.open(full.path)
    last = ai.harvest.open(_harvest(lm, jsonl, ["blocks.1.hook_resid_post"], tmp_path / "last", positions="last",
                                    max_windows=8).path)
    part = ai.harvest.open(_harvest(lm, jsonl, ["blocks.1.hook_resid_post"], tmp_path / "part", positions="1:5",
                                    max_windows=8).path)
    for i in range(8):
        w = whole[i]["blocks.1.hook_resid_post"]
        assert torch.equal(last[i]["blocks.1.hook_resid_post"], w[-1:])
        assert torch.equal(part[i]["blocks.1.hook_resid_post"], w[1:5])
        assert torch.equal(part[i]["token_ids"], whole[i]["token_ids"][1:5])
    for dtype, torch_dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        h = ai.harvest.open(_harvest(lm, jsonl, ["blocks.1.hook_resid_post"], tmp_path / dtype, dtype=dtype,
                                     max_windows=8).path)
        assert h.manifest["dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[dtype]
        for i in range(8):
            v = h[i]["blocks.1.hook_resid_post"]
            assert v.dtype == torch_dtype
            assert torch.equal(v, whole[i]["blocks.1.hook_resid_post"].to(torch_dtype))


def test_every_input_kind_gives_the_same_windows(lm, docs, jsonl, tmp_path):
    ref = _harvest(lm, jsonl, ["blocks.0.hook_resid_post"], tmp_path / "jsonl", max_windows=12)
    want = np.array(datasets.load_from_disk(ref.path)["token_ids"])
    table = datasets.Dataset.from_dict({"text": docs})
    table.to_parquet(str(tmp_path / "docs.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    arrow = [f for f in os.listdir(tmp_path / "saved") if f.endswith(".arrow")]
    sources = {"dataset": table, "iterable": table.to_iterable_dataset(), "parquet": str(tmp_path / "docs.parquet"),
               "saved": str(tmp_path / "saved"), "arrow": str(tmp_path / "saved" / arrow[0]),
               "dict": datasets.DatasetDict({"train": table})}
    for name, source in sources.items():
        out = _harvest(lm, source, ["blocks.0.hook_resid_post"], tmp_path / f"from-{name}", max_windows=12)
        assert np.array_equal(np.array(datasets.load_from_disk(out.path)["token_ids"]), want), name
    # pre-tokenised rows are windows already
    tokens = datasets.Dataset.from_dict({"input_ids": [list(r) for r in want]})
    out = _harvest(lm, tokens, ["blocks.0.hook_resid_post"], tmp_path / "tokens")
    assert np.array_equal(np.array(datasets.load_from_disk(out.path)["token_ids"]), want)
    short = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]]})
    with pytest.raises(ValueError, match="fewer than context_size"):
        _harvest(lm, short, ["blocks.0.hook_resid_post"], tmp_path / "short")


def test_saelens_reads_the_harvest(lm, jsonl, tmp_path):
    from sae_lens.training.activations_store import ActivationsStore
    out = _harvest(lm, jsonl, ["blocks.1.hook_resid_post"], tmp_path / "h")
    store = ActivationsStore(model=None, dataset=None, streaming=False, hook_name="blocks.1.hook_resid_post",
                             hook_head_index=None, context_size=CTX, d_in=64, n_batches_in_buffer=2,
                             total_training_tokens=10_000, store_batch_size_prompts=4, train_batch_size_tokens=32,
                             prepend_bos=True, normalize_activations="none", device=torch.device("cpu"),
                             dtype="float32", cached_activations_path=out.path)
    acts, toks = store.get_raw_llm_batch()
    mine = ai.harvest.open(out.path)
    want = torch.cat([mine[i]["blocks.1.hook_resid_post"] for i in range(4)])
    assert torch.equal(acts, want)
    assert torch.equal(toks.long(), torch.cat([mine[i]["token_ids"] for i in range(4)]))
    train = next(iter(store.get_data_loader()))            # SAELens's training batches come out of it too
    assert train.shape[-1] == 64


def test_resume_after_a_partial_run_is_byte_identical(lm, jsonl, tmp_path):
    ref = _harvest(lm, jsonl, ["blocks.1.hook_resid_post"], tmp_path / "ref")
    out = tmp_path / "cut"
    # an interrupted run: the first three shards complete, a temporary file of the fourth left behind
    _harvest(lm, jsonl, ["blocks.1.hook_resid_post"], out)
    for name in os.listdir(out):
        if name.startswith("data-") and int(name[5:10]) >= 3 or name in ("state.json", "dataset_info.json"):
            os.remove(out / name)
    (out / "data-00003.arrow.tmp-deadbeef").write_bytes(b"partial")
    again = _harvest(lm, jsonl, ["blocks.1.hook_resid_post"], out)
    assert again.resumed_shards == 3 and again.shards == ref.shards
    assert sha256_tree(out) == sha256_tree(tmp_path / "ref")


def test_another_manifest_on_the_directory_is_refused(lm, jsonl, tmp_path):
    out = tmp_path / "h"
    _harvest(lm, jsonl, ["blocks.1.hook_resid_post"], out, max_windows=8)
    before = sha256_tree(out)
    for change in ({"points": ["blocks.0.hook_resid_post"]}, {"context_size": 16}, {"dtype": "fp16"}):
        points = change.pop("points", ["blocks.1.hook_resid_post"])
        with pytest.raises(ManifestMismatch, match="manifests differ"):
            _harvest(lm, jsonl, points, out, max_windows=8, **change)
    assert sha256_tree(out) == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ManifestMismatch, match="not empty"):
        _harvest(lm, jsonl, ["blocks.1.hook_resid_post"], tmp_path / "other")
    manifest = json.loads((out / "harvest.json").read_text())
    assert manifest["points"] == [{"path": "blocks.1.hook_resid_post", "column": "blocks.1.hook_resid_post"}]
    assert manifest["model"]["weights_sha256"] and manifest["tokenizer"]["vocab_sha256"]
    assert manifest["dataset"]["kind"] == "sha256-of-files" and manifest["windows"]["context_size"] == CTX


def test_fsspec_urls(lm, jsonl, tmp_path):
    local = _harvest(lm, jsonl, ["blocks.1.hook_resid_post"], tmp_path / "local", max_windows=12)
    url = _harvest(lm, jsonl, ["blocks.1.hook_resid_post"], f"file://{tmp_path}/url", max_windows=12)
    assert sha256_tree(tmp_path / "url") == sha256_tree(local.path)
    mem = _harvest(lm, jsonl, ["blocks.1.hook_resid_post"], "memory://harvest-test/h", max_windows=12)
    import fsspec
    fs = fsspec.filesystem("memory")
    assert sorted(os.path.basename(p) for p in fs.ls("/harvest-test/h", detail=False)) == sorted(os.listdir(local.path))
    assert fs.cat("/harvest-test/h/data-00001.arrow") == (tmp_path / "local" / "data-00001.arrow").read_bytes()
    assert url.windows == mem.windows == 12


class _Sum:
    """A reduction for the contract test: per point, the sum of activations and the window ids seen."""

    def __init__(self):
        self.total, self.seen = {}, []

    def update(self, batch):
        assert batch.token_ids.dtype == torch.long and batch.window_ids.dtype == torch.long
        self.seen += batch.window_ids.tolist()
        for k, v in batch.acts.items():
            assert v.dtype == torch.float32 and v.dim() == 3
            self.total[k] = self.total.get(k, 0) + v.sum((0, 1))

    def state_dict(self):
        return {**{f"sum.{k}": v for k, v in self.total.items()}, "seen": torch.tensor(self.seen)}

    def load_state_dict(self, d):
        self.seen = d["seen"].tolist()
        self.total = {k[4:]: v for k, v in d.items() if k.startswith("sum.")}

    def merge(self, other):
        self.seen += other.seen
        for k, v in other.total.items():
            self.total[k] = self.total.get(k, 0) + v

    def result(self):
        return dict(self.total)


def test_reductions_see_every_batch_and_resume_from_their_saved_state(lm, jsonl, tmp_path):
    full = _Sum()
    res = _harvest(lm, jsonl, ["blocks.1.hook_resid_post"], tmp_path / "a", reductions=[full])
    assert full.seen == list(range(res.windows))
    acts = torch.stack([r["blocks.1.hook_resid_post"] for r in ai.harvest.open(res.path)])
    torch.testing.assert_close(res.reductions["reduction0"]["blocks.1.hook_resid_post"], acts.sum((0, 1)))
    assert os.path.exists(tmp_path / "a" / "reductions-00000.safetensors")
    # kill after shard 2: later shards and their states gone; the resumed reduction starts from shard 1's state
    out = tmp_path / "b"
    _harvest(lm, jsonl, ["blocks.1.hook_resid_post"], out, reductions=[_Sum()])
    for name in os.listdir(out):
        if name[:5] in ("data-", "reduc", "resul") and name[-20:].split(".")[0][-5:].isdigit() and \
                int(name.split(".")[0][-5:]) >= 2 or name.startswith("result-") or name in ("state.json",):
            os.remove(out / name)
    resumed = _Sum()
    again = _harvest(lm, jsonl, ["blocks.1.hook_resid_post"], out, reductions=[resumed])
    assert again.resumed_shards == 2
    assert resumed.seen == list(range(res.windows))
    assert sha256_tree(out) == sha256_tree(tmp_path / "a")
    only = _Sum()
    r = _harvest(lm, jsonl, ["blocks.1.hook_resid_post"], tmp_path / "c", reductions=[only], save_activations=False)
    assert not [n for n in os.listdir(tmp_path / "c") if n.endswith(".arrow")]
    torch.testing.assert_close(r.reductions["reduction0"]["blocks.1.hook_resid_post"], acts.sum((0, 1)))


def test_bad_arguments_say_what_to_do(lm, jsonl, tmp_path):
    with pytest.raises(ai.ModulePathError):
        _harvest(lm, jsonl, ["blocks.9.hook_resid_post"], tmp_path / "a")
    with pytest.raises(ValueError, match="positions"):
        _harvest(lm, jsonl, ["blocks.0.hook_resid_post"], tmp_path / "b", positions="middle")
    with pytest.raises(ValueError, match="storage dtype"):
        _harvest(lm, jsonl, ["blocks.0.hook_resid_post"], tmp_path / "c", dtype="int8")
    with pytest.raises(ValueError, match="multiple of batch_size"):
        _harvest(lm, jsonl, ["blocks.0.hook_resid_post"], tmp_path / "d", shard_windows=6)
    with pytest.raises(FileNotFoundError, match="not found"):
        _harvest(lm, str(tmp_path / "missing.jsonl"), ["blocks.0.hook_resid_post"], tmp_path / "e")
    with pytest.raises(ValueError, match="per-head|positions="):
        _harvest(lm, jsonl, ["blocks.0.attn.hook_pattern"], tmp_path / "f")


def test_command_line_harvest_and_its_errors(jsonl, tmp_path, capsys):
    from asyncinterp.cli import main
    from asyncinterp.models.hf.bundled import tiny_llama_dir
    model_dir = str(tiny_llama_dir(tmp_path / "model", seed=0))
    args = ["harvest", model_dir, "--dataset", jsonl, "--points", "blocks.1.hook_resid_post", "--out",
            str(tmp_path / "h"), "--context-size", "16", "--batch-size", "4", "--max-windows", "8", "--no-progress"]
    assert main(args) == 0
    assert "8 windows (128 tokens) in 1 shard(s)" in capsys.readouterr().out
    assert len(ai.harvest.open(tmp_path / "h")) == 8
    other = list(args)
    other[other.index("blocks.1.hook_resid_post")] = "blocks.0.hook_resid_post"
    assert main(other) == 1
    err = capsys.readouterr().err
    assert "holds another harvest" in err and "points" in err
