"""Per-key quotas of kept jobs: what one API key may hold of a shared server.

Why: a kept job costs the server after its request is gone (a queue slot, compute, disk for its result),
so one key must not be able to take it all. Four limits, each per key (``None``: none):

* ``queued``: jobs waiting to run; checked when a job is submitted;
* ``running``: jobs of the key running at once; a key's further jobs wait in the queue (the runner skips
  them, :meth:`~.store.JobStore.claim`), they are not refused;
* ``compute_seconds_per_hour``: seconds the key's jobs ran (wall clock, running ones included) in the
  last hour; checked when a job is submitted;
* ``result_bytes``: bytes of the results the key keeps (until they expire or are deleted); checked when
  a job is submitted.

Over a quota, the submission is refused with ``429``, a ``Retry-After`` (when the window, an expiry or
a running job is expected to free it) and a message naming the quota and its figures.
"""

from __future__ import annotations

import dataclasses
import math

from ..errors import RequestFailed

__all__ = ["Quotas", "check"]

HOUR = 3600.0


@dataclasses.dataclass(frozen=True)
class Quotas:
    queued: int | None = 100
    running: int | None = 4
    compute_seconds_per_hour: float | None = None
    result_bytes: int | None = 1 << 30


def _refuse(name, message, retry_after) -> RequestFailed:
    fail = RequestFailed("quota", f"quota {name} exceeded: {message}",
                         headers={"Retry-After": str(max(1, int(math.ceil(retry_after))))})
    fail.error["quota"] = name
    return fail


async def check(store, owner: str, quotas: Quotas, now: float | None = None) -> None:
    """Refuse (429) a new job of ``owner`` that a quota does not allow."""
    now = store.now() if now is None else now
    if quotas.queued is None and quotas.compute_seconds_per_hour is None and quotas.result_bytes is None:
        return
    usage = await store.usage(owner, now - HOUR, now)       # one query
    n = usage["queued"]
    if quotas.queued is not None and n >= quotas.queued:
        raise _refuse("queued", f"this key has {n} jobs queued, at most {quotas.queued}; wait for some to "
                                "start, or cancel some (DELETE /v1/jobs/ID)", 5)
    limit = quotas.compute_seconds_per_hour
    if limit is not None and usage["compute_seconds"] >= limit:
        oldest = usage["oldest_finished"]
        wait = (oldest + HOUR - now) if oldest is not None else 60
        raise _refuse("compute_seconds_per_hour", f"this key's jobs ran {usage['compute_seconds']:.1f} s in the "
                                                  f"last hour, at most {limit:g}", wait)
    limit = quotas.result_bytes
    if limit is not None and usage["result_bytes"] >= limit:
        expiry = usage["next_expiry"]
        raise _refuse("result_bytes", f"this key keeps {usage['result_bytes']} bytes of results, at most {limit}; "
                                      "fetch and delete some (DELETE /v1/jobs/ID)",
                      (expiry - now) if expiry is not None else 3600)
