"""Misuse that used to give silent wrong numbers is loud now (issue: "No silent wrong numbers").

One test per item; each failed (silently) before the change.
"""

import functools

import pytest
import torch

import asyncinterp as ai


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh()) for _ in range(4)])


X = torch.randn(3, 8)


def test_skip_at_the_modules_own_input_is_applied():
    net = _net()
    model = ai.wrap(net)

    async def skip_at_input(m):
        await m[1].input
        m[1].skip(torch.zeros(3, 8))
        return await m.output

    expected = net[3](net[2](torch.zeros(3, 8)))
    assert torch.allclose(model.trace(X, skip_at_input), expected)


def test_skip_of_a_module_that_already_ran_raises():
    model = ai.wrap(_net())

    async def late(m):
        await m[2].output
        m[1].skip(torch.zeros(3, 8))

    with pytest.raises(ai.OutOfOrderError, match=r"1\.skip.*already ran"):
        model.trace(X, late)

    async def late_unhooked(m):        # layer 0 was never hooked: the recorded call order tells
        await m[3].output
        m[0].skip(torch.zeros(3, 8))

    with pytest.raises(ai.OutOfOrderError):
        model.trace(X, late_unhooked)


def test_loop_variable_rebound_before_the_run_raises_and_bound_ones_work():
    net = _net()
    model = ai.wrap(net)
    with pytest.raises(ai.LateBindingError, match="'i'"):
        with model.trace() as tr:
            for i in range(3):
                async def read(m):
                    return (await m[i].output).clone()
                tr.invoke(X, read)

    shared = []                      # a shared list mutated inside is not a rebinding
    invokes = []
    with model.trace() as tr:
        for i in range(3):
            async def read_bound(m, i):
                shared.append(i)
                return (await m[i].output).clone()
            invokes.append(tr.invoke(X[i:i + 1], functools.partial(read_bound, i=i)))
    h = X
    for i, inv in enumerate(invokes):
        h_i = X[i:i + 1]
        for layer in net[:i + 1]:
            h_i = layer(h_i)
        # a row of a batch of 3 against the row alone: float32 tolerances (BLAS may pick other kernels)
        torch.testing.assert_close(inv.result, h_i)
    assert sorted(shared) == [0, 1, 2]


def test_trace_keywords_reach_forward_or_are_refused():
    class Scaled(torch.nn.Module):
        def forward(self, x, scale=1.0):
            return x * scale

    model = ai.wrap(Scaled())
    assert torch.equal(model.trace(torch.ones(2), scale=3.0), torch.full((2,), 3.0))

    async def read(m):
        return await m.output
    assert torch.equal(model.trace(torch.ones(2), read, scale=2.0), torch.full((2,), 2.0))
    with pytest.raises(TypeError, match="bogus"):
        model.trace(torch.ones(2), bogus=1)
    with pytest.raises(TypeError, match="positionally"):
        model.trace(torch.ones(2), intervention=read)


def test_missing_await_on_a_returned_point_raises():
    model = ai.wrap(_net())

    async def forgot(m):
        return m[3].output

    with pytest.raises(TypeError, match="await"):
        model.trace(X, forgot)

    async def forgot_coroutine(m):
        async def helper():
            return 1
        return helper()

    with pytest.raises(TypeError, match="await"):
        model.trace(X, forgot_coroutine)


def test_row_zero_replacement_says_what_happened():
    model = ai.wrap(_net())

    async def row0(m):
        h = await m[1].output
        m[1].output = h[0]

    with pytest.raises(ai.ReplacementError, match=r"\[0\]"):
        model.trace(X, row0)


def test_shape_change_is_an_explicit_opt_in():
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Flatten(0))
    model = ai.wrap(net)

    async def reshape(m):
        h = await m[0].output
        m[0].output.replace(h[:, :4], shape_change=True)
        return await m.output

    assert model.trace(X, reshape).shape == (12,)

    async def partial(m):
        h = await m[0].output
        m[0].output.replace(h[:, :4], shape_change=True)

    with pytest.raises(ExceptionGroup) as info:
        with model.trace() as tr:
            tr.invoke(X[:1], partial)
            tr.invoke(X[1:], partial)
    assert all(isinstance(e, ai.ReplacementError) and "whole batch" in str(e) for e in info.value.exceptions)


def test_editing_a_held_value_after_the_model_moved_on_warns():
    net = _net()
    model = ai.wrap(net)
    x = X[:1]
    later = ai.Future()

    async def holds(m):
        h = await m[0].output
        v = await later                    # set at layer 3: layer 0's value is long used
        h[:] = v                           # lost

    async def sets_late(m):
        h = await m[3].output
        later.set_result(torch.zeros_like(h))

    with pytest.warns(ai.StaleEditWarning, match=r"0\.output"):
        with model.trace() as tr:
            tr.invoke(x, holds)
            tr.invoke(x, sets_late)

    # the same pattern at one point is fine: the future is set while the model waits at that point
    same = ai.Future()

    async def patch(m):
        h = await m[1].output
        h[:] = await same
        return await m.output

    async def record(m):
        same.set_result(torch.zeros(1, 8))
        await m[1].output

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", ai.StaleEditWarning)
        with model.trace() as tr:
            p = tr.invoke(x, patch)
            tr.invoke(x, record)
        # the model's own in-place ops on a value a task holds are not the task's edits
        inplace = ai.wrap(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(inplace=True),
                                              torch.nn.Linear(8, 2)))

        async def reads(m):
            h = await m[0].output
            return (await m[2].output).sum() + h.sum()
        inplace.trace(x, reads)
    assert torch.allclose(p.result, net[3](net[2](torch.zeros(1, 8))))


def test_late_binding_check_reads_names_inside_comprehensions():
    model = ai.wrap(_net())
    scale = 2.0

    async def uses_comprehension(m):
        h = await m[0].output
        return [v * scale for v in h.sum(-1).tolist()]

    with model.trace() as tr:
        a = tr.invoke(X[:1], uses_comprehension)
    assert len(a.result) == 1
    with pytest.raises(ai.LateBindingError, match="'scale'"):
        with model.trace() as tr:
            tr.invoke(X[:1], uses_comprehension)
            scale = 3.0   # noqa: F841 - rebound before the run


def test_a_point_of_a_replaced_submodule_says_so():
    """Envoys mirror the module tree as first read: a module replaced afterwards never fires, and the error says why."""
    from conftest import MLP
    net = MLP().eval()
    model = ai.wrap(net)
    assert model.layers[2].path == "layers.2"
    net.layers[2] = torch.nn.Sequential(torch.nn.Linear(16, 16))

    async def read(m):
        return await m.layers[2].output

    with pytest.raises(ai.MissedHookPoint, match="layers.2 is no longer a submodule.*wrap the model again"):
        model.trace(torch.randn(2, 8), read)
    fresh = ai.wrap(net)
    assert fresh.trace(torch.randn(2, 8), read).shape == (2, 16)


def test_points_of_the_live_tree_and_of_attached_modules_carry_no_stale_hint():
    from conftest import MLP
    model = ai.wrap(MLP().eval())
    model.attach("probe", torch.nn.Linear(16, 4))
    assert model.layers[2].output.hint == "" and model.layers[2][0].output.hint == ""
    assert model.probe.output.hint == "" and model.output.hint == ""
