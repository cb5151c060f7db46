"""The kept-jobs service of one server: its store, runner, quotas, and what a submission does.

Why: the server (:class:`~..app.Server`) holds one of these as ``server.durable`` when it keeps jobs
(``asyncinterp serve --state-dir DIR`` or ``--database URL``); the endpoints of :mod:`.routes` and the
``wait: false`` submissions of ``POST /v1/jobs`` and ``POST /v1/sessions`` go through it. The store
opens (and migrates) and the runner starts when the app starts; both stop with it.

A submission is checked exactly as its blocking request would be (version, body, the job's code through
the sandbox, limits: a bad job is refused with 400 now, not failed later), then its quotas are checked
(429), then its wire form is stored with its envelope (owner, time limit) and the answer is ``202`` with
the job's id.
"""

from __future__ import annotations

import dataclasses
import hmac
import time

from starlette.responses import JSONResponse

from .... import aio
from ....client import wire
from .. import jobs_api
from ..errors import RequestFailed
from ...sandbox.rebuild_sandbox import Sandboxed
from ..sessions import load_session
from . import quotas as quota_checks
from .kinds import job_kind
from .runner import Runner
from .status import describe
from .store import JobStore, NewJob
from ..owners import caller_key, owner_of  # noqa: F401 (caller_key: its home was here)

__all__ = ["DurableConfig", "Durable", "caller_key"]

_JOB_FIELDS = frozenset({"protocol", "asyncinterp", "python", "job", "timeout", "returns", "label"})
_SESSION_FIELDS = frozenset({"capture", "session", "timeout", "returns", "label"})


@dataclasses.dataclass
class DurableConfig:
    """How a server keeps jobs (the command line's ``--state-dir``, ``--database``, ``--job-*`` flags)."""

    state_dir: str | None = None
    database: str | None = None
    admin_keys: tuple = ()
    lease: float = 15.0
    max_attempts: int = 3
    concurrency: int = 8
    ttl: float | None = 7 * 86400.0
    file_ttl: float | None = 30 * 86400.0     # uploaded files and batch outputs (OpenAI's expires_after overrides)
    job_timeout: float | None = None          # a kept job's time limit (default: the server's --timeout)
    quotas: quota_checks.Quotas = dataclasses.field(default_factory=quota_checks.Quotas)


class Durable:
    """The service (see the module docs)."""

    def __init__(self, server, config: DurableConfig):
        self.server = server
        self.config = config
        self.admin = [k.encode() for k in config.admin_keys if k]
        self.store = None
        self.runner = None
        self.on_start, self.on_close = [], []   # async callables run once the store is open / before it closes
        self.sweeps = []                          # async callables the runner calls with its sweep of expired results

    def routes(self) -> list:
        """The app's routes of kept jobs (:mod:`.routes`)."""
        from .routes import routes
        return routes(self.server)

    async def start(self) -> None:
        self.store = await JobStore.open(self.config.database, self.config.state_dir)
        self.store.ttl, self.store.max_attempts = self.config.ttl, self.config.max_attempts
        self.runner = Runner(self.server, self.store, lease=self.config.lease, concurrency=self.config.concurrency,
                             ttl=self.config.ttl, running_per_owner=self.config.quotas.running, sweeps=self.sweeps)
        self.runner.start()
        for fn in self.on_start:
            await fn()

    async def aclose(self) -> None:
        for fn in self.on_close:
            await fn()
        if self.runner is not None:
            await self.runner.aclose()
        if self.store is not None:
            await self.store.close()

    # ------------------------------------------------------------------ who asks
    def owner(self, request) -> str:
        return owner_of(caller_key(request) if self.server.api_keys else None)

    def is_admin(self, request) -> bool:
        key = caller_key(request)
        return key is not None and any(hmac.compare_digest(key.encode("utf-8", "replace"), k) for k in self.admin)

    def ready(self):
        if self.store is None:
            raise RequestFailed("closed", "the job store is not open yet (the server is starting)")
        return self.store

    # ------------------------------------------------------------------ submitting
    async def submit(self, request, obj: dict, fields: dict):
        """A ``wait: false`` body of ``POST /v1/jobs`` or ``/v1/sessions``: checked, kept, ``202``."""
        store = self.ready()
        session = "session" in obj
        self.server.check_fields(obj, _SESSION_FIELDS if session else _JOB_FIELDS)
        returns, label = obj.pop("returns", ""), obj.pop("label", None)
        if not isinstance(returns, str) or len(returns) > 16 or (label is not None and not isinstance(label, str)):
            raise RequestFailed("request", "returns must be a short string and label a string")
        limit = self.config.job_timeout or self.server.timeout
        t = obj.get("timeout")
        if t is not None and (type(t) not in (int, float) or not t > 0 or t != t):
            raise RequestFailed("request", "timeout must be a positive number of seconds")
        timeout = limit if t is None else min(float(t), limit)
        obj = dict(obj, timeout=timeout)
        if session:
            await self._check_session(obj)
        else:
            await self._check_job(obj)
        kind = job_kind(obj)
        owner = self.owner(request)
        await quota_checks.check(store, owner, self.config.quotas)
        meta = {"label": label[:200]} if label else None
        job = NewJob(owner, kind, wire.packb(obj), timeout, returns, meta)
        jid = await store.submit(job)
        fields.update(kind=kind, job=jid, kept=True)
        self.runner.wake.set()
        return JSONResponse(describe(job.row()), status_code=202, headers={"Location": f"/v1/jobs/{jid}"})

    async def _check_job(self, obj):
        jobs_api.check_versions(obj)
        data = obj.get("job")
        if not isinstance(data, bytes):
            raise RequestFailed("request", "'job' must be the bytes of asyncinterp.serve.job_wire.dumps_job")
        server, timeout = self.server, obj["timeout"]
        sandbox = Sandboxed(time.monotonic() + timeout, min(server.code_budget, timeout), server.model,
                            copies=False) if server.allow_code else None
        job = await jobs_api.load_job_async(server, data, sandbox, timeout)
        jobs_api.checked_job(server, job)

    async def _check_session(self, obj):
        if not self.server.allow_code:
            raise RequestFailed("refused", "this server does not accept submitted code (start it with --allow-code), "
                                           "so it runs no sessions")
        await aio.to_thread(load_session, self.server, obj, self.server.batcher, obj["timeout"], True)
