"""Alembic's environment: the connection comes from the caller (:func:`asyncinterp.serve.jobs.durable.migrations.upgrade`)."""

from alembic import context

from asyncinterp.serve.jobs.durable.schema import metadata

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=metadata)
with context.begin_transaction():
    context.run_migrations()
