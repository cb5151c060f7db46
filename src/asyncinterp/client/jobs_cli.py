"""``asyncinterp jobs list|status|result|cancel URL``: kept jobs from a shell (docs/jobs.md).

    asyncinterp jobs list http://127.0.0.1:8000 --api-key KEY            # newest first; --state, --limit
    asyncinterp jobs status http://127.0.0.1:8000 job_... [--follow]      # --follow: its event stream
    asyncinterp jobs result http://127.0.0.1:8000 job_... [--wait] [--out answer.msgpack]
    asyncinterp jobs cancel http://127.0.0.1:8000 job_...                 # a finished job: deleted

The API key comes from ``--api-key`` or ``$ASYNCINTERP_API_KEY``. Statuses print as JSON; a result prints
as Python would show it (``--out`` writes the answer's msgpack bytes, tensors included, as the server
sent them). A client command: it loads no server module.
"""

from __future__ import annotations

import json
import os
import sys
import time

__all__ = ["add_parser"]


def add_parser(subparsers):
    p = subparsers.add_parser("jobs", help="list, inspect, fetch or cancel kept jobs on a server",
                              description="Kept jobs (submitted with wait=false) of an asyncinterp server. "
                                          "See docs/jobs.md.")
    sub = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, help_ in (("list", "the key's jobs, newest first"), ("status", "a job's status"),
                        ("result", "a job's result"), ("cancel", "cancel a job (delete a finished one)")):
        q = sub.add_parser(name, help=help_)
        q.add_argument("url", metavar="URL", help="the server, e.g. http://127.0.0.1:8000")
        if name != "list":
            q.add_argument("job_id", metavar="ID")
        q.add_argument("--api-key", default=os.environ.get("ASYNCINTERP_API_KEY"), help="$ASYNCINTERP_API_KEY")
        q.add_argument("--timeout", type=float, default=30.0, help="seconds per request (default 30)")
        if name == "list":
            q.add_argument("--limit", type=int, default=20)
            q.add_argument("--state", choices=["queued", "running", "succeeded", "failed", "cancelled"])
        if name == "status":
            q.add_argument("--follow", action="store_true", help="print its events until it ends")
        if name == "result":
            q.add_argument("--wait", type=float, default=None, metavar="S",
                           help="wait up to S seconds for it to end (default: answer at once)")
            q.add_argument("--out", default=None, metavar="FILE", help="write the answer's msgpack bytes")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    import httpx
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.url.rstrip("/") + "/v1/jobs"
    try:
        with httpx.Client(headers=headers, timeout=args.timeout) as http:
            return _ACTIONS[args.action](http, base, args)
    except httpx.HTTPError as exc:
        print(f"asyncinterp jobs: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 1


def _fail(r) -> int:
    try:
        error = r.json().get("error") or {}
    except ValueError:
        from . import wire
        try:
            error = wire.unpackb(r.content).get("error") or {}
        except Exception:  # noqa: BLE001 - not an answer of ours
            error = {"message": r.text[:300]}
    print(f"asyncinterp jobs: HTTP {r.status_code}: {error.get('type', 'Error')}: {error.get('message')}",
          file=sys.stderr)
    return 1


def _list(http, base, args) -> int:
    r = http.get(base, params={"limit": args.limit, **({"state": args.state} if args.state else {})})
    if r.status_code != 200:
        return _fail(r)
    for job in r.json()["data"]:
        progress = f" {job['progress']}" if job.get("progress") else ""
        print(f"{job['id']}  {job['kind']:<9} {job['state']:<10} attempts={job['attempts']}{progress}")
    return 0


def _status(http, base, args) -> int:
    if not args.follow:
        r = http.get(f"{base}/{args.job_id}")
        if r.status_code != 200:
            return _fail(r)
        print(json.dumps(r.json(), indent=2))
        return 0
    with http.stream("GET", f"{base}/{args.job_id}/events", timeout=None) as r:
        if r.status_code != 200:
            r.read()
            return _fail(r)
        for line in r.iter_lines():
            if line.startswith("data: "):
                print(line[6:], flush=True)
    return 0


def _result(http, base, args) -> int:
    deadline = None if args.wait is None else time.monotonic() + args.wait
    while True:
        r = http.get(f"{base}/{args.job_id}/result")
        if r.status_code != 409 or deadline is None or time.monotonic() >= deadline:
            break
        time.sleep(0.5)
    if args.out:
        with open(args.out, "wb") as f:
            f.write(r.content)
    if r.status_code != 200:
        return _fail(r)
    from . import wire
    answer = wire.unpackb(r.content, wire.answer_limits(len(r.content)))
    if not args.out:
        print(answer.get("result") if "result" in answer else answer.get("results"))
    return 0


def _cancel(http, base, args) -> int:
    r = http.delete(f"{base}/{args.job_id}")
    if r.status_code != 200:
        return _fail(r)
    out = r.json()
    print("deleted" if out.get("deleted") else out["state"])
    return 0


_ACTIONS = {"list": _list, "status": _status, "result": _result, "cancel": _cancel}
