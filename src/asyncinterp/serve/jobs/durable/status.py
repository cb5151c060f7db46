"""A kept job's status as the API answers it (JSON): state, progress, restarts, times, the error of a failure.

Why a module: ``GET /v1/jobs/ID``, the list, the event stream and the ``202`` of a submission all answer
the same map, and the client's handle reads it (docs/jobs.md lists the fields).
"""

from __future__ import annotations

__all__ = ["describe"]


def describe(row: dict) -> dict:
    """The public view of a job's row (never its owner, request or lease holder)."""
    out = {
        "id": row["id"], "object": "job", "kind": row["kind"], "state": row["state"],
        "returns": row.get("returns") or "", "created_at": row["created_at"], "started_at": row.get("started_at"),
        "finished_at": row.get("finished_at"), "expires_at": row.get("expires_at"),
        "attempts": row.get("attempts") or 0, "restarts": list(row.get("restarts") or []),
        "progress": row.get("progress"), "timeout": row.get("timeout"),
        "cancel_requested": bool(row.get("cancel_requested")) and row["state"] == "running",
        "result_bytes": row.get("result_bytes") or 0, "compute_seconds": row.get("compute_seconds") or 0.0,
        "label": (row.get("meta") or {}).get("label"),
    }
    if row.get("error") is not None:
        out["error"] = row["error"]
        out["status"] = row.get("status_code")
    return out
