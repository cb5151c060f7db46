"""Who may reach a server (loopback unless told otherwise) and how it logs what it was asked: one JSON line each.

Used by the app, by the command before it binds an address, and by every
serving process that sets up its log (:mod:`.startup`).
"""

from __future__ import annotations

import ipaddress
import json
import logging

__all__ = ["JsonFormatter", "is_loopback"]


def is_loopback(host: str) -> bool:
    """Whether ``host`` is ``localhost`` or a loopback IP address."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message and the record's ``fields``."""

    def format(self, record):
        out = {"ts": round(record.created, 3), "level": record.levelname.lower(), "logger": record.name,
               "msg": record.getMessage()}
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)
