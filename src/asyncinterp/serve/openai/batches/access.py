"""Who is asking, and where the records are: the kept-jobs service's owner and admin checks, the tables.

Why this module exists: files, batches and runtime edits belong to (or are reserved for) API keys, as
kept jobs do, and live in the kept-jobs store. The server's kept-jobs service (``server.durable``,
:mod:`...jobs.durable.service`) names a request's owner (a hash of its key, never the key) and its admin keys;
this module asks it, refuses clearly on a server that keeps nothing, and answers "not found" for what
another key owns, so that no answer confirms that someone else's file or batch exists.
"""

from __future__ import annotations

from starlette.responses import JSONResponse

from ...jobs import errors
from ...jobs.errors import RequestFailed
from .. import openai_compat

__all__ = ["caller", "is_admin", "not_found", "openai_error", "require_admin", "tables"]


def service(server, what: str = "files and batches"):
    """The kept-jobs service of ``server`` with its store open (a 400 saying how to turn it on otherwise)."""
    durable = getattr(server, "durable", None)
    if durable is None:
        raise RequestFailed("request", f"this server keeps no {what}: start it with --state-dir DIR (or --database "
                                       "postgresql://...) to keep them (docs/jobs.md)")
    durable.ready()
    return durable


def tables(server, what: str = "files and batches"):
    """The :class:`~.tables.Tables` of the kept-jobs store (SQLAlchemy loads only on a server that keeps jobs)."""
    from .tables import Tables
    return Tables(service(server, what).store.engine)


def caller(server, request) -> str:
    """The owner id of the (already checked) request."""
    return service(server).owner(request)


def is_admin(server, request) -> bool:
    durable = getattr(server, "durable", None)
    return durable is not None and durable.is_admin(request)


def require_admin(server, request, what: str) -> None:
    """Refuse (403) a request without one of the server's admin keys."""
    durable = service(server, "runtime edits")
    if not durable.admin:
        raise RequestFailed("forbidden", f"{what} needs an admin key, and this server has none: start it with "
                                         "--admin-key KEY (or $ASYNCINTERP_ADMIN_KEYS)")
    if not durable.is_admin(request):
        raise RequestFailed("forbidden", f"{what} needs an admin key (--admin-key); this key is not one")


def not_found(kind: str, rid) -> RequestFailed:
    """The answer for an id that does not exist or belongs to another key (the two are not told apart)."""
    return RequestFailed("not_found", f"no {kind} with id {str(rid)[:80]!r}")


def openai_error(fail: RequestFailed) -> JSONResponse:
    """A failure in OpenAI's error shape (the ``openai`` client raises the matching ``APIStatusError``)."""
    return JSONResponse(openai_compat.error_body(fail.status, fail.error, fail.param), fail.status,
                        errors.openai_headers(fail.status, fail.headers))
