"""The tables of the job store, as SQLAlchemy core objects (the queries of :mod:`.store` are built from them).

A job row holds the job's wire form (the request body that ``POST /v1/jobs`` or ``/v1/sessions`` would
take, or a file beside the database when large), its serving envelope (owner, time limit), its state
machine (``queued`` → ``running`` → ``succeeded`` / ``failed`` / ``cancelled``), the lease of the server
that runs it, and its result (inline when small, else files: :mod:`.results`). Changes to these tables are
Alembic migrations (:mod:`.migrations`); this module describes the newest revision.

Times are Unix seconds (floats) on the database's clock (:meth:`.store.JobStore.now`: the server's clock
corrected by the offset it measured), so that replicas agree on when a lease runs out.
"""

from __future__ import annotations

import sqlalchemy as sa

metadata = sa.MetaData()

#: the states of a job; the last three are final
QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = "queued", "running", "succeeded", "failed", "cancelled"
FINAL = (SUCCEEDED, FAILED, CANCELLED)

jobs = sa.Table(
    "asyncinterp_jobs", metadata,
    sa.Column("id", sa.String(64), primary_key=True),
    sa.Column("owner", sa.String(64), nullable=False),          # sha256 of the submitting API key ("" without keys)
    sa.Column("kind", sa.String(32), nullable=False),           # trace, generate, session (or a registered kind)
    sa.Column("returns", sa.String(16), nullable=False, server_default=""),   # how the client shapes the result
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("request", sa.LargeBinary, nullable=True),         # the wire form, when small
    sa.Column("request_path", sa.String(255), nullable=True),    # else its file under the state directory
    sa.Column("timeout", sa.Float, nullable=False),
    sa.Column("meta", sa.JSON, nullable=True),                   # progress totals, the client's label
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("started_at", sa.Float, nullable=True),
    sa.Column("finished_at", sa.Float, nullable=True),
    sa.Column("expires_at", sa.Float, nullable=True),
    sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
    sa.Column("restarts", sa.JSON, nullable=True),               # one note per run that did not finish
    sa.Column("lease_owner", sa.String(64), nullable=True),
    sa.Column("lease_until", sa.Float, nullable=True),
    sa.Column("cancel_requested", sa.Boolean, nullable=False, server_default=sa.false()),
    sa.Column("progress", sa.JSON, nullable=True),
    sa.Column("status_code", sa.Integer, nullable=True),         # the HTTP status the blocking request would have had
    sa.Column("error", sa.JSON, nullable=True),                  # the error map (serve/errors.py) of a failed job
    sa.Column("result_json", sa.Text, nullable=True),            # a small result: its JSON ...
    sa.Column("result_tensors", sa.LargeBinary, nullable=True),  # ... and its tensors (safetensors bytes)
    sa.Column("result_path", sa.String(255), nullable=True),     # a large one: files (stem) under the state directory
    sa.Column("result_bytes", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("compute_seconds", sa.Float, nullable=False, server_default="0"),
    sa.Index("ix_asyncinterp_jobs_state_created", "state", "created_at"),
    sa.Index("ix_asyncinterp_jobs_owner_created", "owner", "created_at"),
)
