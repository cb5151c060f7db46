"""docs/devices.md runs as written, and its claims about dtypes and devices hold on CPU."""

import pytest
import torch

import asyncinterp as ai
from docsnippets import python_blocks, run_page


def test_devices_page_runs(capsys):
    assert len(python_blocks("devices.md")) >= 6
    ns = run_page("devices.md")
    out = capsys.readouterr().out
    assert "(torch.bfloat16, torch.bfloat16)" in out
    assert "has dtype torch.float16 but the value it replaces has torch.float32" in out
    assert ns["tr"].output.dtype == torch.float16
    assert ns["shapes"]["2.output"].device.type == "meta"


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def test_bfloat16_trace_values_and_edit():
    net = _net().to(torch.bfloat16)
    model = ai.wrap(net)
    x = torch.randn(3, 8, dtype=torch.bfloat16)

    async def read(m):
        return (await m[1].output).clone(), await m.output
    h, y = model.trace(x, read)
    assert h.dtype == y.dtype == torch.bfloat16

    async def zero(m):
        h = await m[1].output
        h[:] = 0
        return await m.output
    y0 = model.trace(x, zero)
    assert y0.dtype == torch.bfloat16
    assert torch.equal(y0, net[2].bias.expand(3, 2))      # all hidden units ablated: only the bias is left

    async def assign(m):
        h = await m[1].output
        m[1].output = torch.zeros_like(h)
        return await m.output
    assert torch.equal(model.trace(x, assign), y0)


def test_float16_replacement_into_float32_point():
    model = ai.wrap(_net())
    x = torch.randn(3, 8)

    async def inplace(m):
        h = await m[1].output
        h[:] = torch.ones(3, 8, dtype=torch.float16)
        return h.dtype, (await m.output).dtype
    assert model.trace(x, inplace) == (torch.float32, torch.float32)

    async def assign(m):
        h = await m[0].output
        m[0].output = h.half()    # a dtype mismatch is refused at this line
    with pytest.raises(ai.ReplacementError, match="dtype_change=True") as info:
        model.trace(x, assign)
    assert "float16" in str(info.value) and "float32" in str(info.value)

    seen = []

    async def on_purpose(m):
        h = await m[0].output
        m[0].output.replace(h.half(), dtype_change=True)
        seen.append((await m[1].output).dtype)   # the ReLU ran on the float16 value
    with pytest.raises(RuntimeError, match="same dtype"):   # then the float32 Linear after it fails
        model.trace(x, on_purpose)
    assert seen == [torch.float16]

    async def last(m):
        y = await m[2].output
        m[2].output.replace(y.half(), dtype_change=True)
    with model.trace() as tr:
        tr.invoke(x, last)
    assert tr.output.dtype == torch.float16

    async def other_device(m):
        h = await m[0].output
        m[0].output = h.to("meta")
    with pytest.raises(ai.ReplacementError, match="is on meta"):
        model.trace(x, other_device)


def test_wrong_shape_is_still_refused_whatever_the_dtype():
    model = ai.wrap(_net())

    async def bad(m):
        h = await m[1].output
        m[1].output = torch.zeros(3, 4, dtype=torch.float16)
    with pytest.raises(ai.ReplacementError):
        model.trace(torch.randn(3, 8), bad)


def test_scan_on_meta_device():
    with torch.device("meta"):
        empty = _net()
    model = ai.wrap(empty)
    xm = torch.empty(5, 8, device="meta")
    shapes = model.scan(xm)
    assert shapes["1.output"].shape == (5, 8)
    assert shapes["2.output"].shape == (5, 2)
    assert shapes["2.output"].device.type == "meta"
    assert shapes["2.output"].dtype == torch.float32
    with torch.device("meta"):
        half = _net().to(torch.bfloat16)
    assert ai.wrap(half).scan(torch.empty(2, 8, device="meta", dtype=torch.bfloat16))["0.output"].dtype \
        == torch.bfloat16
