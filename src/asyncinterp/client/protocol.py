"""The remote protocol's version check: which client and server versions work together.

A remote job (``POST /v1/jobs``) carries the client's protocol number and its
asyncinterp and Python versions; the server answers ``GET /v1/model`` with
its own. Both sides run :func:`incompatible` so that a mismatch is one clear
error naming both pairs, on the client before anything is sent and on the
server for a client that did not check. The rule:

* the same :data:`PROTOCOL` (the layout of the request and the answer);
* the same asyncinterp release series (major.minor): captured descriptions
  and job formats may change between series;
* a client Python of 3.10 or later. Functions travel as source, never
  bytecode, so any such client works against any server; source that uses
  syntax the server's Python does not know is refused when it is rebuilt,
  with both versions named (:mod:`.rebuild`).
"""

from __future__ import annotations

import platform

__all__ = ["PROTOCOL", "VersionMismatch", "incompatible", "versions"]

#: the version of the remote job protocol (request envelope and answer layout)
PROTOCOL = 1
MIN_PYTHON = (3, 10)


class VersionMismatch(RuntimeError):
    """The client and the server cannot work together (the message names both versions)."""


def versions() -> dict:
    """This side's protocol number, asyncinterp version and Python version."""
    from .. import __version__
    return {"protocol": PROTOCOL, "asyncinterp": __version__, "python": platform.python_version()}


def _series(version) -> tuple | None:
    parts = str(version).split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return None


def incompatible(client: dict, server: dict) -> str | None:
    """Why ``client`` cannot talk to ``server`` (maps as :func:`versions` gives), or ``None`` if they can."""
    c_ai, c_py, c_proto = client.get("asyncinterp"), client.get("python"), client.get("protocol")
    s_ai, s_py, s_proto = server.get("asyncinterp"), server.get("python"), server.get("protocol")
    pair = (f"the client runs asyncinterp {str(c_ai)[:40]} on Python {str(c_py)[:40]} (protocol "
            f"{str(c_proto)[:10]}); the server runs asyncinterp {str(s_ai)[:40]} on Python {str(s_py)[:40]} "
            f"(protocol {str(s_proto)[:10]})")
    if c_proto != s_proto:
        return f"incompatible versions: {pair}. Install the server's asyncinterp version on the client"
    if _series(c_ai) is None or _series(c_ai) != _series(s_ai):
        return (f"incompatible versions: {pair}. Client and server need the same asyncinterp release series "
                f"({'.'.join(map(str, _series(s_ai) or ()))}.x): install it on the client")
    py = _series(c_py)
    if py is None or py < MIN_PYTHON:
        return (f"incompatible versions: {pair}. Clients need Python {MIN_PYTHON[0]}.{MIN_PYTHON[1]} or later")
    return None
