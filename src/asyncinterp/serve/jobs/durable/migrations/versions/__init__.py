"""Alembic revisions of the job store, oldest first (``down_revision`` links them)."""
