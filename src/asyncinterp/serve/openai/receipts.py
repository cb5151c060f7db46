"""Receipts: what computed an answer, as content hashes, on every answer of the server.

Why this module exists: a score obtained from a server is only worth what
one knows about how it was computed. Every answer (native and OpenAI
endpoints, the final chunk of a stream too) carries a receipt in its
``asyncinterp`` extension field::

    {"model": "smollm2:honest", "base": "smollm2", "engine": "vllm",
     "weights": "sha256:...", "edits": [{"name": "honest", "hash": "sha256:..."}], "adapter": null,
     "intervention": {"name": "steer", "hash": "sha256:..."} | null,
     "seed": 7 | null, "inputs": "sha256:...", "digest": "sha256:..."}

* ``weights``: a hash of the served weights (every parameter and buffer,
  name, dtype, shape and bytes), computed once when the server starts;
* ``edits``: the named edits the ``model`` name selected, each with the
  hash of its content (its source file, or the registered intervention's
  source and its fixed parameters);
* ``intervention``: the request's own intervention, hashed the same way
  (a registered one: its source and the request's parameters; submitted
  code: its source, entry and parameters);
* ``seed``: the request's sampling seed (``null``: greedy, or sampling
  without a seed, which no receipt can make repeatable);
* ``inputs``: a hash of what the request asked to compute on (prompt token
  ids, the generation options, the number of tokens);
* ``digest``: one hash over all of the above.

Equal receipts (equal digests) mean the same computation: the same weights,
engine, edits, intervention, options and prompt. Anything that changes the
computation changes the digest. Timing, request ids and the answer itself
are not part of it.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os

import torch

from .openai_compat import Shaper, to_json

__all__ = ["ReceiptShaper", "Receipts", "content_hash", "function_hash", "weights_hash"]

_PREFIX = "sha256:"


def _digest(data: bytes) -> str:
    return _PREFIX + hashlib.sha256(data).hexdigest()


def _canonical(value, depth: int = 0):
    """A JSON-able canonical form of a parameter value (tensors by dtype, shape and a hash of their bytes)."""
    if depth > 64:
        raise ValueError("a value nests deeper than 64 levels")
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        return {"tensor": str(t.dtype), "shape": list(t.shape), "bytes": _tensor_hash(t)}
    if isinstance(value, float) and not math.isfinite(value):
        return {"float": repr(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_canonical(v, depth + 1) for v in value]
    if isinstance(value, dict):
        return {str(k): _canonical(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    return {"repr": repr(value)}


def _tensor_hash(t: torch.Tensor) -> str:
    h = hashlib.sha256()
    _feed(h, t)
    return _PREFIX + h.hexdigest()


def _feed(h, t: torch.Tensor) -> None:
    t = t.detach()
    if _is_dtensor(t):      # sharded by a tensor-parallel plan: every rank hashes the whole tensor (a collective:
        t = t.full_tensor()  # every rank builds its server, and so its receipts, at the same point)
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.numel():
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.dtype != torch.bool
                 else t.to(torch.uint8).numpy().tobytes())


def _is_dtensor(t) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def content_hash(*parts) -> str:
    """One hash over ``parts`` (strings, numbers, tensors, lists and maps of them) in canonical JSON."""
    text = json.dumps([_canonical(p) for p in parts], sort_keys=True, separators=(",", ":"), allow_nan=False)
    return _digest(text.encode())


def function_hash(fn) -> str:
    """The content of a function: the source of the file that defines it (helpers included) and its name.

    Falls back to the function's own source, then to its bytecode, when the file cannot be read.
    """
    inner = inspect.unwrap(getattr(fn, "func", fn))      # functools.partial and decorated functions
    name = getattr(inner, "__qualname__", repr(inner))
    try:
        path = inspect.getsourcefile(inner)
        if path and os.path.isfile(path):
            with open(path, "rb") as f:
                return content_hash(name, _digest(f.read()))
    except (TypeError, OSError):
        pass
    try:
        return content_hash(name, inspect.getsource(inner))
    except (TypeError, OSError):
        code = getattr(inner, "__code__", None)
        return content_hash(name, code.co_code.hex() if code is not None else repr(inner))


def weights_hash(module) -> str:
    """A hash of a module's weights: every parameter and buffer (name, dtype, shape, bytes), in name order.

    ``"unknown"`` when some tensor has no data here (a skeleton, e.g. a tensor-parallel driver).
    """
    h = hashlib.sha256()
    try:
        state = module.state_dict(keep_vars=True)
    except Exception:  # noqa: BLE001 - a module whose state cannot be listed
        return "unknown"
    for name in sorted(state):
        t = state[name]
        if not isinstance(t, torch.Tensor):
            continue
        if t.device.type == "meta":
            return "unknown"
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        _feed(h, t)
    return _PREFIX + h.hexdigest()


class Receipts:
    """The receipts of one server: its weights hash (computed once) and how to hash an intervention spec.

    ``registered``: the server's name -> :class:`~.params.Registered` table (read when a receipt is made).
    """

    def __init__(self, module, engine: str, base: str, registered: dict):
        self.engine = engine
        self.base = base
        self.registered = registered
        self.weights = weights_hash(module)
        self._fn_hashes = {}

    def registered_hash(self, name: str) -> str:
        """The hash of a registered intervention's content (cached: the table does not change while serving)."""
        reg = self.registered.get(name)
        key = (name, id(reg))
        if key not in self._fn_hashes:
            self._fn_hashes[key] = function_hash(reg.fn) if reg is not None else content_hash("unknown", name)
        return self._fn_hashes[key]

    def intervention(self, spec) -> dict | None:
        """``{"name", "hash"}`` of a request's intervention spec (the server's native form), or ``None``."""
        if spec is None:
            return None
        if isinstance(spec, str):
            spec = {"name": spec}
        params = spec.get("params") or {}
        if "source" in spec:
            return {"name": f"submitted:{spec.get('entry') or '?'}",
                    "hash": content_hash("code", spec["source"], spec.get("entry"), params)}
        name = spec.get("name")
        return {"name": name, "hash": content_hash("registered", self.registered_hash(name), params)}

    def make(self, model: str, selection=None, intervention=None, seed=None, inputs=()) -> dict:
        """The receipt of one request: ``model`` as the client named it, the ``selection`` its name chose
        (:class:`~.model_names.Selection`: edits and adapter), the request's ``intervention`` spec, its
        ``seed`` and ``inputs`` (anything else that decides the computation: prompt ids, options)."""
        edits = [{"name": e.name, "hash": e.digest} for e in selection.edits] if selection is not None else []
        adapter = None
        if selection is not None and selection.adapter is not None:
            adapter = {"name": selection.adapter.name, "hash": selection.adapter.digest}
        out = {"model": model, "base": self.base, "engine": self.engine, "weights": self.weights, "edits": edits,
               "adapter": adapter, "intervention": self.intervention(intervention), "seed": seed,
               "inputs": content_hash(*inputs)}
        out["digest"] = content_hash(out)
        return out


def pick_result(result, n_edits: int, has_own: bool):
    """The request's own result out of an invoke that also ran ``n_edits`` edits (they come first)."""
    if not n_edits:
        return result
    if not has_own:
        return None
    return result[-1] if isinstance(result, tuple) else result


class ReceiptShaper(Shaper):
    """OpenAI answers with the receipt in the ``asyncinterp`` field (every answer, the stream's final chunk),
    and the request's own result apart from its edits' (``n_edits`` edit tasks ran first in its invoke)."""

    def __init__(self, *args, receipt: dict, n_edits: int = 0, **kwargs):
        super().__init__(*args, **kwargs)
        self.intervened = self.extension
        self.extension = True
        self.receipt = receipt
        self.n_edits = n_edits

    def ext(self, g):
        out = {}
        if self.intervened:
            result = pick_result(g.result, self.n_edits, True)
            out = {"result": to_json(result), "emitted": [{"step": e["step"], "value": to_json(e["value"])}
                                                          for e in g.emitted]}
        out["receipt"] = self.receipt
        return out

