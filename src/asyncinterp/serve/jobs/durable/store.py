"""The job store: SQLAlchemy 2's async core over SQLite (aiosqlite) or PostgreSQL (asyncpg).

Why: a job accepted without waiting must survive the request that brought it, the server that took it
(``kill -9``, a restart on the same state) and, with replicas, the replica that ran it. Every change of
a job's state is one compare-and-set ``UPDATE ... WHERE`` on its row, so a job is claimed by one server
at a time and its result is written once:

* :meth:`JobStore.claim` takes queued jobs, and running jobs whose lease expired (their server died),
  with ``UPDATE ... WHERE id = ? AND (state = 'queued' OR lease_until < now)``; the run that wins counts
  an attempt (and notes the restart when it is not the first);
* :meth:`JobStore.heartbeat` renews the leases of the jobs a server runs and tells it which were
  cancelled meanwhile (or lost: another server took them over after the lease ran out);
* :meth:`JobStore.finish` writes the outcome ``WHERE lease_owner = me AND state = 'running'``: a run
  that lost its lease writes nothing.

The queries are SQLAlchemy core expressions (no SQL of one dialect by hand); the schema is Alembic's
(:mod:`.migrations`, run when the store opens). Request bodies and results larger than ``inline_bytes``
are files under ``state_dir`` (results as JSON + safetensors, :mod:`.results`), written before the row
that names them, removed with it. Owners are the sha256 of API keys (:func:`owner_of`), never the keys.
"""

from __future__ import annotations

import asyncio
import dataclasses

import logging
import os
import pathlib
import secrets
import time

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import create_async_engine

from ..errors import status_of
from ..owners import owner_of  # noqa: F401 (its home was here)
from . import migrations, results
from .schema import CANCELLED, FAILED, FINAL, QUEUED, RUNNING, jobs

__all__ = ["JobStore", "NewJob", "owner_of", "new_id", "database_url"]

log = logging.getLogger("asyncinterp.serve.jobs")
INLINE_BYTES = 64 * 1024


def new_id() -> str:
    """An unguessable job id (192 random bits)."""
    return "job_" + secrets.token_urlsafe(24)


def database_url(database: str | None, state_dir) -> str:
    """The SQLAlchemy async URL: ``postgresql://`` → asyncpg; none → SQLite ``jobs.db`` under ``state_dir``."""
    if database:
        for plain, driver in (("postgresql://", "postgresql+asyncpg://"), ("postgres://", "postgresql+asyncpg://"),
                              ("sqlite:///", "sqlite+aiosqlite:///")):
            if database.startswith(plain):
                return driver + database[len(plain):]
        if database.startswith(("postgresql+asyncpg://", "sqlite+aiosqlite://", "postgresql+psycopg://")):
            return database
        raise ValueError(f"--database: a postgresql://USER@HOST:PORT/DB or sqlite:///PATH URL, got {database!r}")
    if state_dir is None:
        raise ValueError("the job store needs --state-dir DIR (SQLite) or --database postgresql://...")
    return f"sqlite+aiosqlite:///{pathlib.Path(state_dir).resolve() / 'jobs.db'}"


@dataclasses.dataclass
class NewJob:
    """What a submission stores: the wire form and its envelope."""

    owner: str
    kind: str
    request: bytes
    timeout: float
    returns: str = ""
    meta: dict | None = None
    id: str = dataclasses.field(default_factory=new_id)
    created_at: float | None = None          # set when it is stored

    def row(self) -> dict:
        """Its row as stored (queued; the request aside): what a status of the new job shows."""
        return dict(id=self.id, owner=self.owner, kind=self.kind, returns=self.returns, state=QUEUED,
                    timeout=float(self.timeout), meta=self.meta, created_at=self.created_at, attempts=0,
                    cancel_requested=False, result_bytes=0, compute_seconds=0.0)


class JobStore:
    """A job store on one database (see the module docs). Open with :meth:`open`, close with :meth:`close`."""

    #: seconds a job cancelled or failed by the store itself is kept (the runner's ``--job-ttl``; None: forever)
    ttl: float | None = None
    #: runs a job may start; one whose server died that many times while running it fails (it may be the cause)
    max_attempts: int = 3

    #: how often (seconds) a shared database's clock is read again (:meth:`sync_clock`)
    CLOCK_SYNC_S = 60.0

    def __init__(self, engine, state_dir, inline_bytes: int = INLINE_BYTES):
        self.engine = engine
        self.state_dir = pathlib.Path(state_dir) if state_dir is not None else None
        self.inline_bytes = int(inline_bytes)
        self.dialect = engine.dialect.name
        self.clock = time.time          # this server's clock ...
        self.offset = 0.0               # ... and how far the database's is ahead of it (sync_clock)
        self.synced = None              # when (time.monotonic()) the offset was measured

    def now(self) -> float:
        """The store's time (Unix seconds): the database's clock, as measured by :meth:`sync_clock`. Every
        time the store writes or compares (leases above all) is on it, so replicas whose own clocks disagree
        still agree on when a lease runs out."""
        return self.clock() + self.offset

    async def sync_clock(self, max_age: float | None = None) -> float:
        """Measure how far the database's clock is from this server's (``now()`` read through SQLAlchemy,
        halfway through the round trip); again only when the last measure is older than ``max_age``. An
        embedded SQLite database is on this host: its clock is this server's (offset 0). The offset."""
        if self.dialect == "sqlite":
            return 0.0
        if max_age is not None and self.synced is not None and time.monotonic() - self.synced < max_age:
            return self.offset
        async with self.engine.connect() as conn:
            t0 = self.clock()
            db = (await conn.execute(sa.select(sa.extract("epoch", sa.func.now())))).scalar_one()
            t1 = self.clock()
        self.offset, self.synced = float(db) - (t0 + t1) / 2, time.monotonic()
        return self.offset

    @classmethod
    async def open(cls, database: str | None = None, state_dir=None, *, inline_bytes: int = INLINE_BYTES,
                   pool_size: int = 5) -> "JobStore":
        """Open (and migrate) the store: ``database`` a PostgreSQL/SQLite URL, else SQLite under ``state_dir``."""
        if state_dir is not None:
            pathlib.Path(state_dir).mkdir(parents=True, exist_ok=True)
        url = database_url(database, state_dir)
        if url.startswith("sqlite"):
            engine = create_async_engine(url, connect_args={"timeout": 30})
            sa.event.listen(engine.sync_engine, "connect", _sqlite_wal)
        else:
            engine = create_async_engine(url, pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=True)
        if state_dir is None and not url.startswith("sqlite"):
            inline_bytes = 1 << 62     # no directory: everything in the database
        store = cls(engine, state_dir, inline_bytes)
        await store.migrate()
        await store.sync_clock()
        return store

    async def migrate(self, attempts: int = 5) -> None:
        """Alembic's upgrade to head; a replica that loses the race to create the schema retries."""
        for attempt in range(attempts):
            try:
                async with self.engine.begin() as conn:
                    await conn.run_sync(migrations.upgrade)
                return
            except sa.exc.DBAPIError:
                if attempt == attempts - 1:
                    raise
                await asyncio.sleep(0.2 * (attempt + 1))

    async def close(self) -> None:
        await self.engine.dispose()

    # ------------------------------------------------------------------ files beside the database
    def _path(self, name: str) -> pathlib.Path:
        return self.state_dir / name

    def _write(self, name: str, data: bytes) -> None:
        path = self._path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".part")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def _remove(self, *names) -> None:
        for name in names:
            if name and self.state_dir is not None:
                try:
                    self._path(name).unlink()
                except FileNotFoundError:
                    pass

    # ------------------------------------------------------------------ submitting and reading
    async def submit(self, job: NewJob, now: float | None = None) -> str:
        """Store a new queued job; its id."""
        now = self.now() if now is None else now
        request, request_path = job.request, None
        if len(request) > self.inline_bytes and self.state_dir is not None:
            request_path = f"requests/{job.id}.msgpack"
            await asyncio.to_thread(self._write, request_path, request)
            request = None
        job.created_at = now
        async with self.engine.begin() as conn:
            await conn.execute(jobs.insert().values(**job.row(), request=request, request_path=request_path))
        return job.id

    async def get(self, job_id: str, owner: str | None):
        """The job's row (a mapping), or ``None`` when it does not exist or ``owner`` (``None``: an admin) does
        not own it: both look the same to the caller."""
        q = sa.select(jobs).where(jobs.c.id == job_id)
        if owner is not None:
            q = q.where(jobs.c.owner == owner)
        async with self.engine.connect() as conn:
            row = (await conn.execute(q)).mappings().first()
        return dict(row) if row is not None else None

    async def list(self, owner: str | None, *, limit: int = 20, before: tuple | None = None,
                   state: str | None = None) -> list[dict]:
        """The newest jobs of ``owner`` (``None``: everyone's), newest first, older than ``before``
        (``(created_at, id)`` of the last row of the previous page)."""
        cols = [c for c in jobs.c if c.name not in ("request", "result_json", "result_tensors")]
        q = sa.select(*cols)
        if owner is not None:
            q = q.where(jobs.c.owner == owner)
        if state is not None:
            q = q.where(jobs.c.state == state)
        if before is not None:
            t, i = before
            q = q.where(sa.or_(jobs.c.created_at < t, sa.and_(jobs.c.created_at == t, jobs.c.id < i)))
        q = q.order_by(jobs.c.created_at.desc(), jobs.c.id.desc()).limit(limit)
        async with self.engine.connect() as conn:
            return [dict(r) for r in (await conn.execute(q)).mappings()]

    async def request(self, row) -> bytes:
        """The job's wire form."""
        if row["request"] is not None:
            return bytes(row["request"])
        return await asyncio.to_thread(self._path(row["request_path"]).read_bytes)

    async def result(self, row):
        """The job's result tree (``None`` before it succeeded)."""
        if row["result_json"] is not None:
            return results.decode(row["result_json"], bytes(row["result_tensors"] or b""))
        if row["result_path"]:
            stem = row["result_path"]

            def read():
                blob = self._path(stem + ".safetensors")
                return results.decode(self._path(stem + ".json").read_text(),
                                      blob.read_bytes() if blob.exists() else b"")
            return await asyncio.to_thread(read)
        return None

    # ------------------------------------------------------------------ quotas' counts
    async def usage(self, owner: str, since: float, now: float | None = None) -> dict:
        """What the quotas count of ``owner``, in one query: its ``queued`` jobs, its compute seconds since
        ``since`` (finished and still running jobs) with the finish time of the oldest of those finished
        jobs, and the bytes of the results it keeps with their earliest expiry."""
        now = self.now() if now is None else now
        c = jobs.c
        recent = c.finished_at >= since
        running = c.state == RUNNING
        live = sa.case((running & (c.started_at > since), now - c.started_at), (running, now - since), else_=0.0)
        kept = c.result_bytes > 0
        q = sa.select(sa.func.coalesce(sa.func.sum(sa.case((c.state == QUEUED, 1), else_=0)), 0),
                      sa.func.coalesce(sa.func.sum(sa.case((recent, c.compute_seconds), else_=0.0)), 0.0),
                      sa.func.coalesce(sa.func.sum(live), 0.0),
                      sa.func.min(sa.case((recent, c.finished_at))),
                      sa.func.coalesce(sa.func.sum(sa.case((kept, c.result_bytes), else_=0)), 0),
                      sa.func.min(sa.case((kept, c.expires_at)))).where(c.owner == owner)
        async with self.engine.connect() as conn:
            row = (await conn.execute(q)).one()
        return {"queued": int(row[0]), "compute_seconds": float(row[1]) + float(row[2]), "oldest_finished": row[3],
                "result_bytes": int(row[4]), "next_expiry": row[5]}

    # ------------------------------------------------------------------ running (the runner's side)
    async def claim(self, worker: str, lease: float, limit: int = 1, *, running_per_owner: int | None = None,
                    now: float | None = None) -> list[dict]:
        """Take up to ``limit`` jobs for ``worker``: queued ones (oldest first) and running ones whose lease
        expired. Each is a compare-and-set: of two servers claiming one job, one wins. A job cancelled while
        its server was gone ends as cancelled here instead of running again. ``running_per_owner``: skip
        the jobs of an owner that already runs that many."""
        now = self.now() if now is None else now
        expired = sa.and_(jobs.c.state == RUNNING, jobs.c.lease_until < now)
        q = sa.select(jobs.c.id, jobs.c.owner, jobs.c.state).where(sa.or_(jobs.c.state == QUEUED, expired)) \
            .order_by(jobs.c.created_at, jobs.c.id).limit(max(limit * 4, 8))
        taken = []
        async with self.engine.connect() as conn:
            candidates = (await conn.execute(q)).all()
            busy = {}
            if running_per_owner is not None and candidates:
                owners = {c.owner for c in candidates}
                busy = dict((await conn.execute(
                    sa.select(jobs.c.owner, sa.func.count()).where(jobs.c.owner.in_(owners), jobs.c.state == RUNNING,
                                                                  jobs.c.lease_until >= now)
                    .group_by(jobs.c.owner))).all())
        queued, expired_ids = [], []
        for cand in candidates:
            if len(queued) + len(expired_ids) >= limit:
                break
            if cand.state == QUEUED:
                if running_per_owner is not None and busy.get(cand.owner, 0) >= running_per_owner:
                    continue
                busy[cand.owner] = busy.get(cand.owner, 0) + 1
                queued.append(cand.id)
            else:
                expired_ids.append(cand.id)
        if queued:      # one compare-and-set for all: a job another server took meanwhile is not returned
            async with self.engine.begin() as conn:
                taken = [dict(r) for r in (await conn.execute(
                    jobs.update().where(jobs.c.id.in_(queued), jobs.c.state == QUEUED).values(
                        state=RUNNING, lease_owner=worker, lease_until=now + lease, attempts=jobs.c.attempts + 1,
                        started_at=now, progress=None).returning(*jobs.c))).mappings()]
            taken.sort(key=lambda r: queued.index(r["id"]))
        for job_id in expired_ids:          # rare (its server died): notes its restart, or ends it
            row = await self._take(job_id, worker, lease, now)
            if row is not None:
                taken.append(row)
        return taken

    async def _take(self, job_id, worker, lease, now):
        claimable = sa.or_(jobs.c.state == QUEUED, sa.and_(jobs.c.state == RUNNING, jobs.c.lease_until < now))
        async with self.engine.begin() as conn:
            before = (await conn.execute(sa.select(jobs.c.state, jobs.c.attempts, jobs.c.restarts, jobs.c.lease_owner,
                                                   jobs.c.cancel_requested, jobs.c.started_at)
                                         .where(jobs.c.id == job_id))).first()
            if before is None:
                return None
            restarts = list(before.restarts or [])
            if before.state == RUNNING:
                restarts.append({"at": now, "attempt": before.attempts,
                                 "why": "the server running it stopped (its lease expired); run again from its start"})
            ended = None
            if before.state == RUNNING and before.cancel_requested:
                ended = dict(state=CANCELLED, error=_error("RunCancelled", "the job was cancelled (DELETE /v1/jobs/ID)",
                                                           "cancelled"), status_code=status_of("cancelled"))
            elif before.state == RUNNING and before.attempts >= self.max_attempts:
                ended = dict(state=FAILED, status_code=status_of("crashed"), error=_error(
                    "JobLost", f"the server running this job stopped {before.attempts} times while running it (it may "
                               "be what stops them: it is not run again)", "crashed"))
            if ended is not None:      # it ends here, once (a compare-and-set as every change)
                await conn.execute(jobs.update().where(jobs.c.id == job_id, jobs.c.attempts == before.attempts,
                                                       claimable).values(
                    finished_at=now, lease_owner=None, lease_until=None, restarts=restarts or None,
                    expires_at=None if self.ttl is None else now + self.ttl, **ended))
                return None
            done = await conn.execute(jobs.update().where(jobs.c.id == job_id, jobs.c.attempts == before.attempts,
                                                          claimable).values(
                state=RUNNING, lease_owner=worker, lease_until=now + lease, attempts=before.attempts + 1,
                started_at=before.started_at or now, restarts=restarts or None, progress=None))
            if done.rowcount != 1:
                return None
            row = (await conn.execute(sa.select(jobs).where(jobs.c.id == job_id))).mappings().first()
        return dict(row)

    async def heartbeat(self, worker: str, ids, lease: float, now: float | None = None) -> dict:
        """Renew ``worker``'s leases on ``ids``; ``{id: "ok" | "cancel" | "lost"}`` (lost: not its job any more)."""
        now = self.now() if now is None else now
        ids = list(ids)
        if not ids:
            return {}
        async with self.engine.begin() as conn:
            await conn.execute(jobs.update().where(jobs.c.id.in_(ids), jobs.c.lease_owner == worker,
                                                   jobs.c.state == RUNNING).values(lease_until=now + lease))
            rows = (await conn.execute(sa.select(jobs.c.id, jobs.c.lease_owner, jobs.c.state, jobs.c.cancel_requested)
                                       .where(jobs.c.id.in_(ids)))).all()
        out = {i: "lost" for i in ids}
        for r in rows:
            if r.lease_owner == worker and r.state == RUNNING:
                out[r.id] = "cancel" if r.cancel_requested else "ok"
        return out

    async def set_progress(self, job_id: str, worker: str, progress: dict) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(jobs.update().where(jobs.c.id == job_id, jobs.c.lease_owner == worker,
                                                   jobs.c.state == RUNNING).values(progress=progress))

    async def finish(self, job_id: str, worker: str, state: str, *, result=None, error=None, status: int | None = None,
                     ttl: float | None = None, progress: dict | None = None, now: float | None = None) -> bool:
        """Write the outcome of ``worker``'s run (once: ``False`` when the run had lost its lease), with the
        run's last ``progress`` when given."""
        now = self.now() if now is None else now
        if state not in FINAL:
            raise ValueError(f"a job finishes as one of {FINAL}, not {state!r}")
        values = dict(state=state, finished_at=now, lease_owner=None, lease_until=None, error=error,
                      status_code=status, expires_at=None if ttl is None else now + ttl)
        if progress is not None:
            values["progress"] = progress
        path = None
        if result is not None:
            text, blob = await asyncio.to_thread(results.encode, result)
            size = len(text.encode()) + len(blob)
            values["result_bytes"] = size
            if size > self.inline_bytes and self.state_dir is not None:
                path = f"results/{job_id}.{secrets.token_hex(4)}"

                def write():
                    self._write(path + ".safetensors", blob)
                    self._write(path + ".json", text.encode())
                await asyncio.to_thread(write)
                values["result_path"] = path
            else:
                values.update(result_json=text, result_tensors=blob)
        async with self.engine.begin() as conn:
            started = (await conn.execute(sa.select(jobs.c.started_at).where(jobs.c.id == job_id))).scalar()
            values["compute_seconds"] = max(0.0, now - (started or now))
            done = await conn.execute(jobs.update().where(jobs.c.id == job_id, jobs.c.lease_owner == worker,
                                                          jobs.c.state == RUNNING).values(**values))
        if done.rowcount != 1:
            if path:
                self._remove(path + ".safetensors", path + ".json")
            return False
        return True

    async def release(self, job_id: str, worker: str) -> None:
        """Give a job back to the queue (its server is shutting down cleanly): another run starts it again."""
        async with self.engine.begin() as conn:
            await conn.execute(jobs.update().where(jobs.c.id == job_id, jobs.c.lease_owner == worker,
                                                   jobs.c.state == RUNNING).values(lease_until=0.0))

    # ------------------------------------------------------------------ the owner's side
    async def cancel(self, job_id: str, owner: str | None, now: float | None = None) -> str | None:
        """Cancel: a queued job ends as cancelled now (it never runs); a running one is asked to stop (its server
        stops it at its next hook point and ends it as cancelled). The state after it (``None``: no such job)."""
        now = self.now() if now is None else now
        mine = [jobs.c.id == job_id] + ([jobs.c.owner == owner] if owner is not None else [])
        async with self.engine.begin() as conn:
            done = await conn.execute(jobs.update().where(*mine, jobs.c.state == QUEUED).values(
                state=CANCELLED, finished_at=now, cancel_requested=True, status_code=status_of("cancelled"),
                expires_at=None if self.ttl is None else now + self.ttl,
                error=_error("RunCancelled", "the job was cancelled before it ran (DELETE /v1/jobs/ID)", "cancelled")))
            if done.rowcount == 1:
                return CANCELLED
            await conn.execute(jobs.update().where(*mine, jobs.c.state == RUNNING).values(cancel_requested=True))
            state = (await conn.execute(sa.select(jobs.c.state).where(*mine))).scalar()
        return state

    async def delete(self, job_id: str, owner: str | None) -> bool:
        """Remove a finished job and its result (``False``: no such finished job of ``owner``)."""
        mine = [jobs.c.id == job_id] + ([jobs.c.owner == owner] if owner is not None else [])
        async with self.engine.begin() as conn:
            row = (await conn.execute(sa.select(jobs.c.result_path, jobs.c.request_path)
                                      .where(*mine, jobs.c.state.in_(FINAL)))).first()
            if row is None:
                return False
            await conn.execute(jobs.delete().where(*mine, jobs.c.state.in_(FINAL)))
        self._drop_files(row)
        return True

    async def expire(self, now: float | None = None) -> int:
        """Remove the finished jobs whose results expired; how many."""
        now = self.now() if now is None else now
        gone = jobs.c.expires_at < now
        async with self.engine.begin() as conn:
            rows = (await conn.execute(sa.select(jobs.c.result_path, jobs.c.request_path).where(gone))).all()
            await conn.execute(jobs.delete().where(gone))
        for row in rows:
            self._drop_files(row)
        return len(rows)

    def _drop_files(self, row) -> None:
        if row.result_path:
            self._remove(row.result_path + ".safetensors", row.result_path + ".json")
        self._remove(row.request_path)


def _sqlite_wal(dbapi_connection, _record) -> None:
    """SQLite's write-ahead log: readers (status, quotas) never wait for a writer (a claim, an outcome), and a
    commit is one append to the log, synced (``synchronous=FULL``: a 202 survives a power cut too)."""
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.close()


def _error(type_: str, message: str, kind: str) -> dict:
    """An error map as the server's error table writes them (:mod:`..errors`)."""
    return {"type": type_, "message": message, "traceback": [], "notes": [], "kind": kind}
