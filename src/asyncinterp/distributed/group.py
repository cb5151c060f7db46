"""The process group of a tensor-parallel launch, and how its ranks agree on how a run ended.

Every rank runs the same interventions on the same (gathered) values, so a
run normally ends the same way everywhere. When it does not (an exception on
one rank only: a file missing on one node, a rank-dependent bug), the others
would wait in their next collective. Two things keep that from hanging or
passing silently:

* the process group has a timeout (:func:`init`, ``timeout`` seconds): a
  collective that a failed rank never joins raises instead of waiting forever
  (and it raises at once when the failed rank's process has exited);
* after every run each rank posts how it ended (``"ok"`` or its error) to
  the group's key-value store (point to point, no collective that could pair
  with the wrong one) and reads the others' (:func:`agree`). A rank whose own
  intervention failed raises its own exception; any other rank raises
  :class:`RankFailedError` naming the failed rank(s) and their tracebacks. So
  an exception on any rank is a clear error on rank 0.

The store's values are UTF-8 text (no pickle).
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import torch.distributed as dist

from ..kernel.errors import AsyncInterpError

__all__ = ["RankFailedError", "init", "agree", "rank", "world_size", "timeout_s", "configured_timeout",
           "DEFAULT_TIMEOUT"]


def configured_timeout() -> float:
    """Seconds a collective may wait for another rank: ``ASYNCINTERP_TP_TIMEOUT`` as it is now, or 60.

    Read when needed, not at import: a Ray actor imports this module before its launch's environment is set.
    """
    return float(os.environ.get("ASYNCINTERP_TP_TIMEOUT", "60"))


#: seconds a collective (and the end-of-run agreement) may wait for another rank, as configured at import
DEFAULT_TIMEOUT = configured_timeout()

#: seconds the end-of-run agreement waits for the others' reports once a peer's process is known to be gone
PEER_GONE_WAIT = 2.0

_state = {"timeout": DEFAULT_TIMEOUT, "seq": 0}


class RankFailedError(AsyncInterpError):
    """Another rank of a tensor-parallel launch failed (or stopped answering); the message has its error."""

    def __init__(self, message, failures=None):
        super().__init__(message)
        self.failures = failures or {}     # rank -> the text it reported


def init(timeout: float | None = None, backend: str = "gloo") -> None:
    """Join the launch's process group (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` from the launcher).

    ``timeout``: seconds any collective may wait for another rank (default
    ``ASYNCINTERP_TP_TIMEOUT`` or 60). Idempotent: a group that is already
    initialised is used as it is (its own timeout then applies).
    """
    t = float(timeout if timeout is not None else configured_timeout())
    _state["timeout"] = t
    if dist.is_initialized():
        return
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"asyncinterp.distributed.init() needs {missing} in the environment: start the ranks with "
            "`python -m asyncinterp.distributed.launch --nproc 2 script.py` (or torchrun)")
    dist.init_process_group(backend, timeout=timedelta(seconds=t))


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def timeout_s() -> float:
    return _state["timeout"]


def store():
    """The process group's own key-value store (rendezvous), for messages that must not be collectives."""
    from torch.distributed import distributed_c10d
    return distributed_c10d._get_default_store()   # the group's own rendezvous store


def is_collective_error(exc) -> bool:
    """Whether ``exc`` is a failed collective (timeout, a peer gone) rather than an intervention's own error."""
    dist_error = getattr(dist, "DistError", ())
    if dist_error and isinstance(exc, dist_error):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(w in text for w in ("gloo", "Gloo", "Connection closed", "timed out",
                                                                      "Timed out", "peer"))


def peer_gone(exc) -> bool:
    """Whether ``exc`` is a collective that failed because another rank's process is gone (not a timeout)."""
    return any(w in str(exc) for w in ("Connection closed", "Connection reset", "Broken pipe"))


def describe(exc) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).strip()


def agree(error=None):
    """End of a run on every rank: post how it ended, read the others', raise if any rank failed.

    ``error``: this rank's exception (``None``: it ended well). Raises
    ``error`` itself when it is this rank's own failure, else
    :class:`RankFailedError` when another rank failed or did not report
    within the timeout.
    """
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return
    me, world = dist.get_rank(), dist.get_world_size()
    seq = _state["seq"] = _state["seq"] + 1
    kv = store()
    prefix = f"asyncinterp/run/{seq}/"
    kv.set(prefix + str(me), "ok" if error is None else f"rank {me}: " + describe(error))
    if seq > 2:
        try:
            kv.delete_key(f"asyncinterp/run/{seq - 2}/{me}")
        except Exception:  # noqa: BLE001 - cleanup only
            pass
    if error is not None and not is_collective_error(error):
        raise error          # this rank's own intervention failed: its own traceback says best
    keys = [prefix + str(r) for r in range(world)]
    # a peer's process gone (its connection closed): a rank that failed on its own posted before it went, so
    # its report is there already; one that was killed (its node lost) never reports: do not wait the timeout
    wait = min(_state["timeout"], PEER_GONE_WAIT) if error is not None and peer_gone(error) else _state["timeout"]
    try:
        kv.wait(keys, timedelta(seconds=wait))
    except Exception as exc:  # noqa: BLE001 - a rank that never reports (crashed, killed)
        gone = []
        for r in range(world):
            try:
                if not kv.check([keys[r]]):
                    gone.append(r)
            except Exception:  # noqa: BLE001
                gone.append(r)
        raise RankFailedError(
            f"rank(s) {gone} of the tensor-parallel launch did not report the end of run {seq} within "
            f"{wait:g} s (crashed, killed, or stuck)") from (error or exc)
    texts = {r: kv.get(keys[r]).decode("utf-8", "replace") for r in range(world)}
    failed = {r: t for r, t in texts.items() if t != "ok" and r != me}
    if failed:
        first = min(failed)
        raise RankFailedError(
            f"rank {first} of the tensor-parallel launch failed"
            + (f" (and ranks {sorted(failed)[1:]})" if len(failed) > 1 else "")
            + f"; its error:\n{failed[first]}", failed) from error
    if error is not None:
        raise error
