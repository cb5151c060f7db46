"""Nothing lost, nothing answered twice: 1,000 mixed jobs through three ``kill -9`` of a real server.

``JOBS`` (1,000; ``ASYNCINTERP_FAULT_JOBS`` changes it) mixed jobs go into ``asyncinterp serve tiny-gpt2
--state-dir`` while a submitter keeps sending: kept traces, generations and sessions (12 distinct jobs,
each submitted many times) and, spread among them, OpenAI batches (one fifth of the jobs are batch lines:
25 lines a batch, completions of a plain model and of a named edit) uploaded and created with the stock
``openai`` client. Three times, at random moments spread over the run (the second while a batch runs),
the server is killed with SIGKILL and restarted on the same state directory. Then:

* 0 lost: every job the server accepted (every 202, and every row of the store: the admin's list) ends,
  succeeded; every batch (every one the admin lists) completed, with every line answered;
* 0 answered twice: no job's outcome is written twice (the runner's log of written outcomes, over all
  four lives of the server), every batch line is in its output file exactly once, and the jobs that were
  running at a kill record their restart;
* every result equals the same job run alone (blocking, one at a time, on the restarted server),
  bit-equal: ``--exact`` batching, one BLAS thread and ``MKL_CBWR=AUTO,STRICT`` (docs/serving.md); a
  batch line's answer equals the synchronous answer to its request (all but its id and creation time).
  The lines ask for no logprobs: logprobs of requests that share a forward pass differ in their last
  bits on CPU (docs/jobs.md), and ``tests/test_serve_batches_restart.py`` checks them bit-equal with
  ``--max-batch 1``.
"""

import collections
import json
import os
import random
import threading
import time

import httpx
import openai
import pytest
import torch

import asyncinterp as ai
from asyncinterp.client.wire import RemoteError
from batch_helpers import FINAL, comparable as comparable_body, jsonl, line, read_lines
from jobs_helpers import JobServer, long_session

pytestmark = pytest.mark.slow

KEY, ADMIN = "fault-key", "fault-admin"
JOBS = int(os.environ.get("ASYNCINTERP_FAULT_JOBS", "1000"))
LINES_PER_BATCH = 25
BATCHES = max(1, JOBS // 5 // LINES_PER_BATCH)          # 1,000 jobs: 8 batches, 200 lines, 800 kept jobs
KEPT = JOBS - BATCHES * LINES_PER_BATCH
PROMPTS = ["The Eiffel Tower is in", "Once upon a time there was", "A B C D", "The capital of Italy is the city of"]
EDIT = "calm=ablate:module=transformer.h.0.mlp"
LINE_BODIES = [{"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0}
               for model, prompt, n in [("tiny-gpt2", "The quick brown fox jumps over", 5),
                                        ("tiny-gpt2:calm", "One two three four five six", 4),
                                        ("tiny-gpt2", "Paris is the capital of France and", 3),
                                        ("tiny-gpt2:calm", "The Eiffel Tower is in the city of", 6),
                                        ("tiny-gpt2", "A B C D E F G", 2)]]


async def layer0(m):
    return (await m.transformer.h[0].output)[0][:, -1]


async def layer1(m):
    return (await m.transformer.h[1].output)[0].sum(-1)


async def sweep(model):
    a = await model.atrace("The Eiffel Tower is in", layer1)
    b = await model.atrace("The Colosseum is in", layer1)
    return {"diff": a[..., :3] - b[..., :3], "a": a}


async def sweep2(model):
    g = await model.agenerate("Once upon a time", layer0, max_new_tokens=3)
    return [g.tokens, g.text]


TEMPLATES = [("trace", p, fn) for p in PROMPTS for fn in (layer0, layer1)] + [
    ("generate", "Once upon a time", None), ("generate", "The Eiffel Tower is in", layer0),
    ("session", sweep, None), ("session", sweep2, None)]


def submit(lm, template, blocking=False):
    kind, x, fn = template
    if kind == "trace":
        return lm.trace(x, fn, blocking=blocking)
    if kind == "generate":
        return lm.generate(x, *([fn] if fn else []), max_new_tokens=6, blocking=blocking)
    return lm.session(x, blocking=blocking)


def comparable(kind, value):
    if kind == "generate":
        return [value.tokens, value.text, value.result]
    return value


def equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    return a == b


def batch_lines(b):
    """Batch ``b``'s request lines: the distinct bodies in turn, each line with its own custom_id."""
    return [line(f"b{b}-{i}", "/v1/completions", LINE_BODIES[(b + i) % len(LINE_BODIES)])
            for i in range(LINES_PER_BATCH)]


def schedule():
    """What the submitter sends, in order: kept jobs (a template's index) with the batches (``("batch", b)``)
    spread among them."""
    out = [i % len(TEMPLATES) for i in range(KEPT)]
    for b in reversed(range(BATCHES)):
        out.insert(round((b + 0.5) * KEPT / BATCHES), ("batch", b))
    return out


def running(srv, admin, kind=None):
    rows = httpx.get(f"{srv.url}/v1/jobs?state=running&limit=100", headers=admin, timeout=10).json()["data"]
    return [r for r in rows if kind is None or r["kind"] == kind]


def test_three_sigkills_lose_nothing_and_answer_once(tmp_path):
    log = tmp_path / "server.log"
    srv = JobServer("--api-key", KEY, "--admin-key", ADMIN, "--allow-code", "--isolation", "thread", "--exact",
                    "--deterministic", "--edit", EDIT, "--job-lease", "2", "--job-max-attempts", "10",
                    "--job-concurrency", "8", "--quota-queued", "100000", "--quota-running", "8", "--log-level",
                    "info", "--timeout", "60", state_dir=tmp_path / "state", log=log)
    srv.start()
    lm = ai.remote(srv.url, api_key=KEY, timeout=60)
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    plan = schedule()
    accepted, batches = {}, {}      # kept job id -> template index; batch id -> batch number
    sent = [0]                      # items of the plan sent (and accepted) so far
    rng = random.Random(31)
    done = threading.Event()
    t0 = time.monotonic()
    down = (RemoteError, httpx.HTTPError, OSError, openai.APIConnectionError, openai.InternalServerError)

    def submitter():
        upload = None
        while sent[0] < len(plan):
            item = plan[sent[0]]
            try:
                if isinstance(item, tuple):
                    if upload is None:
                        upload = oai.files.create(file=(f"b{item[1]}.jsonl", jsonl(batch_lines(item[1]))),
                                                  purpose="batch").id
                    b = oai.batches.create(input_file_id=upload, endpoint="/v1/completions", completion_window="24h")
                    batches[b.id], upload = item[1], None
                else:
                    accepted[submit(lm, TEMPLATES[item]).id] = item
            except down:
                time.sleep(0.1)       # the server is down (killed): send this one again after its restart
                continue
            sent[0] += 1
        done.set()

    thread = threading.Thread(target=submitter, daemon=True)
    thread.start()
    admin = {"authorization": f"Bearer {ADMIN}"}
    kills = []
    try:
        for k, (lo, hi) in enumerate([(0.05, 0.3), (0.4, 0.6), (0.7, 0.9)]):
            at = rng.uniform(lo, hi) * len(plan)          # a random moment of the run: after that many submissions
            deadline = time.monotonic() + 300
            while sent[0] < at:
                assert time.monotonic() < deadline and thread.is_alive(), f"the submitter stalled at {sent[0]}"
                time.sleep(0.02)
            kind = "batch" if k == 1 else None            # the second kill hits a running batch
            deadline = time.monotonic() + 120
            while not running(srv, admin, kind):
                assert time.monotonic() < deadline, f"no {kind or 'job'} ever ran"
                time.sleep(0.02)
            time.sleep(rng.uniform(0.0, 0.3))
            kills.append((sent[0], [r["kind"] for r in running(srv, admin)]))
            srv.kill()
            time.sleep(rng.uniform(0.1, 1.0))
            srv.start()
        assert done.wait(600), f"only {sent[0]} of {len(plan)} jobs and batches were accepted"
        thread.join(10)
        handles = {jid: lm.job(jid) for jid in accepted}
        for h in handles.values():
            assert h.wait(timeout=300, progress=False).state == "succeeded", h.status()
        ended = {}
        for bid in batches:
            deadline = time.monotonic() + 300
            while (b := oai.batches.retrieve(bid)).status not in FINAL:
                assert time.monotonic() < deadline, f"batch {bid} still {b.status}: {b.request_counts}"
                time.sleep(0.05)
            ended[bid] = b
        elapsed = time.monotonic() - t0
        outputs = {bid: read_lines(oai, b.output_file_id) for bid, b in ended.items()}
        # the same jobs run alone, one at a time, blocking, on the server as it is now
        reference = [comparable(t[0], submit(lm, t, blocking=True)) for t in TEMPLATES]
        wrong = [jid for jid, k in accepted.items()
                 if not equal(comparable(TEMPLATES[k][0], handles[jid].result(timeout=60)), reference[k])]
        sync = [httpx.post(f"{srv.url}/v1/completions", json=body, headers={"authorization": f"Bearer {KEY}"},
                           timeout=60).json() for body in LINE_BODIES]
        # every row the store holds (accepted with a lost 202 included) ended, succeeded; every batch completed
        rows, after = [], None
        while True:
            page = httpx.get(f"{srv.url}/v1/jobs?limit=100" + (f"&after={after}" if after else ""), headers=admin,
                             timeout=30).json()
            rows += page["data"]
            after = page["next"]
            if not after:
                break
        listed = httpx.get(f"{srv.url}/v1/batches?limit=10000", headers=admin, timeout=30).json()["data"]
    finally:
        srv.stop()
        oai.close()
    assert not wrong, f"{len(wrong)} results differ from the same job run alone"
    assert {r["state"] for r in rows} == {"succeeded"}, collections.Counter(r["state"] for r in rows)
    assert set(accepted) <= {r["id"] for r in rows}
    assert len(rows) == len(set(r["id"] for r in rows)) >= KEPT + BATCHES
    assert {b["status"] for b in listed} == {"completed"} and set(batches) <= {b["id"] for b in listed}
    lines_checked = 0
    for bid, n in batches.items():
        b, want = ended[bid], batch_lines(n)
        assert (b.status, b.request_counts.total, b.request_counts.completed, b.request_counts.failed,
                b.error_file_id) == ("completed", LINES_PER_BATCH, LINES_PER_BATCH, 0, None), b
        got = outputs[bid]
        assert [x["custom_id"] for x in got] == [x["custom_id"] for x in want]        # each line once, none lost
        for x, answer in zip(want, got):
            assert answer["response"]["status_code"] == 200, answer
            ref = sync[LINE_BODIES.index(x["body"])]
            assert comparable_body(answer["response"]["body"]) == comparable_body(ref), (bid, x["custom_id"])
            lines_checked += 1
    written = collections.Counter()
    for entry in log.read_text(errors="replace").splitlines():
        try:
            rec = json.loads(entry)
        except ValueError:
            continue       # a line cut by a kill
        if rec.get("msg") == "job ended" and rec.get("written"):
            written[rec["job"]] += 1
    twice = [jid for jid, n in written.items() if n > 1]
    assert not twice, f"answered twice: {twice[:5]}"
    restarted = [r for r in rows if r["restarts"]]
    assert restarted, "no job was running at any of the three kills"
    assert any(r["kind"] == "batch" for r in restarted), f"no batch ran again after a kill: {kills}"
    assert all(r["attempts"] == len(r["restarts"]) + 1 for r in rows)
    print(f"\n{len(accepted)} kept jobs + {lines_checked} batch lines ({len(batches)} batches) = "
          f"{len(accepted) + lines_checked} jobs accepted ({len(rows)} rows in the store), 3 SIGKILLs after "
          f"{[k[0] for k in kills]} submissions (running then: {[collections.Counter(k[1]) for k in kills]}), "
          f"{len(restarted)} jobs ran again after a kill ({sum(r['kind'] == 'batch' for r in restarted)} batches), "
          f"0 lost, 0 answered twice, all equal to solo runs; {elapsed:.1f} s ({srv.starts} server starts)")


def test_a_clean_stop_gives_running_jobs_back_at_once(tmp_path):
    # Ctrl-C (SIGINT) stops the server cleanly: its running job is given back to the queue, so the restarted
    # server runs it again at once, not after its lease (60 s here) runs out
    srv = JobServer("--api-key", KEY, "--allow-code", "--isolation", "thread", "--job-lease", "60", "--timeout", "120",
                    state_dir=tmp_path / "state")
    srv.start()
    try:
        lm = ai.remote(srv.url, api_key=KEY)
        job = lm.session(long_session, blocking=False)
        deadline = time.monotonic() + 60
        while job.status().state != "running":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        srv.stop()
        srv.start()
        st = job.wait(timeout=40)
        assert st.state == "succeeded" and st.attempts == 2 and len(st.restarts) == 1, st.info
        assert torch.equal(job.result(), lm.session(long_session))
    finally:
        srv.stop()
