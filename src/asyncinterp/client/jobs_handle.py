"""The client's handle on a kept job: ``job.status()``, ``job.result(timeout=)``, ``job.cancel()``, ``await job``.

Why: a remote trace, generation or session submitted with ``blocking=False`` (``lm.trace(x, fn,
blocking=False)``) returns at once with a handle; the work runs on the server whether or not the client
stays. ``lm.job(id)`` makes a handle again from the id alone, in another process or after a notebook
kernel restart, with the same API key (another key sees no such job).

* ``status()``: a :class:`JobStatus` — ``state`` (``queued``, ``running`` with ``progress``,
  ``succeeded``, ``failed`` with ``error`` as it would be raised locally, ``cancelled``), ``attempts``
  and ``restarts`` (a run its server did not finish: the job ran again from its start);
* ``result(timeout=None, progress=None)``: waits for the end (a progress bar in a terminal or notebook),
  then gives what the blocking call gives (a trace's value, a generation's invoke, a session's value, a
  submitted trace's invokes) or raises its error as the blocking call would; ``timeout``: seconds, then
  ``TimeoutError`` (the job goes on);
* ``cancel()``: a queued job never runs; a running one stops at its next hook point;
* ``delete()``: remove a finished job and its result from the server;
* ``await job`` / ``await job.aresult()``: the same from async code (asyncio or trio).

This module is the client's: it loads no server module (only httpx, the wire format and, when shown,
tqdm). Shaping the answer into invokes is the remote model's (``RemoteModel.job_answer``); the server's
side is :mod:`asyncinterp.serve.jobs.durable`.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import httpx

from . import wire
from .wire import RemoteError

__all__ = ["JobStatus", "RemoteJob", "FINAL"]

FINAL = ("succeeded", "failed", "cancelled")
_RECONNECT_FOR = 60.0      # seconds a waiting client retries a server that does not answer (it may restart)


@dataclasses.dataclass
class JobStatus:
    """A kept job's status (``info``: every field the server sent, docs/jobs.md)."""

    id: str
    state: str
    progress: dict | None
    attempts: int
    restarts: list
    error: BaseException | None
    info: dict

    @property
    def done(self) -> bool:
        return self.state in FINAL

    def __str__(self):
        extra = f" {self.progress}" if self.progress else ""
        return f"job {self.id}: {self.state}{extra}" + (f" (restarted {len(self.restarts)}x)" if self.restarts else "")


def _json(r):
    try:
        obj = r.json()
    except ValueError:
        obj = None
    if r.status_code >= 400:
        error = obj.get("error") if isinstance(obj, dict) else None
        raise RemoteError.from_wire(error or {"type": "HTTPError", "message": r.text[:300]}, r.status_code)
    return obj


class RemoteJob:
    """A job kept on the server (see the module docs). Made by ``blocking=False`` calls and ``lm.job(id)``."""

    def __init__(self, model, info: dict, carriers=None):
        self.model = model
        self.id = info["id"]
        self.kind = info.get("kind")
        self.returns = info.get("returns") or ""
        self.carriers = carriers       # the invokes of the submitting trace (None when reattached)
        self.last = info
        self._answer = None

    # ------------------------------------------------------------------ status
    def _url(self, tail: str = "") -> str:
        return f"{self.model.url}/v1/jobs/{self.id}{tail}"

    def _status(self, info: dict) -> JobStatus:
        self.last = info
        error = None
        if info.get("state") in ("failed", "cancelled") and info.get("error"):
            error = self.model.job_error(info["error"], info.get("status"))
        return JobStatus(info["id"], info["state"], info.get("progress"), info.get("attempts", 0),
                         list(info.get("restarts") or []), error, info)

    def status(self) -> JobStatus:
        """The job's status now (one request)."""
        return self._status(_json(self.model.http.get(self._url(), headers=self.model.headers)))

    def cancel(self) -> str:
        """Cancel the job: its state after (``cancelled``, or ``running`` until it stops at its next hook point)."""
        return _json(self.model.http.delete(self._url(), headers=self.model.headers))["state"]

    def delete(self) -> None:
        """Remove the finished job and its result from the server."""
        if not self.status().done:
            raise RuntimeError(f"job {self.id} has not ended: cancel() it, or wait for it, before deleting it")
        _json(self.model.http.delete(self._url(), headers=self.model.headers))

    # ------------------------------------------------------------------ waiting
    def wait(self, timeout: float | None = None, progress: bool | None = None) -> JobStatus:
        """Wait until the job ends (``TimeoutError`` after ``timeout`` seconds); its final status."""
        deadline = None if timeout is None else time.monotonic() + timeout
        bar = _Bar(self, progress)
        delay, unreachable = 0.05, None
        try:
            while True:
                try:
                    st = self.status()
                    unreachable = None
                except (httpx.TransportError, RemoteError) as exc:
                    if isinstance(exc, RemoteError) and (exc.status or 0) < 500:
                        raise
                    unreachable = unreachable or time.monotonic()
                    if time.monotonic() - unreachable > _RECONNECT_FOR:
                        raise RemoteError("ConnectionError", f"{self.model.url} did not answer for "
                                                             f"{_RECONNECT_FOR:g} s while waiting for job {self.id}: "
                                                             f"{exc}") from None
                    st = None
                if st is not None:
                    bar.update(st)
                    if st.done:
                        return st
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"job {self.id} did not end within {timeout:g} s (it goes on on the server; "
                                       f"wait again, or cancel it)")
                pause = delay if deadline is None else max(0.0, min(delay, deadline - time.monotonic()))
                time.sleep(pause)
                delay = min(delay * 1.5, 1.0)
        finally:
            bar.close()

    def result(self, timeout: float | None = None, progress: bool | None = None):
        """Wait for the job and give what the blocking call gives (or raise its error); see the module docs."""
        if self._answer is None:
            self.wait(timeout, progress)
            r = self.model.http.get(self._url("/result"), headers=self.model.headers)
            self._answer = (r.status_code, r.content)
        return self.model.job_answer(self, *self._answer)

    async def aresult(self, timeout: float | None = None):
        """:meth:`result` from async code (asyncio or trio)."""
        import anyio
        if self._answer is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            delay = 0.05
            async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=10.0)) as http:
                while True:
                    info = _json(await http.get(self._url(), headers=self.model.headers))
                    if self._status(info).done:
                        break
                    if deadline is not None and time.monotonic() >= deadline:
                        raise TimeoutError(f"job {self.id} did not end within {timeout:g} s (it goes on on the "
                                           f"server)")
                    await anyio.sleep(delay)
                    delay = min(delay * 1.5, 1.0)
                r = await http.get(self._url("/result"), headers=self.model.headers)
            self._answer = (r.status_code, r.content)
        return self.model.job_answer(self, *self._answer)

    def __await__(self):
        return self.aresult().__await__()

    def __repr__(self):
        return f"<RemoteJob {self.id} {self.kind} {self.last.get('state')}>"


def answer_of(status: int, content: bytes):
    """The decoded answer of ``GET /v1/jobs/ID/result`` (raises the error of a whole job's failure as-is)."""
    try:
        obj = wire.unpackb(content, wire.answer_limits(len(content)))
    except wire.WireError:
        raise RemoteError("HTTPError", f"HTTP {status}: {content[:300].decode('utf-8', 'replace')}",
                          status=status) from None
    if status == 200 and isinstance(obj, dict) and obj.get("ok"):
        return obj
    if isinstance(obj, dict) and "error" in obj:
        raise RemoteError.from_wire(obj["error"], status)
    raise RemoteError("HTTPError", f"HTTP {status}: unexpected answer", status=status)


class _Bar:
    """A tqdm progress bar while waiting (shown in a notebook or a terminal; ``progress`` forces it on/off)."""

    def __init__(self, job, show):
        self.bar = None
        if show is None:
            show = _interactive()
        if show:
            try:
                from tqdm.auto import tqdm
            except ImportError:   # the client without tqdm: no bar
                return
            self.bar = tqdm(total=None, desc=f"job {job.id[:12]}", unit="step", leave=False)

    def update(self, st: JobStatus) -> None:
        if self.bar is None:
            return
        p = st.progress or {}
        if p.get("of") and self.bar.total != p["of"]:
            self.bar.total = p["of"]
        for count in (p.get("step"), p.get("done"), (p.get("completed") or 0) + (p.get("failed") or 0) or None):
            if count is not None:          # a generation's steps, a session's traces, a batch's lines
                self.bar.n = count
                break
        note = st.state + (f" ({p['phase']})" if st.state == "running" and p.get("phase") else "") + \
            (f", attempt {st.attempts}" if st.attempts > 1 else "")
        self.bar.set_postfix_str(note, refresh=False)
        self.bar.refresh()

    def close(self):
        if self.bar is not None:
            self.bar.close()


def _interactive() -> bool:
    if "ipykernel" in sys.modules:
        return True
    return bool(getattr(sys.stderr, "isatty", lambda: False)())
