"""Sessions: several runs that share values, as plain Python.

Interventions are ordinary closures and :class:`~asyncinterp.Future` is not
tied to a run, so values flow between traces without any special machinery:
a value set in run 1 is simply there in run 2::

    clean = ai.Future()

    async def record(m):
        clean.set_result((await m.layers[1].output).clone())

    async def patch(m):
        h = await m.layers[1].output
        h[:] = await clean                     # set by the earlier run: resumes at once
        return await m.output

    model.trace(x_clean, record)
    patched = model.trace(x_corrupt, patch)

A :class:`Session` adds bookkeeping around that pattern, nothing more:

* named futures (``s.future("clean")`` / ``s["clean"]``) so helpers can find a
  shared value by name instead of passing it around;
* ``s.trace``/``s.generate``/``s.atrace`` run at once (in order, like plain
  calls) and keep every run in ``s.runs``; the run's own method returns the
  invoke, so ``.result`` reads it later;
* ``s.unset()`` lists the named futures no run has set; leaving the ``with``
  block drops the session's references to shared values (tensors are freed).

Rules: runs of a session execute one after another in the order they are
called; a run can only use values set by earlier runs (a future set by a
later run cannot be awaited: the run fails with ``UnsetFutureError`` when it
ends). Several models can take part in one session.
"""

from __future__ import annotations

from ..kernel.futures import Future

__all__ = ["Session"]

_NOTHING = object()


class Session:
    """Runs that share named futures and plain values (see module docs)."""

    def __init__(self, model=None, keep: bool = False):
        self.model = model
        self.keep = keep
        self.futures = {}
        self.values = {}
        self.runs = []
        self.closed = False

    # ------------------------------------------------------------- sharing
    def future(self, name: str) -> Future:
        """The session's future called ``name`` (created on first use)."""
        self._check_open()
        fut = self.futures.get(name)
        if fut is None:
            fut = self.futures[name] = Future(name)
        return fut

    __getitem__ = future

    # ------------------------------------------------------------- running
    def _model(self, model):
        model = model if model is not None else self.model
        if model is None:
            raise TypeError("this session has no default model: pass model=..., or create it with model.session()")
        return model

    def trace(self, input=_NOTHING, *fns, model=None, **kwargs):
        """Run one trace now (see ``Model.trace``); returns its invoke (``.result``) or its trace.

        With no input and no intervention, returns the trace to fill in a
        ``with`` block (it executes when the block ends, and is recorded).
        """
        self._check_open()
        m = self._model(model)
        tr = m.trace()
        self.runs.append(tr)
        if input is _NOTHING and not fns:
            return tr
        inv = tr.invoke(None if input is _NOTHING else input, *fns, **kwargs)
        tr.run()
        return inv

    def generate(self, input, *fns, model=None, **kwargs):
        """Run one generation now (``LanguageModel.generate``); returns its generation handle."""
        self._check_open()
        m = self._model(model)
        tr = m.generate(**kwargs)
        self.runs.append(tr)
        inv = tr.invoke(input, *fns)
        tr.run()
        return inv

    async def atrace(self, input, *fns, model=None, **kwargs):
        """:meth:`trace` from async code (the forward runs in a worker thread)."""
        self._check_open()
        m = self._model(model)
        tr = m.trace()
        self.runs.append(tr)
        inv = tr.invoke(input, *fns, **kwargs)
        await tr.arun()
        return inv

    # ------------------------------------------------------------- closing
    def unset(self) -> list:
        """Names of the session's futures that no run has set."""
        return [name for name, f in self.futures.items() if not f.done()]

    def close(self) -> None:
        """Drop the shared values (unless ``keep=True``)."""
        self.closed = True
        if not self.keep:
            self.futures.clear()
            self.values.clear()
            self.runs.clear()

    def _check_open(self):
        if self.closed:
            raise RuntimeError("this session is closed; start a new one")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()
        return False

    async def __aenter__(self):
        return self

    async def __aexit__(self, exc_type, exc, tb):
        self.close()
        return False

    def __repr__(self):
        state = "closed" if self.closed else f"{len(self.runs)} runs, futures {sorted(self.futures)}"
        return f"<ai.Session {state}>"
