"""Client-submitted interventions: checked, restricted, instrumented. Best effort, not a security boundary.

A server started with ``allow_code=True`` accepts the source of an ``async
def`` from clients. **What that code may do is stated in one file,**
:mod:`asyncinterp.client.policy` (modules, builtins, attribute names, tensor operations,
limits); every other module here takes its decisions from it. Before any
model work the source is

1. parsed and checked (:mod:`.checker`): imports, names, attribute names,
   syntax and size against the policy; anything else is a
   :class:`SandboxRefused` (HTTP 400) naming the line;
2. instrumented (:mod:`.instrumentation`): every loop, call, lambda and
   comprehension ticks the request's clock (:mod:`.clock`: compute budget,
   deadline, cancellation; :class:`SandboxTimeout` ends that request only),
   and an attribute name outside the allow-list is checked where it is read
   (only the model answers it);
3. executed (:mod:`.program`) with the policy's builtins and an import hook
   that hands out proxy modules holding only its operations
   (:mod:`.namespace`). Every tensor submitted code holds is a
   :class:`PrivateTensor` (:mod:`.tensors`), whose ``__torch_function__``
   refuses operations outside the policy, checks index bounds and measures
   every result against one size cap before it is made;
4. given a restricted view of the model (:mod:`.envoys`: :class:`SafeEnvoy`,
   :class:`SafePoint`). Awaited values, ``gather``/``spawn`` results and
   ad-hoc call results are private copies of the request's own rows
   (:mod:`.values`); in-place edits of them are written back, checked,
   through ``point.replace`` when the task next awaits (:mod:`.driver`).

What this does not do (see docs/serving.md, "Security"): Python has no real
in-process sandbox. A bug in these checks, in CPython or in a torch operator
may let determined code escape; long-running single C calls (a large
matmul in a loop, ``sum(range(10**7))``) cannot be interrupted; memory of
Python objects is not limited (tensors are, one by one). Enable submitted
code only for users you would let run code on the machine, or run the server
in a container/VM with no secrets.
"""

from __future__ import annotations

from .checker import check_source
from .envoys import SafeEnvoy, SafePoint
from .errors import SandboxRefused, SandboxTimeout
from .instrumentation import instrument
from .namespace import modules, safe_builtins
from .operations import STATIC_DENIED_OPS
from ...client.policy import (ALLOWED_ATTRIBUTES, ALLOWED_MODULES, MAX_AST_NODES, MAX_NESTING, MAX_RANGE,
        MAX_SOURCE_CHARS, MAX_TENSOR_BYTES)
from ...client.policy import ASSIGNABLE_POINTS as POINT_NAMES
from ...client.policy import REFUSED_ATTRIBUTES as DENIED_ATTRS
from ...client.policy import REFUSED_BUILTINS as DENIED_NAMES
from .program import Program, ProgramCache
from .tensors import PrivateTensor, private_copy, version_of
from .values import Record, release, sanitize, scrub

__all__ = [
    "ALLOWED_ATTRIBUTES", "ALLOWED_MODULES", "DENIED_ATTRS", "DENIED_NAMES", "MAX_AST_NODES", "MAX_NESTING",
    "MAX_RANGE", "MAX_SOURCE_CHARS", "MAX_TENSOR_BYTES", "POINT_NAMES", "STATIC_DENIED_OPS",
    "PrivateTensor", "Program", "ProgramCache", "Record", "SafeEnvoy", "SafePoint", "SandboxRefused",
    "SandboxTimeout", "check_source", "instrument", "modules", "private_copy", "release", "safe_builtins",
    "sanitize", "scrub", "version_of",
]
