"""Alembic's migration scripts of the job store (run programmatically at start: :func:`upgrade`).

Why programmatic: a server upgrades its own store when it opens it (``asyncinterp serve --state-dir``),
with nothing for the user to run; replicas that start together race harmlessly (the loser retries and
finds the schema at head). A new table or column is a new file in ``scripts/versions/`` whose
``down_revision`` is the current head.
"""

from __future__ import annotations

import pathlib

from alembic import command
from alembic.config import Config

# Alembic's scripts (env.py, versions/): files Alembic runs, not modules of the package (no __init__.py)
HERE = pathlib.Path(__file__).resolve().parent / "scripts"


def config(connection) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.attributes["connection"] = connection
    return cfg


def upgrade(connection, revision: str = "head") -> None:
    """Bring the store on ``connection`` (a synchronous SQLAlchemy connection) to ``revision``."""
    command.upgrade(config(connection), revision)


def current(connection) -> str | None:
    """The store's revision (``None``: empty)."""
    from alembic.runtime.migration import MigrationContext
    return MigrationContext.configure(connection).get_current_revision()


def head() -> str:
    """The newest revision of the scripts (what :func:`upgrade` brings a store to)."""
    from alembic.script import ScriptDirectory
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    return ScriptDirectory.from_config(cfg).get_current_head()
