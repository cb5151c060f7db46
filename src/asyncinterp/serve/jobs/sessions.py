"""Sessions as one job: an ``async def sweep(model)`` that runs several traces, shipped once, run on the server.

Why: a patching sweep is a clean run, then patched runs for many layers,
with values flowing between them. Sent trace by trace, every activation
crosses the network twice and each trace pays a round trip. As a session,
the function travels once (captured like any intervention: its source, the
values and helpers it reads, :mod:`.capture`), runs where the model is, and
only its return value comes back. The same function runs locally
unchanged: ``await sweep(lm)``.

On the server the session is submitted code (:class:`~.rebuild_sandbox.Sandboxed`:
checked, instrumented, restricted builtins and modules). Its argument is a
:class:`SessionModel`, which offers what a session calls on a local model:

* ``await model.atrace(input, fn, ...)`` and ``await model.agenerate(input,
  fn, ..., max_new_tokens=n)``: each becomes a request of the server's
  batcher, so it **joins the shared batches** like any other request; its
  interventions (functions the session defined or captured) see the model
  through the sandbox's restricted view;
* what a trace returns comes back to the session as **private copies on the
  server** (:func:`~.sandbox.sanitize`): values stay there between traces;
* ``model.token_id(text)`` and ``model.to_tokens(text)``.

One clock for the whole session: its **budgets** (the server's compute
budget, counted while the session's own code runs, between traces and inside
every intervention; the request's time limit) cover the session, not each
trace. A client that **disconnects or cancels** stops it: the trace running
then is cancelled at its next hook point, and the session's code stops at
its next line.

Wire form (``POST /v1/sessions``, msgpack): ``{"capture": <description>,
"session": {"function": i, "keywords": {...}}, "timeout"?: seconds}``; the
answer is ``{"ok": true, "result": value}``. :func:`session_body` writes it
(the clients' ``session`` method uses it).
"""

from __future__ import annotations

import functools
import time
import types

from ... import aio
from ...client import wire
from .durable.hook import submit_kept
from .errors import RequestFailed
from ..scheduling.params import short_repr
from ..sandbox.checker import AST_LOCK
from ..sandbox.rebuild import DescriptionRefused, DescriptionTooLarge, check_size, intervention, rebuild
from ..sandbox.rebuild_sandbox import Sandboxed
from ..sandbox import SandboxRefused
from ..sandbox.driver import Driven
from ..sandbox.envoys import SafeEnvoy
from ..sandbox.errors import SUBMITTED_PREFIX, user_line
from ..sandbox.gradients import check_no_grad_refusal, needs_grad
from ..sandbox.values import Record, release, sanitize

__all__ = ["SessionModel", "load_session", "session_body", "session_endpoint"]

# writing a session's body is the client's (it loads no server code); the name stays importable from here
from ...client.clients import session_body  # noqa: E402,F401


class SessionModel:
    """The model as a session on the server sees it: ``atrace``, ``agenerate``, ``token_id``, ``to_tokens``.

    Every trace is a request of ``batcher`` (shared batches), metered on the session's clock and bounded
    by its deadline; interventions must be functions of the session's own (checked) code.
    """

    __slots__ = ("_server", "_batcher", "_clock", "_deadline", "_grad", "_finished")

    def __init__(self, server, batcher, clock, deadline: float, grad: bool, finished=None):
        for k, v in (("_server", server), ("_batcher", batcher), ("_clock", clock), ("_deadline", deadline),
                     ("_grad", grad), ("_finished", finished)):
            object.__setattr__(self, k, v)

    def _done(self, what: str) -> None:
        finished = object.__getattribute__(self, "_finished")
        if finished is not None:      # a kept job's progress (serve/jobs/durable/kinds.py)
            finished(what)

    def __setattr__(self, key, value):
        raise AttributeError("the session's model is read-only")

    def __repr__(self):
        return f"<session model {object.__getattribute__(self, '_server').name}>"

    def _entries(self, fns):
        clock = object.__getattribute__(self, "_clock")
        grad = object.__getattribute__(self, "_grad")
        out = []
        for fn in fns:
            kw = {}
            if isinstance(fn, functools.partial) and not fn.args:
                fn, kw = fn.func, {k: sanitize(v) for k, v in fn.keywords.items()}
            if type(fn) is not types.FunctionType or not fn.__code__.co_filename.startswith(SUBMITTED_PREFIX):
                raise TypeError(f"an intervention of a session must be an `async def` of the session's own code, "
                                f"got {type(fn).__name__} ({user_line()})")

            async def entry(m, fn=fn, kw=kw):
                return release(await Driven(fn(SafeEnvoy(m), **kw), clock))
            entry.__qualname__ = entry.__name__ = fn.__name__
            entry.needs_grad = grad
            out.append(entry)
        return out

    def _input(self, input):
        server = object.__getattribute__(self, "_server")
        try:
            x, length = server.check_input(input)
        except RequestFailed as fail:
            raise ValueError(f"{fail.error.get('message', fail)} ({user_line()})") from None
        return x, length

    def _timeout(self) -> float:
        left = object.__getattribute__(self, "_deadline") - time.monotonic()
        if left <= 0:
            raise TimeoutError("the session's time limit was reached")
        return left

    async def atrace(self, input, *fns):
        """Run ``fns`` on ``input`` in the server's shared batches; their result as private copies."""
        if not fns:
            raise TypeError(f"model.atrace in a session needs an intervention ({user_line()})")
        x, _ = self._input(input)
        entries = self._entries(fns)
        batcher = object.__getattribute__(self, "_batcher")
        clock = object.__getattribute__(self, "_clock")
        value = await batcher.trace(x, *entries, timeout=self._timeout(), on_cancel=_canceller(clock), meter=clock)
        self._done("traces")
        return sanitize(value)

    async def agenerate(self, input, *fns, max_new_tokens: int = 20):
        """Generate in the server's shared generations; ``.result``, ``.tokens`` and ``.text`` as private copies."""
        server = object.__getattribute__(self, "_server")
        if not server.is_lm:
            raise TypeError("this model does not generate")
        x, length = self._input(input)
        try:
            server.check_new_tokens(length, max_new_tokens)
        except RequestFailed as fail:
            raise ValueError(f"{fail.error.get('message', fail)} ({user_line()})") from None
        entries = self._entries(fns)
        batcher = object.__getattribute__(self, "_batcher")
        clock = object.__getattribute__(self, "_clock")
        g = await batcher.generate(x, *entries, max_new_tokens=max_new_tokens, timeout=self._timeout(),
                                   on_cancel=_canceller(clock), meter=clock)
        self._done("generations")
        import torch
        tokens = g.tokens[0] if g.tokens and isinstance(g.tokens[0], list) and len(g.tokens) == 1 else g.tokens
        return Record(result=sanitize(g.result), tokens=sanitize(torch.tensor(tokens)),
                      text=g.text[0] if isinstance(g.text, list) and len(g.text) == 1 else g.text)

    def token_id(self, text: str) -> int:
        return object.__getattribute__(self, "_server").model.token_id(str(text))

    def to_tokens(self, text: str) -> list:
        return list(object.__getattribute__(self, "_server").model.to_tokens(str(text)))


def _canceller(clock):
    def cancel():
        clock.cancelled = True
    return cancel


def _uses_gradients(description) -> bool:
    import ast
    for entry in description.get("functions") or []:
        try:
            with AST_LOCK:
                tree = ast.parse(entry.get("source") or "")
            if needs_grad(tree):
                return True
        except SyntaxError:
            return False     # rebuild refuses it with the reason
    return False


def load_session(server, body: dict, batcher, timeout: float, check_only: bool = False, finished=None):
    """A session request's function, checked and compiled as submitted code: ``run()`` runs it (a coroutine
    function returning its released result). Refusals (400) come before any model work. ``check_only``: the
    session runs elsewhere (a worker process loads it again), so no private copies of its values are made.
    ``finished("traces" | "generations")`` is called as each of its traces and generations ends."""
    description, spec = body.get("capture"), body.get("session")
    if not isinstance(description, dict) or not isinstance(spec, dict):
        raise RequestFailed("request", "a session needs 'capture' (the captured functions) and 'session' "
                                       "({'function', 'keywords'}) maps; use Client.session(fn)")
    deadline = time.monotonic() + timeout
    compile_source = Sandboxed(deadline, min(server.code_budget, timeout), copies=not check_only)
    clock = compile_source.clock
    try:
        check_size(description)
    except DescriptionTooLarge as exc:
        raise RequestFailed("too_large", str(exc)) from None
    grad = _uses_gradients(description)
    clock.grad = grad
    try:
        if grad:
            check_no_grad_refusal(types.SimpleNamespace(needs_grad=True), server.front.kind)
        built = rebuild(description, compile_source)
        fn = intervention(built, spec, description)
    except (SandboxRefused, DescriptionRefused) as exc:
        raise RequestFailed("refused", str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - anything else while loading the captured functions
        raise RequestFailed("refused", f"the session failed to load: {type(exc).__name__}: {exc}") from None
    if isinstance(fn, functools.partial):      # captured keywords: private copies, as every captured value
        fn = functools.partial(fn.func, **{k: compile_source.private(v) for k, v in fn.keywords.items()})
    model = SessionModel(server, batcher, clock, deadline, grad, finished)

    async def run():
        try:
            return release(await Driven(fn(model), clock))
        except BaseException:
            clock.cancelled = True      # anything of the session still running stops at its next line
            raise
    run.clock = clock
    return run


async def session_endpoint(server, request):
    """``POST /v1/sessions``: run a captured ``async def session(model)`` on the server (see the module docs)."""
    async def work(fields):
        if not server.allow_code:
            raise RequestFailed("refused", "this server does not accept submitted code (start it with "
                                           "--allow-code), so it runs no sessions")
        obj = server.decode_body(await server.read_body(request))
        if obj.pop("wait", True) is False:   # kept in the store, answered 202 with its id (serve/jobs/durable)
            return await submit_kept(server, request, obj, fields)
        server.check_fields(obj, {"capture", "session", "timeout"})
        timeout = server.request_timeout(obj)
        name = (obj.get("session") or {}).get("function") if isinstance(obj.get("session"), dict) else None
        fields["intervention"] = f"session:{short_repr(name)}"
        # refusals here, before any model work; checked in a thread, so that the event loop stays free meanwhile
        run = await aio.to_thread(load_session, server, obj, server.batcher, timeout, server.supervised)
        if server.supervised:     # it runs in the worker that runs submitted code (loaded there again)
            run = functools.partial(server.batcher.session, obj, timeout)
        return await server.respond(request, fields, run, lambda value: {"ok": True, "result": value})
    return await server.guarded(request, "session", work)
