"""The policy's operation names resolved to torch's objects, once, at import.

:class:`~.tensors.PrivateTensor` is handed torch's function objects (a
method, an operator, a property getter), not names: this maps each allowed
one back to its name in :mod:`asyncinterp.client.policy`. It also names the torch operations
the policy leaves out, so that the checker refuses those already at
submission (``x.storage()``, ``torch.sparse_coo_tensor``) rather than when
they run.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from ...client import policy


def _allowed_objects() -> dict:
    """{torch callable or property getter: name} for every allowed operation on a tensor."""
    out = {}
    for name in policy.TENSOR_METHODS:
        fn = getattr(torch.Tensor, name, None)
        if fn is not None:
            out[fn] = name
    for name in policy.TENSOR_PROPERTIES:
        prop = getattr(torch.Tensor, name, None)
        if prop is not None and hasattr(prop, "__get__"):
            out[prop.__get__] = name
    for name in policy.TORCH_FUNCTIONS:
        fn = getattr(torch, name, None)
        if fn is not None and callable(fn) and not inspect.ismodule(fn):
            out[fn] = name
    for mod, names in ((F, policy.FUNCTIONAL), (torch.linalg, policy.LINALG_FUNCTIONS),
                       (torch.fft, policy.FFT_FUNCTIONS), (torch.special, policy.SPECIAL_FUNCTIONS)):
        for name in names:
            fn = getattr(mod, name, None)
            if fn is not None:
                out[fn] = f"{mod.__name__}.{name}"
    return out


ALLOWED_OPS = _allowed_objects()

# every public attribute of torch.Tensor and callable of torch
TORCH_NAMES = frozenset({n for n in dir(torch.Tensor) if not n.startswith("_")}
                        | {n for n in dir(torch) if not n.startswith("_") and callable(getattr(torch, n, None))})
# torch operations that are not allowed: refused already at submission when the source names one
STATIC_DENIED_OPS = TORCH_NAMES - policy.ALLOWED_ATTRIBUTES
