"""What submitted code is handed by ``await`` is its own copy: a snapshot that nothing the model does later changes,
and whose edits reach the model only through the checked write-back while the point fires.

The copies are made copy-on-write (they share memory with the model's tensor until either side writes), so these
tests make each side write: the model in place after the point (``ReLU(inplace=True)``, a residual it reads
again), the code after the model moved past, and the storage under the copy directly.
"""

import torch
from torch import nn

import asyncinterp as ai
from asyncinterp.serve.jobs.job_wire import dumps_job, loads_job
from asyncinterp.serve.sandbox.rebuild_sandbox import Sandboxed
from asyncinterp.serve.sandbox.tensors import private_copy, version_of


class Net(nn.Module):
    """``l0``'s output is rewritten in place (``ReLU(inplace=True)``) right after its hook point; with
    ``residual``, the ReLU rewrites a copy and ``l0``'s output is read again at the end (``z + y``)."""

    def __init__(self, residual: bool = False):
        super().__init__()
        self.residual = residual
        self.l0 = nn.Linear(8, 8)
        self.act = nn.ReLU(inplace=True)
        self.l1 = nn.Linear(8, 8)

    def forward(self, x):
        y = self.l0(x)
        z = self.l1(self.act(y.clone() if self.residual else y))
        return z + y if self.residual else z


def _sandboxed(model, fn, x):
    """Run ``fn`` on ``x`` as a server runs submitted code (its source rebuilt in the sandbox): its result and
    the model's output."""
    tr = model.trace()
    tr.invoke(x, fn)
    job = loads_job(dumps_job(tr.job), compile_source=Sandboxed())
    with torch.no_grad():
        execution = model.engine("trace").start(job)
        execution.wait()
    return job.results[0].result, execution.output


async def snapshot_then_inplace_relu(m):
    h = await m.l0.output                 # the model's ReLU(inplace=True) rewrites this tensor right after
    await m.l1.output
    return h.clone()


def test_an_awaited_value_stays_what_it_was_when_the_model_writes_it_in_place_later():
    torch.manual_seed(0)
    net = Net()
    model = ai.wrap(net)
    x = torch.randn(4, 8)
    with torch.no_grad():
        before, want = net.l0(x), net(x)
    assert (before < 0).any()             # the ReLU changes something
    got, output = _sandboxed(model, snapshot_then_inplace_relu, x)
    assert torch.equal(got, before)
    assert torch.equal(output, want)      # and the model's own in-place write still took effect


async def edit_after_the_point(m):
    h = await m.l0.output
    await m.l1.output                      # the model moved past l0 (it still holds l0's output for z + y)
    h[:] = 100.0                           # too late: changes nothing in the model
    return h.clone()


def test_an_edit_of_the_copy_after_its_point_never_reaches_the_model():
    torch.manual_seed(1)
    net = Net(residual=True)
    model = ai.wrap(net)
    x = torch.randn(3, 8)
    with torch.no_grad():
        want = net(x)
    got, output = _sandboxed(model, edit_after_the_point, x)
    assert torch.equal(got, torch.full((3, 8), 100.0))    # the code's own copy took the edit
    assert torch.equal(output, want)                       # the residual the model read again did not


def test_a_private_copy_and_its_source_do_not_see_each_others_writes():
    base = torch.randn(4, 6)
    rows = base[1:3]                       # a request's rows: a view into the whole batch
    copied, private = private_copy(rows)
    assert torch.equal(copied, rows) and copied.shape == (2, 6)
    v = version_of(private)
    with torch._C.DisableTorchFunctionSubclass():
        private[0, 0] = 123.0
    assert version_of(private) != v        # the edit is seen (how the write-back finds it)
    assert base[1, 0] != 123.0             # and never reaches the batch
    base.fill_(7.0)                        # the model (or another request's write-back) writes the batch
    assert copied[0, 0] == 123.0 and (copied.flatten()[1:] != 7.0).all()


def test_a_copy_of_an_inference_tensor_is_an_ordinary_tensor_whose_edits_are_seen():
    for copied_in_inference_mode in (False, True):      # (vLLM's hooks fire under inference mode)
        with torch.inference_mode():
            t = torch.randn(2, 3)
            if copied_in_inference_mode:
                copied, private = private_copy(t)
        if not copied_in_inference_mode:
            copied, private = private_copy(t)
        assert not copied.is_inference()
        v = version_of(private)
        with torch._C.DisableTorchFunctionSubclass():
            private.zero_()
        assert version_of(private) != v
        assert (t != 0).all()


def test_a_copy_of_a_few_rows_of_a_large_batch_holds_only_those_rows():
    """Copy-on-write only where the memory shared is at most twice the rows shown: a copy of one row of a
    64-row batch keeps none of the other rows' memory alive."""
    batch = torch.randn(64, 100)
    copied, _ = private_copy(batch[5:6])
    assert copied.untyped_storage().nbytes() == copied.numel() * copied.element_size()
    assert torch.equal(copied, batch[5:6])
