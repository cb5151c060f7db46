"""The tables of files, batches, answered batch lines and runtime edits, and the queries on them.

Why this module exists: these records must outlive the server and be shared by its replicas, so they
live in the kept-jobs database (SQLite under ``--state-dir``, or PostgreSQL), beside the jobs table,
through SQLAlchemy core (no SQL of one dialect by hand); their schema is the Alembic revision
``0002`` of :mod:`...jobs.durable.migrations`. The tables are on the jobs' ``metadata``.

* ``asyncinterp_files``: an uploaded file or a batch's output, its owner (a key's hash), bytes and expiry
  (an expired file is not found, and the runner's sweep removes it: :meth:`Tables.expire_files`);
* ``asyncinterp_batches``: a batch's OpenAI record (JSON), its status, owner, the kept job that runs it,
  and its own copy of its input;
* ``asyncinterp_batch_lines``: one row per answered line, keyed by ``(batch, line)``: a line's answer
  is inserted once, and a second insert (a run that lost its lease) changes nothing;
* ``asyncinterp_edits``: the named edits registered at run time (:mod:`.edits`).
"""

from __future__ import annotations

import json
import time

import sqlalchemy as sa

from ...jobs.durable.schema import metadata

__all__ = ["Tables", "batch_lines", "batches", "edits", "files"]

files = sa.Table(
    "asyncinterp_files", metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("owner", sa.String(64), nullable=False),
    sa.Column("purpose", sa.String(32), nullable=False),
    sa.Column("filename", sa.String(255), nullable=False),
    sa.Column("bytes", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("data", sa.LargeBinary, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=True),       # None: kept until deleted (revision 0003)
    sa.Index("ix_asyncinterp_files_owner_created", "owner", "created_at"),
)

batches = sa.Table(
    "asyncinterp_batches", metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("owner", sa.String(64), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("job_id", sa.String(64), nullable=True),
    sa.Column("record", sa.JSON, nullable=False),
    sa.Column("input", sa.LargeBinary, nullable=False),
    sa.Index("ix_asyncinterp_batches_owner_created", "owner", "created_at"),
)

batch_lines = sa.Table(
    "asyncinterp_batch_lines", metadata,
    sa.Column("batch_id", sa.String(64), primary_key=True),
    sa.Column("line", sa.Integer, primary_key=True),
    sa.Column("ok", sa.Boolean, nullable=False),
    sa.Column("answer", sa.Text, nullable=False),
)

edits = sa.Table(
    "asyncinterp_edits", metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("digest", sa.String(80), nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("record", sa.JSON, nullable=False),
)

_FILE_COLUMNS = [c for c in files.c if c.name != "data"]


class Tables:
    """Queries on these tables over ``engine`` (the kept-jobs store's SQLAlchemy async engine)."""

    def __init__(self, engine):
        self.engine = engine

    # ------------------------------------------------------------------ files
    async def put_file(self, record: dict, data: bytes) -> None:
        """Store a file (replacing one with the same id: a batch's output written again after a crash)."""
        row = {k: record[k] for k in ("id", "owner", "purpose", "filename", "bytes", "created_at", "expires_at")}
        async with self.engine.begin() as conn:
            await conn.execute(files.delete().where(files.c.id == row["id"]))
            await conn.execute(files.insert().values(**row, data=data))

    @staticmethod
    def _live(fid: str, owner: str) -> tuple:
        """The file ``fid`` of ``owner``, unless it expired (gone for its owner at once, removed by the sweep)."""
        return (files.c.id == fid, files.c.owner == owner,
                sa.or_(files.c.expires_at.is_(None), files.c.expires_at > time.time()))

    async def file(self, fid: str, owner: str):
        async with self.engine.connect() as conn:
            row = (await conn.execute(sa.select(*_FILE_COLUMNS).where(*self._live(fid, owner)))).mappings().first()
        return dict(row) if row is not None else None

    async def file_data(self, fid: str, owner: str):
        async with self.engine.connect() as conn:
            return (await conn.execute(sa.select(files.c.data).where(*self._live(fid, owner)))).scalar()

    async def delete_file(self, fid: str, owner: str) -> bool:
        async with self.engine.begin() as conn:
            return (await conn.execute(files.delete().where(*self._live(fid, owner)))).rowcount == 1

    async def expire_files(self, now: float | None = None) -> int:
        """Remove the files whose time ran out; how many."""
        now = time.time() if now is None else now
        async with self.engine.begin() as conn:
            return (await conn.execute(files.delete().where(files.c.expires_at <= now))).rowcount

    async def list_files(self, owner: str, purpose=None) -> list:
        q = sa.select(*_FILE_COLUMNS).where(files.c.owner == owner,
                                            sa.or_(files.c.expires_at.is_(None), files.c.expires_at > time.time()))
        if purpose is not None:
            q = q.where(files.c.purpose == purpose)
        async with self.engine.connect() as conn:
            return [dict(r) for r in (await conn.execute(q.order_by(files.c.created_at, files.c.id))).mappings()]

    # ------------------------------------------------------------------ batches
    async def add_batch(self, record: dict, data: bytes) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(batches.insert().values(id=record["id"], owner=record["owner"],
                                                       status=record["status"], created_at=record["created_at"],
                                                       job_id=None, record=record, input=data))

    async def batch(self, bid: str, owner: str | None = None):
        """The batch's record (``None``: no such batch of ``owner``; ``owner=None``: anyone's)."""
        q = sa.select(batches.c.record, batches.c.job_id).where(batches.c.id == bid)
        if owner is not None:
            q = q.where(batches.c.owner == owner)
        async with self.engine.connect() as conn:
            row = (await conn.execute(q)).first()
        if row is None:
            return None
        return dict(row.record, asyncinterp=dict(row.record.get("asyncinterp") or {}, job=row.job_id))

    async def batch_input(self, bid: str) -> bytes:
        async with self.engine.connect() as conn:
            return (await conn.execute(sa.select(batches.c.input).where(batches.c.id == bid))).scalar()

    async def update_batch(self, bid: str, *, only_if=None, job_id=None, **changes):
        """Change fields of the batch's record; with ``only_if`` (statuses), only while its status is one of
        them. The new record, or ``None`` when ``only_if`` did not hold."""
        async with self.engine.begin() as conn:
            row = (await conn.execute(sa.select(batches.c.record).where(batches.c.id == bid))).first()
            if row is None or (only_if is not None and row.record["status"] not in only_if):
                return None
            record = dict(row.record, **changes)
            where = [batches.c.id == bid, batches.c.status == row.record["status"]]
            values = {"record": record, "status": record["status"]}
            if job_id is not None:
                values["job_id"] = job_id
            done = await conn.execute(batches.update().where(*where).values(**values))
        if done.rowcount != 1:           # its status changed meanwhile (another request, another replica)
            return await self.update_batch(bid, only_if=only_if, job_id=job_id, **changes)
        return record

    async def list_batches(self, owner: str | None) -> list:
        q = sa.select(batches.c.record, batches.c.job_id)
        if owner is not None:
            q = q.where(batches.c.owner == owner)
        async with self.engine.connect() as conn:
            rows = (await conn.execute(q.order_by(batches.c.created_at, batches.c.id))).all()
        return [dict(r.record, asyncinterp=dict(r.record.get("asyncinterp") or {}, job=r.job_id)) for r in rows]

    # ------------------------------------------------------------------ answered lines
    async def add_line(self, bid: str, index: int, ok: bool, answer: dict) -> bool:
        """Keep a line's answer; ``False`` when the line had one already (it keeps the first)."""
        try:
            async with self.engine.begin() as conn:
                await conn.execute(batch_lines.insert().values(batch_id=bid, line=index, ok=ok,
                                                               answer=json.dumps(answer, separators=(",", ":"))))
            return True
        except sa.exc.IntegrityError:
            return False

    async def answered(self, bid: str) -> dict:
        """``{line index: (ok, answer)}`` of the batch's answered lines."""
        async with self.engine.connect() as conn:
            rows = (await conn.execute(sa.select(batch_lines).where(batch_lines.c.batch_id == bid))).all()
        return {r.line: (r.ok, json.loads(r.answer)) for r in rows}

    async def counts(self, bid: str) -> tuple:
        """``(answered ok, answered with an error)``."""
        q = sa.select(batch_lines.c.ok, sa.func.count()).where(batch_lines.c.batch_id == bid) \
            .group_by(batch_lines.c.ok)
        async with self.engine.connect() as conn:
            got = dict((bool(ok), n) for ok, n in (await conn.execute(q)).all())
        return got.get(True, 0), got.get(False, 0)

    async def drop_lines(self, bid: str) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(batch_lines.delete().where(batch_lines.c.batch_id == bid))

    # ------------------------------------------------------------------ runtime edits
    async def put_edit(self, record: dict) -> None:
        async with self.engine.begin() as conn:
            await conn.execute(edits.delete().where(edits.c.name == record["name"]))
            await conn.execute(edits.insert().values(name=record["name"], digest=record["hash"],
                                                     created_at=record["created_at"], record=record))

    async def delete_edit(self, name: str) -> bool:
        async with self.engine.begin() as conn:
            return (await conn.execute(edits.delete().where(edits.c.name == name))).rowcount == 1

    async def all_edits(self) -> dict:
        async with self.engine.connect() as conn:
            rows = (await conn.execute(sa.select(edits.c.record).order_by(edits.c.created_at))).all()
        return {r.record["name"]: r.record for r in rows}
