"""The msgpack wire format: tensors as dtype/shape/bytes, nested values, errors; hostile bytes are WireErrors."""

import math

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncinterp.serve import wire
from asyncinterp.client.wire import RemoteError, WireError


@pytest.mark.parametrize("dtype", list(wire.DTYPES.values()))
def test_tensor_roundtrip_every_dtype(dtype):
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(3, 4, generator=g).to(dtype)
    elif dtype == torch.bool:
        t = torch.randint(0, 2, (3, 4), generator=g).bool()
    else:
        t = torch.randint(0, 100, (3, 4), generator=g).to(dtype)
    back = wire.unpackb(wire.packb(t))
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back, t)


def test_tensor_views_noncontiguous_empty_scalar():
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    for t in (base.t(), base[:, 1::2], base[1:3], torch.empty(0, 5), torch.tensor(3.5), base.conj()):
        back = wire.unpackb(wire.packb(t))
        assert torch.equal(back, t.contiguous()) and back.shape == t.shape
    back = wire.unpackb(wire.packb(base[1:2]))
    back[0, 0] = -1                         # decoded tensors own writable memory
    assert base[1, 0] == 6


def test_nested_values_and_tuples():
    value = {"a": [1, 2.5, None, True, "x", b"\x00\x01"], "b": (torch.ones(2), {"c": (1, (2, 3))}), 7: -2**63}
    back = wire.unpackb(wire.packb(value))
    assert back["a"] == value["a"]
    assert isinstance(back["b"], tuple) and torch.equal(back["b"][0], torch.ones(2))
    assert back["b"][1] == {"c": (1, (2, 3))}
    assert back[7] == -2**63
    assert wire.unpackb(wire.packb(torch.Size([2, 3]))) == (2, 3)
    assert wire.unpackb(wire.packb(torch.float16)) == "float16"


def test_unencodable_values_are_clear_errors():
    with pytest.raises(WireError, match="cannot send a value of type function"):
        wire.packb({"x": lambda: 1})
    with pytest.raises(WireError, match="dict keys"):
        wire.packb({(1, 2): 3})
    with pytest.raises(WireError):
        wire.packb(2**70)
    with pytest.raises(WireError, match="dtype"):
        wire.packb(torch.zeros(2, dtype=torch.float8_e4m3fn))
    deep = []
    for _ in range(100):
        deep = [deep]
    with pytest.raises(WireError, match="nested"):
        wire.packb(deep)


def _tensor_ext(dtype, shape, data):
    return msgpack.ExtType(wire.EXT_TENSOR, msgpack.packb([dtype, shape, data], use_bin_type=True))


@pytest.mark.parametrize("payload, match", [
    (_tensor_ext("float32", [2, 2], b"\x00" * 15), "needs 16 bytes"),
    (_tensor_ext("float32", [-1], b""), "non-negative"),
    (_tensor_ext("object", [1], b"\x00"), "unknown tensor dtype"),
    (_tensor_ext("float32", [1] * 9, b"\x00" * 4), "at most 8"),
    (_tensor_ext("float32", [2**20, 2**20], b""), "more than"),
    (_tensor_ext("float32", [True], b"\x00" * 4), "non-negative ints"),
    (msgpack.ExtType(wire.EXT_TENSOR, b"\xc1"), "malformed tensor"),
    (msgpack.ExtType(wire.EXT_TENSOR, msgpack.packb([1, 2])), "dtype, shape, data"),
    (msgpack.ExtType(99, b"abc"), "unknown msgpack extension"),
])
def test_hostile_tensors_and_extensions(payload, match):
    data = msgpack.packb({"x": payload}, use_bin_type=True)
    with pytest.raises(WireError, match=match):
        wire.unpackb(data)


def test_limits_and_garbage():
    with pytest.raises(WireError, match="exceeds the limit"):
        wire.unpackb(b"\x00" * 100, wire.Limits(max_bytes=10))
    for junk in (b"", b"\xc1", b"\x92\x01", b"\xdd\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff"):
        with pytest.raises(WireError):
            wire.unpackb(junk)
    with pytest.raises(WireError):
        wire.unpackb("not bytes")
    deep = b"\x91" * 5000 + b"\x00"
    with pytest.raises(WireError):
        wire.check_depth(wire.unpackb(deep))


def _boom():
    raise ValueError("bad value 42")


def test_error_encoding_keeps_only_own_frames():
    try:
        _boom()
    except ValueError as exc:
        exc.add_note("a note")
        err = wire.encode_error(exc, "intervention")
    assert err["type"] == "ValueError" and err["message"] == "bad value 42" and err["kind"] == "intervention"
    assert err["notes"] == ["a note"]
    text = "\n".join(err["traceback"])
    assert "test_wire.py" in text and "_boom" in text and 'raise ValueError("bad value 42")' in text
    remote = RemoteError.from_wire(wire.unpackb(wire.packb(err)), status=422)
    assert remote.type == "ValueError" and remote.status == 422 and "bad value 42" in str(remote)
    assert "Remote traceback" in str(remote)
    assert RemoteError.from_wire("garbage").type == "RemoteError"


def test_error_group_message_lists_members():
    exc = ExceptionGroup("2 failed", [ValueError("a"), KeyError("b")])
    err = wire.encode_error(exc)
    assert "ValueError: a" in err["message"] and "KeyError" in err["message"]


def test_stream_unpacker_concatenated_messages():
    u = wire.stream_unpacker()
    data = b"".join(wire.packb({"event": "token", "step": i, "value": torch.full((2,), float(i))}) for i in range(5))
    got = []
    for i in range(0, len(data), 7):  # arbitrary chunking
        u.feed(data[i:i + 7])
        got.extend(u)
    assert [g["step"] for g in got] == list(range(5))
    assert torch.equal(got[3]["value"], torch.full((2,), 3.0))


# --------------------------------------------------------------------------- property tests
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1),
                    st.floats(allow_nan=False), st.text(max_size=20), st.binary(max_size=20))
tensors = st.builds(
    lambda shape, dtype, seed: (torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 10).to(dtype),
    st.lists(st.integers(0, 4), max_size=3), st.sampled_from([torch.float32, torch.float64, torch.int64,
                                                              torch.int8, torch.bool, torch.bfloat16]),
    st.integers(0, 1000))
values = st.recursive(scalars | tensors, lambda children: st.one_of(
    st.lists(children, max_size=4), st.tuples(children, children),
    st.dictionaries(st.text(max_size=8), children, max_size=4)), max_leaves=12)


def _same(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b and type(a) is type(b)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values)
def test_roundtrip_property(value):
    assert _same(wire.unpackb(wire.packb(value)), value)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_random_bytes_decode_or_wireerror(data):
    try:
        wire.unpackb(data)
    except WireError:
        pass


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=8), st.lists(st.integers(-3, 2**31), max_size=5), st.binary(max_size=64))
def test_random_tensor_headers_decode_or_wireerror(dtype, shape, data):
    payload = msgpack.packb({"t": _tensor_ext(dtype, shape, data)}, use_bin_type=True)
    try:
        out = wire.unpackb(payload)
    except WireError:
        return
    t = out["t"]
    assert list(t.shape) == shape and t.dtype == wire.DTYPES[dtype]


def test_deeply_nested_tuple_extensions_are_refused_not_a_crash():
    # each tuple is an extension whose payload is decoded recursively: depth must be bounded across them
    x = msgpack.packb(0)
    for _ in range(3000):
        x = msgpack.packb(msgpack.ExtType(wire.EXT_TUPLE, msgpack.packb([msgpack.ExtType(wire.EXT_TUPLE, x)])))
    with pytest.raises(WireError, match="nested deeper"):
        wire.unpackb(x)
    y = msgpack.packb(0)
    for _ in range(3000):
        y = msgpack.packb([msgpack.ExtType(wire.EXT_TUPLE, msgpack.packb([[[msgpack.ExtType(wire.EXT_TUPLE, y)]]]))])
    with pytest.raises(WireError, match="nested deeper"):
        wire.unpackb(y)
    with pytest.raises(WireError):
        wire.unpackb(b"\x91" * 1_000_000 + b"\x00")


@pytest.mark.parametrize("n_head", [1, 2, 15, 16, 40])
def test_values_encoded_once_decode_as_if_encoded_with_their_map(n_head):
    """A worker's results travel as the bytes it encoded (packb_array), spliced into the server's answer
    (packb_with): the client decodes exactly what one packb of the whole answer gives."""
    entries = [{"ok": True, "value": torch.randn(3, 5)}, {"ok": False, "error": {"type": "E", "message": "m"}},
               {"ok": True, "value": (1, [2.5, None], "x")}]
    head = {f"k{i}": i for i in range(n_head - 1)}
    head["ok"] = True
    spliced = wire.unpackb(wire.packb_with(head, "results", wire.packb_array([wire.packb(e) for e in entries])))
    whole = wire.unpackb(wire.packb({**head, "results": entries}))
    assert spliced.keys() == whole.keys()
    for a, b in zip(spliced["results"], whole["results"]):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
    with pytest.raises(ValueError, match="twice"):
        wire.packb_with({"results": 1}, "results", b"\x90")


@pytest.mark.parametrize("wrap", [lambda x: [x], lambda x: {"k": x}, lambda x: (x,)])
def test_packb_depth_limit_is_exact_for_every_container(wrap):
    def nested(levels, leaf):
        for _ in range(levels):
            leaf = wrap(leaf)
        return leaf
    for leaf in (0, "s", None, 1.5):
        assert wire.unpackb(wire.packb(nested(wire.MAX_DEPTH, leaf)), wire.Limits(max_depth=64)) == \
            nested(wire.MAX_DEPTH, leaf)
        with pytest.raises(WireError, match="nested deeper"):
            wire.packb(nested(wire.MAX_DEPTH + 1, leaf))


def test_packb_refuses_dict_keys_that_are_not_str_or_int_at_any_depth():
    for key in (True, 1.5, None, b"k", (1, 2)):
        for value in ({key: 1}, [{key: 1}], {"a": {"b": {key: [1]}}}):
            with pytest.raises(WireError, match="dict keys must be str or int"):
                wire.packb(value)
    assert wire.unpackb(wire.packb({3: "x", "y": [1, {4: None}]})) == {3: "x", "y": [1, {4: None}]}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values)
def test_packb_parts_join_to_packb_exactly(value):
    """A worker writes its answer in parts (packb_parts): joined, they are byte for byte what packb writes."""
    from asyncinterp.client import wire as client_wire
    assert b"".join(client_wire.packb_parts(value)) == client_wire.packb(value)


def test_packb_parts_hand_out_a_tensors_memory_without_copying_it():
    from asyncinterp.client import wire as client_wire
    big = torch.randn(1, 50257)
    # scalar and small payloads that make msgpack pick a fixext (16 bytes), ext8 and ext16 header; a view
    for t in (big, torch.tensor(1.5), torch.ones(3, dtype=torch.int8), torch.arange(100.0), big[:, ::2],
              torch.empty(0, 3)):
        value = {"ok": True, "value": t, "more": [t, {"x": t}], "in a tuple": (t, 1)}
        parts = client_wire.packb_parts(value)
        assert b"".join(parts) == client_wire.packb(value)
        assert _same(wire.unpackb(b"".join(parts)), value)
    views = [p for p in client_wire.packb_parts({"value": big}) if isinstance(p, memoryview) and len(p) == 4 * 50257]
    assert len(views) == 1
    assert torch.frombuffer(views[0], dtype=torch.float32).data_ptr() == big.data_ptr()   # its memory, not a copy
    with pytest.raises(WireError, match="cannot be sent"):
        client_wire.packb_parts({"value": torch.ones(2, dtype=torch.float8_e4m3fn)})
