"""The wire format: msgpack, with tensors as (dtype, shape, bytes). No pickle anywhere.

Values that cross the wire (request inputs and parameters, intervention
results, streamed per-step values, errors) are plain msgpack with two
extension types:

* ``ext 1`` — a tensor: a msgpack array ``[dtype, shape, data]`` where
  ``dtype`` is a name from :data:`DTYPES` (``"float32"``), ``shape`` a list of
  ints and ``data`` the raw little-endian bytes in C order;
* ``ext 2`` — a tuple (a msgpack array that decodes back to a tuple).

Everything else is native msgpack: ``None``, bools, ints (64 bit), floats,
strings, bytes, lists and maps. Decoding never executes anything: unknown
extension types, unknown dtypes, sizes that do not match the shape, too many
elements or too deep nesting are :class:`WireError` (an HTTP 400 on the
server).

Errors travel as maps ``{"type", "message", "traceback", "notes"}``; the
traceback holds only the intervention's own frames (the user's code), not
asyncinterp's or torch's, see :func:`encode_error`.
"""

from __future__ import annotations

import os
import re
import sys
import sysconfig
import traceback as _traceback
from dataclasses import dataclass

import msgpack
import torch

EXT_TENSOR = 1
EXT_TUPLE = 2

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "complex64": torch.complex64,
    "complex128": torch.complex128,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

MAX_DEPTH = 32


class WireError(ValueError):
    """A value cannot be encoded, or bytes are not a valid message."""


class DescriptionRefused(WireError):
    """A captured description is malformed, forged, or of a format this side does not read."""


@dataclass
class Limits:
    """Bounds applied while decoding untrusted bytes."""

    max_bytes: int = 16 * 2**20          # whole message
    max_tensor_elements: int = 2**24     # per tensor
    max_tensor_dims: int = 8
    max_container_items: int = 2**16     # per list / map
    max_str_len: int = 2**20
    max_depth: int = MAX_DEPTH


DEFAULT_LIMITS = Limits()


def answer_limits(nbytes: int) -> Limits:
    """Limits for decoding a server's answer of ``nbytes`` bytes: bounded by its size only.

    The server encodes answers without the request-side bounds (a 70,000-item
    list or a 2 MiB string is a valid result), so a client decoding them with
    :data:`DEFAULT_LIMITS` would refuse valid answers. Every item, character
    and tensor element takes at least one byte, so the size bounds them all.
    """
    n = max(int(nbytes), 1)
    return Limits(max_bytes=n, max_tensor_elements=n, max_tensor_dims=64, max_container_items=n, max_str_len=n,
                  max_depth=MAX_DEPTH + 2)


STREAM_ANSWER_LIMITS = answer_limits(1 << 30)


# --------------------------------------------------------------------------- tensors
def _tensor_data(t: torch.Tensor):
    """The bytes of ``t``'s elements, C order, on the CPU: a view of its memory where it allows one."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.numel() == 0:
        return b""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()) if _HAS_NUMPY else _ctypes_bytes(t)


def _ctypes_bytes(t):
    import ctypes
    return ctypes.string_at(t.data_ptr(), t.numel() * t.element_size())


try:  # numpy is optional; torch's .numpy() needs it
    import numpy  # noqa: F401
    _HAS_NUMPY = True
except ImportError:  # pragma: no cover
    _HAS_NUMPY = False


def bin_header(n: int) -> bytes:
    """msgpack's header of a bin of ``n`` bytes (the bytes follow it)."""
    if n < 1 << 8:
        return b"\xc4" + n.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def encode_tensor(t: torch.Tensor) -> msgpack.ExtType:
    # msgpack's [name, shape, data] with the element bytes copied once, from the tensor's memory
    return msgpack.ExtType(EXT_TENSOR, b"".join(_tensor_parts(t)))


def _tensor_parts(t: torch.Tensor):
    """``(head, data)``: the ext payload of :func:`encode_tensor` is their join; ``data`` the elements' bytes (a
    view of the tensor's memory where it allows one)."""
    if t.layout != torch.strided:
        t = t.to_dense()
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise WireError(f"tensors of dtype {t.dtype} cannot be sent; convert to one of {sorted(DTYPES)}")
    data = _tensor_data(t)
    size = data.nbytes if isinstance(data, memoryview) else len(data)
    return b"".join((b"\x93", msgpack.packb(name), msgpack.packb(list(t.shape)), bin_header(size))), data


def _split_tensor_payload(payload: bytes):
    """``[dtype, shape, data]`` of a tensor payload, ``data`` a view of ``payload`` (not a copy: the elements
    are copied once, into the tensor); ``None`` when the payload is not in the form :func:`encode_tensor`
    writes (the caller then decodes it the general way, which reports what is wrong)."""
    unpacker = msgpack.Unpacker(raw=False, use_list=True, strict_map_key=True)
    unpacker.feed(payload[:_HEAD_BYTES])   # dtype and shape: a few dozen bytes
    try:
        if unpacker.read_array_header() != 3:
            return None
        name, shape = unpacker.unpack(), unpacker.unpack()
    except Exception:  # noqa: BLE001 - not this form (or not whole in the head): the general way says why
        return None
    start = unpacker.tell()
    if start >= len(payload):
        return None
    kind = payload[start]
    width = {0xc4: 1, 0xc5: 2, 0xc6: 4}.get(kind)
    if width is None or start + 1 + width > len(payload):
        return None
    n = int.from_bytes(payload[start + 1:start + 1 + width], "big")
    begin = start + 1 + width
    if begin + n != len(payload):
        return None
    return [name, shape, memoryview(payload)[begin:]]


_HEAD_BYTES = 256   # more than a dtype name and a shape of MAX dims take


def decode_tensor(payload: bytes, limits: Limits = DEFAULT_LIMITS) -> torch.Tensor:
    obj = _split_tensor_payload(payload)
    if obj is None:
        try:
            obj = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
        except Exception as exc:
            raise WireError(f"malformed tensor payload ({type(exc).__name__})") from None
    if not (isinstance(obj, list) and len(obj) == 3):
        raise WireError("a tensor must be [dtype, shape, data]")
    name, shape, data = obj
    if not isinstance(name, str) or name not in DTYPES:
        raise WireError(f"unknown tensor dtype {name!r}; allowed: {sorted(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > limits.max_tensor_dims:
        raise WireError(f"a tensor shape must be a list of at most {limits.max_tensor_dims} ints")
    numel = 1
    for d in shape:
        if not isinstance(d, int) or isinstance(d, bool) or d < 0:
            raise WireError(f"tensor shape {shape!r} must hold non-negative ints")
        numel *= d
        if numel > limits.max_tensor_elements:
            raise WireError(f"tensor of shape {shape} has more than {limits.max_tensor_elements} elements")
    if not isinstance(data, (bytes, memoryview)):
        raise WireError("tensor data must be bytes")
    dtype = DTYPES[name]
    itemsize = dtype.itemsize
    if len(data) != numel * itemsize:
        raise WireError(f"tensor of dtype {name} and shape {shape} needs {numel * itemsize} bytes, got {len(data)}")
    if numel == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


# --------------------------------------------------------------------------- values
def _default(obj):
    if isinstance(obj, torch.Tensor):
        return encode_tensor(obj)
    if isinstance(obj, tuple):  # namedtuples and torch.Size
        return msgpack.ExtType(EXT_TUPLE, packb(list(obj)))
    if isinstance(obj, torch.dtype):
        return _DTYPE_NAMES.get(obj, str(obj))
    if isinstance(obj, (set, frozenset)):
        return list(obj)
    if hasattr(obj, "keys") and hasattr(obj, "__getitem__"):   # ModelOutput and other mappings
        return {k: obj[k] for k in obj.keys()}
    if _HAS_NUMPY:
        import numpy as np
        if isinstance(obj, np.ndarray):
            return encode_tensor(torch.from_numpy(obj))
        if isinstance(obj, np.generic):
            return obj.item()
    raise WireError(f"cannot send a value of type {type(obj).__name__}: results must be made of tensors, "
                    "numbers, strings, bytes, None, lists, tuples and dicts")


_PLAIN = frozenset({str, bytes, int, float, bool, type(None)})   # values msgpack takes as they are


def _prepare(obj, depth=0, encode=None):
    """Turn tuples into ext 2 before msgpack sees them (msgpack would make them lists). ``encode(tensor)``: the
    ext of a tensor outside tuples (:func:`encode_tensor` if not given; see :func:`packb_parts`)."""
    if depth > MAX_DEPTH:
        raise WireError(f"value nested deeper than {MAX_DEPTH} levels")
    kind = type(obj)
    if kind in _PLAIN:
        return obj
    if depth < MAX_DEPTH:   # the common containers, their plain items taken as they are (one call less per item)
        if kind is dict:
            return {(k if type(k) is str else _key(k)): (v if type(v) in _PLAIN else _prepare(v, depth + 1, encode))
                    for k, v in obj.items()}
        if kind is list:
            return [v if type(v) in _PLAIN else _prepare(v, depth + 1, encode) for v in obj]
    if isinstance(obj, (str, bytes, int, float, bool)):
        return obj
    if isinstance(obj, torch.Tensor):
        return (encode or encode_tensor)(obj)
    if isinstance(obj, tuple):   # (its items are packed into its ext's payload here: their tensors whole)
        return msgpack.ExtType(EXT_TUPLE, _pack([_prepare(v, depth + 1) for v in obj]))
    if isinstance(obj, list):
        return [_prepare(v, depth + 1, encode) for v in obj]
    if isinstance(obj, dict):
        return {_key(k): _prepare(v, depth + 1, encode) for k, v in obj.items()}
    return _prepare(_default(obj), depth + 1, encode)


def _key(k):
    if isinstance(k, (str, int)) and not isinstance(k, bool):
        return k
    raise WireError(f"dict keys must be str or int to be sent, got {type(k).__name__}")


def _pack(obj) -> bytes:
    try:
        return msgpack.packb(obj, use_bin_type=True, strict_types=False)
    except WireError:
        raise
    except (OverflowError, ValueError, TypeError) as exc:
        raise WireError(f"cannot encode value: {exc}") from None


def packb(obj) -> bytes:
    """Encode ``obj`` (tensors, tuples, nested containers) to msgpack bytes."""
    return _pack(_prepare(obj))


def packb_parts(obj) -> list:
    """:func:`packb` in parts that follow one another (their join is its bytes), each tensor's elements a view of
    its memory, not a copy: a worker writes a large answer out this way (``Channel.send_parts``), copied once,
    by the kernel. The tensors must not change until the parts are written."""
    tensors = []
    token = os.urandom(12)

    def placeholder(t):   # an ext of 16 bytes no client value holds (a random token), replaced below
        marker = token + len(tensors).to_bytes(4, "big")
        tensors.append((marker, *_tensor_parts(t)))
        return msgpack.ExtType(EXT_TENSOR, marker)

    packed = _pack(_prepare(obj, 0, placeholder))
    if not tensors:
        return [packed]
    view, parts, at = memoryview(packed), [], 0
    for marker, head, data in tensors:   # in the order msgpack wrote them (it keeps the order of maps and lists)
        where = packed.find(_FIXEXT16_TENSOR + marker, at)
        if where < 0:   # (cannot happen: each placeholder is written once) the plain way, copied
            return [packb(obj)]
        parts += [view[at:where], _ext_header(len(head) + len(data), EXT_TENSOR), head, data]
        at = where + len(_FIXEXT16_TENSOR) + len(marker)
    parts.append(view[at:])
    return parts


_FIXEXT16_TENSOR = b"\xd8" + EXT_TENSOR.to_bytes(1, "big")
_FIXEXT = {1: b"\xd4", 2: b"\xd5", 4: b"\xd6", 8: b"\xd7", 16: b"\xd8"}


def _ext_header(n: int, code: int) -> bytes:
    """msgpack's header of an ext of ``n`` bytes of type ``code``, as msgpack writes it."""
    if n in _FIXEXT:
        return _FIXEXT[n] + code.to_bytes(1, "big")
    if n < 1 << 8:
        return b"\xc7" + n.to_bytes(1, "big") + code.to_bytes(1, "big")
    if n < 1 << 16:
        return b"\xc8" + n.to_bytes(2, "big") + code.to_bytes(1, "big")
    return b"\xc9" + n.to_bytes(4, "big") + code.to_bytes(1, "big")


def packb_array(encoded) -> bytes:
    """A msgpack array of values already encoded (each the bytes of :func:`packb`), not encoded again."""
    return array_header(len(encoded)) + b"".join(encoded)


def array_header(n: int) -> bytes:
    """msgpack's header of an array of ``n`` items (the items' bytes follow it)."""
    return msgpack.Packer().pack_array_header(n)


def packb_with(obj: dict, key: str, encoded: bytes) -> bytes:
    """``packb({**obj, key: value})`` where ``encoded`` is ``packb(value)`` already: the value is not encoded
    again (a worker's answer passes through the server this way)."""
    if key in obj:
        raise ValueError(f"{key!r} is given twice")
    return msgpack.Packer().pack_map_header(len(obj) + 1) + packb(obj)[_map_header_size(len(obj)):] \
        + packb(key) + encoded


def _map_header_size(n: int) -> int:
    return 1 if n < 16 else 3 if n < 2 ** 16 else 5


def unpackb(data: bytes, limits: Limits = DEFAULT_LIMITS, _depth: int = 0):
    """Decode untrusted bytes; raises :class:`WireError` for anything malformed or too large."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireError("expected bytes")
    if len(data) > limits.max_bytes:
        raise WireError(f"message of {len(data)} bytes exceeds the limit of {limits.max_bytes}")
    if _depth > limits.max_depth:
        raise WireError(f"message nested deeper than {limits.max_depth} levels")

    def ext_hook(code, payload):
        if code == EXT_TENSOR:
            return decode_tensor(payload, limits)
        if code == EXT_TUPLE:
            return tuple(unpackb(payload, limits, _depth + 1))
        raise WireError(f"unknown msgpack extension type {code}")

    try:
        return msgpack.unpackb(
            data if isinstance(data, (bytes, bytearray)) else bytes(data),   # (a bytearray is read in place)
            raw=False, use_list=True, strict_map_key=False, ext_hook=ext_hook,
            max_str_len=limits.max_str_len,
            max_bin_len=limits.max_bytes, max_array_len=limits.max_container_items,
            max_map_len=limits.max_container_items, max_ext_len=limits.max_bytes)
    except WireError:
        raise
    except RecursionError:
        raise WireError("message nested too deeply") from None
    except Exception as exc:  # msgpack raises many types for malformed input
        raise WireError(f"malformed msgpack message ({type(exc).__name__}: {str(exc)[:200]})") from None


def check_depth(obj, limit: int = MAX_DEPTH, _depth: int = 0) -> None:
    """Raise :class:`WireError` if containers nest deeper than ``limit``."""
    if _depth > limit:
        raise WireError(f"message nested deeper than {limit} levels")
    if isinstance(obj, (list, tuple)):
        for v in obj:
            check_depth(v, limit, _depth + 1)
    elif isinstance(obj, dict):
        for v in obj.values():
            check_depth(v, limit, _depth + 1)


def stream_unpacker(limits: Limits = DEFAULT_LIMITS) -> msgpack.Unpacker:
    """An incremental decoder for a stream of concatenated messages (the generate endpoint)."""

    def ext_hook(code, payload):
        if code == EXT_TENSOR:
            return decode_tensor(payload, limits)
        if code == EXT_TUPLE:
            return tuple(unpackb(payload, limits, 1))
        raise WireError(f"unknown msgpack extension type {code}")

    return msgpack.Unpacker(raw=False, use_list=True, strict_map_key=False, ext_hook=ext_hook,
                            max_buffer_size=limits.max_bytes)


# --------------------------------------------------------------------------- errors
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_LIB_DIRS = tuple(sorted({p + os.sep for p in (sysconfig.get_paths().get("stdlib"),
                                                 sysconfig.get_paths().get("purelib"),
                                                 sysconfig.get_paths().get("platlib"),
                                                 os.path.dirname(torch.__file__)) if p}))


def _own_frame(filename: str) -> bool:
    if filename.startswith("<submitted"):
        return True
    if filename.startswith("<"):
        return False
    if filename.startswith(_PKG_DIR):
        return False
    return not filename.startswith(_LIB_DIRS)


def own_traceback(exc: BaseException) -> list:
    """Formatted lines of the frames of ``exc``'s traceback that belong to the intervention itself."""
    frames = [f for f in _traceback.extract_tb(exc.__traceback__) if _own_frame(f.filename)]
    return [line.rstrip("\n") for line in _traceback.format_list(frames)]


_ADDRESS = re.compile(r"\b0x[0-9a-fA-F]{6,}\b")


def scrub_addresses(text: str) -> str:
    """Memory addresses (``0x7f...`` in object reprs) hidden from text that leaves the server."""
    return _ADDRESS.sub("0x…", text)


#: the most characters of an error's message, of one traceback line or note, and the most lines and notes that
#: an error map carries: what a client sent is echoed as a short excerpt at most
MAX_ERROR_CHARS = 2000
MAX_ERROR_LINE = 500
MAX_ERROR_LINES = 100


def excerpt(text: str, n: int = MAX_ERROR_CHARS) -> str:
    """``text`` cut to ``n`` characters, saying how long it was."""
    text = str(text)
    return text if len(text) <= n else f"{text[:n]}… ({len(text)} characters in all)"


def bounded_error(error: dict) -> dict:
    """An error map with its message, traceback lines and notes cut to the limits above."""
    out = dict(error)
    out["message"] = excerpt(out.get("message", ""))
    for key in ("traceback", "notes"):
        lines = out.get(key)
        if isinstance(lines, list):
            out[key] = [excerpt(line, MAX_ERROR_LINE) for line in lines[-MAX_ERROR_LINES:]]
    return out


def encode_error(exc: BaseException, kind: str | None = None) -> dict:
    """A wire map for an exception: its type, message, notes and own traceback lines.

    An exception that carries a ``wire_error`` map (an error a worker process
    reported, see :mod:`.supervisor`) is sent as that map.
    """
    remote = getattr(exc, "wire_error", None)
    if isinstance(remote, dict):
        out = dict(remote)
        if kind is not None:
            out["kind"] = kind
        return out
    message = str(exc)
    if isinstance(exc, BaseExceptionGroup):
        message = f"{message}: " + "; ".join(f"{type(e).__name__}: {e}" for e in exc.exceptions)
    out = bounded_error({
        "type": type(exc).__name__,
        "message": scrub_addresses(message),
        "traceback": [scrub_addresses(line) for line in own_traceback(exc)],
        "notes": [scrub_addresses(str(n)) for n in getattr(exc, "__notes__", ()) or ()],
    })
    if kind is not None:
        out["kind"] = kind
    return out


class RemoteError(Exception):
    """An error raised on the server (by an intervention, or by the server refusing the request).

    ``type`` is the remote exception's class name, ``message`` its text,
    ``remote_traceback`` the intervention's own frames and ``status`` the
    HTTP status of the response.
    """

    def __init__(self, type: str, message: str, remote_traceback=(), notes=(), status: int | None = None,
                 kind: str | None = None):
        self.type = type
        self.message = message
        self.remote_traceback = list(remote_traceback)
        self.notes = list(notes)
        self.status = status
        self.kind = kind
        super().__init__(self._text())

    def _text(self) -> str:
        parts = [f"{self.type}: {self.message}"]
        if self.remote_traceback:
            parts.append("Remote traceback (most recent call last):\n" + "\n".join(self.remote_traceback))
        parts.extend(self.notes)
        return "\n".join(parts)

    @classmethod
    def from_wire(cls, obj, status: int | None = None) -> "RemoteError":
        if not isinstance(obj, dict):
            return cls("RemoteError", repr(obj)[:500], status=status)
        return cls(str(obj.get("type", "RemoteError")), str(obj.get("message", "")),
                   [str(x) for x in obj.get("traceback") or []], [str(x) for x in obj.get("notes") or []],
                   status=status, kind=obj.get("kind"))


try:  # Python 3.10
    BaseExceptionGroup
except NameError:  # pragma: no cover
    from exceptiongroup import BaseExceptionGroup  # type: ignore
