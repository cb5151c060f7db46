"""Where a ``wait: false`` submission of ``POST /v1/jobs`` or ``POST /v1/sessions`` leaves its endpoint.

Why a module of its own: the two endpoints (:mod:`..jobs_api`, :mod:`..sessions`) hand such a body to the
server's kept-jobs service (:mod:`.service`) without importing it (nor SQLAlchemy) when jobs are not kept.
"""

from __future__ import annotations

from ..errors import RequestFailed

__all__ = ["submit_kept"]


async def submit_kept(server, request, obj: dict, fields: dict):
    """Keep the job and answer ``202`` (docs/jobs.md); a clear 400 when the server keeps no jobs."""
    durable = getattr(server, "durable", None)
    if durable is None:
        raise RequestFailed("request", "this server keeps no jobs: start it with --state-dir DIR (or --database "
                                       "URL) to submit with wait=false")
    return await durable.submit(request, obj, fields)
