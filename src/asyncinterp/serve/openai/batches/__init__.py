"""OpenAI's Files and Batch API, and named edits registered at run time, on the kept-jobs store.

Why a sub-package: a batch is a kept job (kind ``batch``, :mod:`...jobs.durable`) whose lines are
answered by the server's own OpenAI endpoints; its files, its record, each answered line and the
runtime edits live in the same database as the jobs (:mod:`.tables`), so they survive a restart and,
with PostgreSQL, a replica's loss, like any job. docs/jobs.md ("The batch API against OpenAI's") and
docs/edits.md ("Edits registered at run time").

The server's app calls :func:`routes` (which also asks the kept-jobs service to install the stored
runtime edits once its store is open). SQLAlchemy (the ``jobs`` extra) loads only on a server that
keeps jobs: on any other, these routes answer a 400 that says how to turn them on.
"""

from __future__ import annotations

from starlette.routing import Route

__all__ = ["routes"]

PATHS = (("/v1/files", "POST"), ("/v1/files", "GET"), ("/v1/files/{file_id}", "GET"),
         ("/v1/files/{file_id}", "DELETE"), ("/v1/files/{file_id}/content", "GET"), ("/v1/batches", "POST"),
         ("/v1/batches", "GET"), ("/v1/batches/{batch_id}", "GET"), ("/v1/batches/{batch_id}/cancel", "POST"),
         ("/v1/edits", "POST"), ("/v1/edits", "GET"), ("/v1/edits/{name}", "DELETE"))


def routes(server) -> list:
    """The routes of files, batches and runtime edits on ``server`` (refusals when it keeps no jobs)."""
    if getattr(server, "durable", None) is None:
        from .access import openai_error, service

        async def refuse(request):
            async def work(fields):
                service(server)         # raises the 400 that says how to keep jobs
            return await server.guarded(request, "batches", work, openai_error)
        return [Route(path, refuse, methods=[method]) for path, method in PATHS]
    from . import access, api, edits, files
    server.durable.on_start.append(lambda: edits.load(server))    # the edits registered before a restart
    server.durable.on_close.append(lambda: edits.close(server))
    server.durable.sweeps.append(lambda: access.tables(server).expire_files())     # expired files
    return files.routes(server) + api.routes(server) + edits.routes(server)
