"""Who sent a request: the owner on its submission's envelope and on a kept job, never the key itself.

An owner is the sha256 of the API key a request carries (``""`` on a server
without keys). The serving front records it on every submission
(:class:`~asyncinterp.serve.scheduling.submission.Envelope`), and the job
store keeps it with every kept job, file and batch, so that only its owner
sees them.
"""

from __future__ import annotations

import hashlib

__all__ = ["caller_key", "owner", "owner_of"]


def caller_key(request) -> str | None:
    """The API key a request carries (``Authorization: Bearer KEY`` or ``X-API-Key: KEY``)."""
    got = request.headers.get("x-api-key")
    if got is None:
        auth = request.headers.get("authorization", "")
        if auth[:7].lower() == "bearer ":
            got = auth[7:].strip()
    return got or None


def owner_of(api_key: str | None) -> str:
    """What is kept of an API key: its sha256 (hex), ``""`` for a server without keys."""
    return hashlib.sha256(api_key.encode("utf-8", "replace")).hexdigest() if api_key else ""


def owner(server, request) -> str:
    """The owner of ``request`` on ``server`` (checked already: its key is one of the server's)."""
    return owner_of(caller_key(request) if server.api_keys else None)
