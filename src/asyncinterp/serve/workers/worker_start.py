"""Starting a worker process that inherits no thread state: a fork server, the model's weights shared, the server sent.

Why this module exists: a worker used to be ``fork()``\\ ed from the server
process. A fork copies only the calling thread, but every lock and every
library's internal state as the other threads left them. Inside a Ray Serve
replica, Ray's gRPC threads run all the time; about one replica start in 22
hung ("the code worker process did not start within 60 s", after gRPC's
"Other threads are currently calling into gRPC, skipping fork() handlers").
So workers are now started from a fresh interpreter:

* multiprocessing's **fork server** (``forkserver``): a process started by
  fork + exec (nothing of this process's threads survives an exec), which
  imports torch and the worker's modules once (:data:`PRELOAD`) and forks
  each worker from itself, single-threaded: a start costs a fork and the
  transfer below, not an interpreter start. Where there is no fork server
  (not Unix), ``spawn``. Unlike multiprocessing's default, neither the fork
  server nor a worker runs the server's main script (a script that starts
  a server at its top level would start servers in its workers): the fork
  server is told its name (:func:`_stand_in_main`), and functions defined
  there travel by value.
* **the model is not copied**: its parameters and buffers are moved once
  into one block of shared memory (:func:`share_model`, when the
  :class:`~.supervisor.Supervisor` is made); a worker receives that
  block's file descriptor (one, whatever the number of tensors: the fork
  server passes at most ~250 per start) and each tensor as a view into it
  (offset, size, stride, dtype). Every worker maps the same pages. Unlike a fork's
  copy-on-write pages, a write to a parameter in a worker is seen by the
  server and the other worker: submitted code cannot reach parameters (the
  sandbox), and registered interventions are trusted code.
* **the server travels as a value** (:class:`ServerPickler`): what a
  worker reads of the :class:`~.app.Server` (the model, the registered
  interventions and their functions, the installed named edits, the
  limits) is pickled for it, functions by value where they cannot be
  imported (``cloudpickle``: interventions defined in a notebook, a test or
  an ``--interventions`` file). What a fork used to carry implicitly is
  listed there. The HTTP side (the app, the supervisor, the metrics) stays
  behind. This is the server's own trusted state sent to its own child;
  nothing the worker sends back is ever unpickled (:mod:`.channel`).
* torch's process-wide settings that a fork copied (threads, default dtype,
  deterministic algorithms) and the request log's configuration go in the
  worker's settings (:func:`process_settings`, applied by
  :func:`apply_settings`).
"""

from __future__ import annotations

import io
import json
import logging
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.spawn
import os
import pickle
import sys
import types
import threading
import weakref
from collections import ChainMap
from multiprocessing.reduction import ForkingPickler

import cloudpickle

from ...hooks.envoy import Envoy
from ...model import Model, _ModelLock

__all__ = ["PRELOAD", "PackedServer", "ServerPickler", "apply_settings", "context", "pack_server",
           "process_settings", "share_model", "snapshot"]

#: what the fork server imports once, so that each worker it forks starts warm (this module first: it stands
#: in for the server's main script there)
PRELOAD = ["asyncinterp.serve.workers.worker_start", "torch", "asyncinterp.serve.workers.worker_proc", "asyncinterp.serve.http.app"]

#: how the server tells the fork server its main script's name, while the fork server starts
MAIN_ENV = "ASYNCINTERP_SERVER_MAIN"

#: attributes of the Server that stay in the server process (remade empty, or rebuilt, in a worker)
LEFT_BEHIND = ("batcher", "metrics", "_app", "programs", "front", "receipts")

_lock = threading.Lock()
_context = None


def context(model=None):
    """The multiprocessing context workers start from: the fork server (preloaded once, running), else spawn.

    The first call decides what the fork server preloads: :data:`PRELOAD` and the modules of ``model``'s
    classes (e.g. transformers' modeling module), which each worker would import again otherwise.
    """
    global _context
    with _lock:
        if _context is None:
            if "forkserver" in multiprocessing.get_all_start_methods():
                ctx = multiprocessing.get_context("forkserver")
                extra = [type(x).__module__ for x in (model, getattr(model, "module", None)) if x is not None]
                ctx.set_forkserver_preload(list(PRELOAD) + extra)   # a module that fails to import is skipped
            else:  # pragma: no cover - not Unix
                ctx = multiprocessing.get_context("spawn")
            _context = ctx
        if _context.get_start_method() == "forkserver":
            # started (or restarted) with the name of our main script, which it then never runs (see below)
            data = multiprocessing.spawn.get_preparation_data("asyncinterp-worker")
            main = {k: data[k] for k in ("init_main_from_path", "init_main_from_name") if k in data}
            # and with this process's import path (Python 3.11's fork server does not apply the one it is
            # given, so it would preload the modules from wherever its default path finds them)
            saved = os.environ.get("PYTHONPATH")
            os.environ[MAIN_ENV] = json.dumps(main)
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
            try:
                multiprocessing.forkserver.ensure_running()
            finally:
                os.environ.pop(MAIN_ENV, None)
                if saved is None:
                    os.environ.pop("PYTHONPATH", None)
                else:
                    os.environ["PYTHONPATH"] = saved
        return _context


def _stand_in_main() -> None:
    """In the fork server (this module is preloaded there first): an empty ``__main__`` under the server's
    main script's name, so that the workers it forks find "their" main already loaded and never run the
    script (multiprocessing runs it in every child otherwise)."""
    told = os.environ.pop(MAIN_ENV, None)
    if told is None:
        return
    main = json.loads(told)
    stand_in = types.ModuleType("__mp_main__")
    if "init_main_from_path" in main:
        stand_in.__file__ = main["init_main_from_path"]
    if "init_main_from_name" in main:
        import importlib.machinery
        stand_in.__spec__ = importlib.machinery.ModuleSpec(main["init_main_from_name"], None)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = stand_in


class SharedBlock:
    """One block of shared memory holding a model's parameters and buffers (:func:`share_model`)."""

    def __init__(self, flat):
        self.flat = flat                    # a uint8 tensor in shared memory
        self.ptr = flat.untyped_storage().data_ptr()

    def holds(self, t) -> bool:
        return t.device.type == "cpu" and t.untyped_storage().data_ptr() == self.ptr


_ALIGN = 64
_blocks = weakref.WeakKeyDictionary()      # module -> its SharedBlock


def share_model(model) -> SharedBlock | None:
    """Move ``model``'s parameters and buffers into one block of shared memory (once; later calls find it)."""
    import torch
    module = getattr(model, "module", None)
    if not isinstance(module, torch.nn.Module):
        return None
    found = _blocks.get(module)
    if found is not None:
        return found
    storages = {}                           # data_ptr -> (storage, [tensors viewing it])
    for t in list(module.parameters()) + list(module.buffers()):
        if t.device.type != "cpu" or t.is_sparse:
            continue
        s = t.untyped_storage()
        storages.setdefault(s.data_ptr(), (s, []))[1].append(t)
    offsets, total = {}, 0
    for ptr, (s, _) in storages.items():
        offsets[ptr] = total
        total += -(-s.nbytes() // _ALIGN) * _ALIGN
    flat = torch.empty(max(total, 1), dtype=torch.uint8).share_memory_()
    block = flat.untyped_storage()
    with torch.no_grad():
        for ptr, (s, tensors) in storages.items():
            base = offsets[ptr]
            flat[base:base + s.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(s))
            for t in {id(t): t for t in tensors}.values():
                view = torch.empty(0, dtype=t.dtype).set_(block, base // t.element_size() + t.storage_offset(),
                                                          t.size(), t.stride())
                t.data = view
    shared = _blocks[module] = SharedBlock(flat)
    return shared


# --------------------------------------------------------------------------- the server as a value
class ServerPickler(cloudpickle.Pickler):
    """Pickles the :class:`~.app.Server` ``server`` for a worker: tensors as shared-memory handles (torch's
    reductions), functions by reference or by value (cloudpickle), the model and its envoys without their
    locks, and the server without what stays behind (:data:`LEFT_BEHIND`).

    What a fork used to carry and this sends instead: the model (``server.model``: module, tokenizer,
    envoys, persistent edits, attachments), the registered interventions (``server.interventions``), the
    named edits and adapters (``server.names``), the limits and options (every other attribute). The
    heartbeat's memory and the pipe travel as the process's arguments (:mod:`.pool`).
    """

    # multiprocessing's table holds torch's reductions (tensors and storages as shared-memory handles)
    dispatch_table = ChainMap(ForkingPickler(io.BytesIO()).dispatch_table, cloudpickle.Pickler.dispatch_table)

    def __init__(self, file, server, state: dict):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.server = server
        self.state = state
        self.block = share_model(server.model)

    def persistent_id(self, obj):
        # the shared block itself goes beside these bytes, with the process's start (its descriptor)
        return "shared-block" if self.block is not None and obj is self.block.flat else None

    def reducer_override(self, obj):
        import torch
        if self.block is not None and isinstance(obj, torch.Tensor) and obj is not self.block.flat \
                and self.block.holds(obj):
            return _shared_view, (self.block.flat, obj.storage_offset(), tuple(obj.size()), tuple(obj.stride()),
                                  obj.dtype, type(obj), obj.requires_grad)
        if obj is self.server:
            return _blank, (type(obj),), self.state, None, None, _server_state
        if isinstance(obj, Envoy):
            state = dict(vars(obj))
            if isinstance(obj, Model):
                state["run_lock"] = None            # a fresh lock in the worker (_envoy_state)
                for key in ("_engine", "_engines"):   # engines hold locks; made again on first use
                    if key in state:
                        state[key] = None
            return _blank, (type(obj),), state, None, None, _envoy_state
        return super().reducer_override(obj)


def snapshot(server) -> dict:
    """What a worker is sent of ``server``'s own attributes (dicts copied): taken where registrations happen
    (the server's event loop), so that they do not change while :func:`pack_server` pickles them."""
    return {k: (dict(v) if type(v) is dict else v) for k, v in vars(server).items() if k not in LEFT_BEHIND}


def pack_server(server, state: dict | None = None) -> "PackedServer":
    """``server`` (its :func:`snapshot` ``state``) pickled for one worker, beside its shared block."""
    buf = io.BytesIO()
    pickler = ServerPickler(buf, server, snapshot(server) if state is None else state)
    pickler.dump(server)
    return PackedServer(buf.getvalue(), pickler.block.flat if pickler.block is not None else None)


class PackedServer:
    """The server as a worker's argument: its bytes, and the shared block, whose file descriptor goes with
    the process's start (torch's reduction, under the starting process); unpickled in the worker."""

    def __init__(self, data: bytes, flat):
        self.data = data
        self.flat = flat

    def __reduce__(self):
        return _unpack, (self.data, self.flat)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file, flat):
        super().__init__(file)
        self.flat = flat

    def persistent_load(self, pid):
        if pid != "shared-block":
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        return self.flat


def _unpack(data: bytes, flat):
    """In the worker: the server that :func:`pack_server` wrote (the server's own state, trusted)."""
    return _Unpickler(io.BytesIO(data), flat).load()


def _shared_view(flat, offset, size, stride, dtype, cls, requires_grad):
    """In the worker: a model tensor as the view into the shared block that it is in the server."""
    import torch
    t = torch.empty(0, dtype=dtype).set_(flat.untyped_storage(), offset, size, stride)
    if issubclass(cls, torch.nn.Parameter):
        return cls(t, requires_grad=requires_grad)
    return t.requires_grad_(requires_grad) if requires_grad else t


def _blank(cls):
    return object.__new__(cls)


def _envoy_state(obj, state):
    obj.__dict__.update(state)
    if isinstance(obj, Model):
        object.__setattr__(obj, "run_lock", _ModelLock())


def _server_state(obj, state):
    from ..scheduling.engine_front import front_for
    from ..sandbox import ProgramCache
    obj.__dict__.update(state)
    obj.__dict__.update(batcher=None, metrics=None, _app=None, receipts=None, programs=ProgramCache(),
                        front=front_for(obj.model))


# --------------------------------------------------------------------------- process-wide settings
def process_settings() -> dict:
    """What a fork copied of this process and a fresh worker must be told: torch's settings, the request log."""
    import torch
    log = logging.getLogger("asyncinterp.serve")
    formatter = next((h.formatter for h in log.handlers if h.formatter is not None), None)
    return {"threads": torch.get_num_threads(), "dtype": str(torch.get_default_dtype()).removeprefix("torch."),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "log": (formatter, log.level, log.propagate) if log.handlers else None}


def apply_settings(settings: dict) -> None:
    """In the worker: the settings :func:`process_settings` read in the server."""
    import torch
    if settings.get("threads"):
        torch.set_num_threads(settings["threads"])
    if settings.get("dtype"):
        torch.set_default_dtype(getattr(torch, settings["dtype"]))
    if settings.get("deterministic"):
        torch.use_deterministic_algorithms(True)
    if settings.get("log"):   # the request log as the server set it up (startup.setup_logging): to stderr
        formatter, level, propagate = settings["log"]
        handler = logging.StreamHandler(sys.stderr)
        if formatter is not None:
            handler.setFormatter(formatter)
        log = logging.getLogger("asyncinterp.serve")
        log.handlers[:] = [handler]
        log.setLevel(level)
        log.propagate = propagate


_stand_in_main()
