"""The two errors submitted code meets, and the user's line they name.

:class:`SandboxRefused` is what every check of the package raises (HTTP 400
before running, 422 while running); :class:`SandboxTimeout` is what the tick
raises when a request's time is up. Both name the line of submitted code.
"""

from __future__ import annotations

import sys


class SandboxRefused(ValueError):
    """Submitted source was refused before running (the reason names the line)."""


class SandboxTimeout(BaseException):
    """Raised inside submitted code when its request's deadline passed or it was cancelled.

    A ``BaseException`` so that ``except Exception`` in the submitted code
    does not swallow it; the tick raises again at the next loop iteration or
    call anyway.
    """


SUBMITTED_PREFIX = "<submitted:"    # the file name of compiled submitted code starts with this


def user_line() -> str:
    """``line N`` of the innermost frame of submitted code on the stack (for error messages)."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_filename.startswith(SUBMITTED_PREFIX):
            return f"line {f.f_lineno}"
        f = f.f_back
    return "an unknown line"


def refuse(what: str, why: str = "") -> SandboxRefused:
    """The error for something submitted code may not do, naming its line (raise it)."""
    return SandboxRefused(f"{what} is not available to submitted code ({user_line()})" + (f": {why}" if why else ""))
