"""Who is asking: the owner id of a request's API key, whether it is an admin key, and OpenAI-shaped refusals.

Why this module exists: files, batches and runtime edits belong to (or are
reserved for) API keys. The server checks the key (``Server.check_key``);
this module names its owner (:func:`~.records.owner_of`: a hash, never the
key) and answers "not found" for what another key owns, so that no answer
confirms that someone else's file or batch exists.
"""

from __future__ import annotations

import hmac

from starlette.responses import JSONResponse

from .. import errors, openai_compat
from ..errors import RequestFailed
from .records import owner_of

__all__ = ["caller", "is_admin", "not_found", "openai_error", "require_admin"]


def request_key(request) -> str | None:
    """The API key a request carries (``X-API-Key`` or ``Authorization: Bearer``), if any."""
    got = request.headers.get("x-api-key")
    if got is None:
        auth = request.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            got = auth[7:].strip()
    return got or None


def caller(server, request) -> str:
    """The owner id of the (already checked) request: its key's hash, or ``anonymous`` on a server without keys."""
    return owner_of(request_key(request) if server.api_keys else None)


def is_admin(server, request) -> bool:
    key = request_key(request)
    if not key:
        return False
    given = key.encode("utf-8", "replace")
    return any(hmac.compare_digest(given, k) for k in server.admin_keys)


def require_admin(server, request, what: str) -> None:
    """Refuse (403) a request without one of the server's admin keys."""
    if not server.admin_keys:
        raise RequestFailed("forbidden", f"{what} needs an admin key, and this server has none: start it with "
                                         "--admin-key KEY (or $ASYNCINTERP_ADMIN_KEYS)")
    if not is_admin(server, request):
        raise RequestFailed("forbidden", f"{what} needs an admin key (--admin-key); this key is not one")


def not_found(kind: str, rid) -> RequestFailed:
    """The answer for an id that does not exist or belongs to another key (the two are not told apart)."""
    return RequestFailed("not_found", f"no {kind} with id {str(rid)[:80]!r}")


def openai_error(fail: RequestFailed) -> JSONResponse:
    """A failure in OpenAI's error shape (the ``openai`` client raises the matching ``APIStatusError``)."""
    return JSONResponse(openai_compat.error_body(fail.status, fail.error, fail.param), fail.status,
                        errors.openai_headers(fail.status, fail.headers))
