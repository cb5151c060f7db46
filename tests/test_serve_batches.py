"""OpenAI's Batch and Files API through the stock ``openai`` client, against a real server subprocess.

One ``asyncinterp serve`` of the tiny GPT-2 (with a chat template) for the module (two API keys, an admin key, a named edit, a state
directory, deterministic settings). A 100-line completions batch and a chat batch mix plain requests, a
named edit chosen by model name, logprobs, the ``asyncinterp`` extension field and requests the server
refuses; every output line must equal the synchronous answer to the same request (all but its id and
creation time), and every refusal must be the synchronous refusal, in the error file. Then: validation
failures, cancel, expiry, and ownership (another key gets 404 for files and batches).
"""

import json

import openai
import pytest

from batch_helpers import EXACT, CliServer, chat_gpt2_dir, comparable, jsonl, line, read_lines, sync_answer, wait_batch
from serve_helpers import one_thread  # noqa: F401 - fixtures are found by name

MODEL = "tiny-gpt2"
KEY, OTHER, ADMIN = "batch-key-1", "batch-key-2", "batch-admin"
EDIT = f"{MODEL}:calm"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = CliServer(chat_gpt2_dir(tmp_path_factory.mktemp("model")),
                  ["--served-model-name", MODEL, "--api-key", KEY, "--api-key", OTHER, "--admin-key", ADMIN,
                   "--edit", "calm=ablate:module=transformer.h.0.mlp", *EXACT],
                  tmp_path_factory.mktemp("state"))
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    with server.client(KEY) as c:
        yield c


def completion_lines(n=100):
    out = []
    for i in range(n):
        body = {"model": MODEL, "prompt": f"Request number {i} says", "max_tokens": 6, "temperature": 0}
        kind = i % 5
        if kind == 1:
            body["model"] = EDIT                                          # a named edit, by model name
        elif kind == 2:
            body["logprobs"] = 3
        elif kind == 3:
            body["asyncinterp"] = {"intervention": "top_k", "params": {"k": 3}}   # the extension field
        elif kind == 4:
            body.update(model=EDIT, logprobs=2)
        out.append(line(f"c-{i}", "/v1/completions", body))
    out[17]["body"]["frequency"] = 1              # an unknown field: the synchronous endpoint's 400
    out[42]["body"]["model"] = f"{MODEL}:nope"    # an unknown edit: its 404
    return out


def check_against_sync(server, lines, output, errors):
    answered = {x["custom_id"]: x for x in output + errors}
    assert sorted(answered) == sorted(x["custom_id"] for x in lines)          # each line once
    assert len(output) + len(errors) == len(lines)
    for x in lines:
        got = answered[x["custom_id"]]
        status, body = sync_answer(server, KEY, x["url"], x["body"])
        assert got["error"] is None and got["response"]["status_code"] == status, (x, got)
        assert got["id"].startswith("batch_req_") and got["response"]["request_id"].startswith("req_")
        assert comparable(got["response"]["body"]) == comparable(body), x["custom_id"]
        assert (got in output) == (status == 200)


def test_a_100_line_batch_answers_each_line_as_the_synchronous_endpoint(server, client):
    lines = completion_lines()
    f = client.files.create(file=("requests.jsonl", jsonl(lines)), purpose="batch")
    assert (f.object, f.purpose, f.bytes, f.filename) == ("file", "batch", len(jsonl(lines)), "requests.jsonl")
    assert client.files.content(f.id).content == jsonl(lines)
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h",
                              metadata={"run": "test"})
    assert b.status == "validating" and b.metadata == {"run": "test"}
    b = wait_batch(client, b.id)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (100, 98, 2)
    assert b.created_at <= b.in_progress_at <= b.finalizing_at <= b.completed_at
    output, errors = read_lines(client, b.output_file_id), read_lines(client, b.error_file_id)
    assert [x["custom_id"] for x in output] == [x["custom_id"] for x in lines if x["custom_id"] not in
                                                 ("c-17", "c-42")]              # written in input order
    assert {x["custom_id"]: x["response"]["status_code"] for x in errors} == {"c-17": 400, "c-42": 404}
    check_against_sync(server, lines, output, errors)
    # OpenAI's usage (the answered lines' tokens, each equal to its synchronous answer's) and model
    used = [x["response"]["body"]["usage"] for x in output]
    assert b.usage.input_tokens == sum(u["prompt_tokens"] for u in used) > 0
    assert b.usage.output_tokens == sum(u["completion_tokens"] for u in used) == 6 * 98
    assert b.usage.total_tokens == b.usage.input_tokens + b.usage.output_tokens
    assert (b.usage.input_tokens_details.cached_tokens, b.usage.output_tokens_details.reasoning_tokens) == (0, 0)
    assert b.model == f"{MODEL},{EDIT},{MODEL}:nope"          # the models its lines name, in order of first use
    first = {x["custom_id"]: x["response"]["body"] for x in output}
    assert first["c-2"]["choices"][0]["logprobs"]["top_logprobs"]           # logprobs came through
    assert first["c-3"]["asyncinterp"]["result"]["ids"]                     # and the intervention's result
    assert first["c-1"]["model"] == EDIT and first["c-1"]["choices"] != first["c-0"]["choices"] or \
        first["c-1"]["choices"][0]["text"] != first["c-6"]["choices"][0]["text"]
    assert client.files.retrieve(b.output_file_id).purpose == "batch_output"


def test_a_chat_batch_with_an_edit_and_logprobs(server, client):
    lines = []
    for i in range(12):
        body = {"model": EDIT if i % 2 else MODEL, "messages": [{"role": "user", "content": f"Say {i}"}],
                "max_tokens": 5, "temperature": 0}
        if i % 3 == 0:
            body.update(logprobs=True, top_logprobs=2)
        lines.append(line(f"chat-{i}", "/v1/chat/completions", body))
    lines[5]["body"]["stream"] = True              # batches have no streams: refused per line, clearly
    f = client.files.create(file=("chat.jsonl", jsonl(lines)), purpose="batch")
    b = wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                 completion_window="24h").id)
    assert b.status == "completed" and (b.request_counts.completed, b.request_counts.failed) == (11, 1)
    output, errors = read_lines(client, b.output_file_id), read_lines(client, b.error_file_id)
    assert [e["custom_id"] for e in errors] == ["chat-5"]
    assert "stream" in errors[0]["response"]["body"]["error"]["message"]
    del lines[5]
    check_against_sync(server, lines, output, [])
    assert b.model == f"{MODEL},{EDIT}"
    assert b.usage.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in output) > 0
    assert output[0]["response"]["body"]["choices"][0]["logprobs"]["content"][0]["top_logprobs"]


def test_a_file_with_bad_lines_fails_validation_naming_each_line(client):
    good = line("a", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})
    bad = [good, dict(good), line("b", "/v1/chat/completions", good["body"]), {**good, "custom_id": "c",
                                                                                 "method": "GET"}]
    f = client.files.create(file=("bad.jsonl", jsonl(bad)), purpose="batch")
    b = wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                 completion_window="24h").id)
    assert b.status == "failed" and b.failed_at and b.output_file_id is None
    assert [(e.line, e.code) for e in b.errors.data] == [(2, "duplicate_custom_id"), (3, "mismatched_endpoint"),
                                                        (4, "invalid_method")]
    with pytest.raises(openai.BadRequestError, match="line 1 is not valid JSON"):
        client.files.create(file=("x.jsonl", b"not json\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="line 2 is a JSON list, not an object"):
        client.files.create(file=("x.jsonl", jsonl([good]) + b"[1, 2]\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=("x.jsonl", jsonl([good])), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="48h")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")


def slow_lines(n, prefix):
    return [line(f"{prefix}-{i}", "/v1/completions", {"model": MODEL, "prompt": f"Slow request {i} goes",
                                                      "max_tokens": 100, "temperature": 0}) for i in range(n)]


def test_cancel_keeps_what_was_answered_and_lists_the_rest(client):
    lines = slow_lines(200, "s")
    f = client.files.create(file=("slow.jsonl", jsonl(lines)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    wait_batch(client, b.id, until=("in_progress",))
    b = client.batches.cancel(b.id)
    assert b.status in ("cancelling", "cancelled") and b.cancelling_at
    b = wait_batch(client, b.id)
    assert b.status == "cancelled" and b.cancelled_at
    output, errors = read_lines(client, b.output_file_id), read_lines(client, b.error_file_id)
    assert b.request_counts.completed == len(output) < 200 and b.request_counts.failed == len(errors)
    assert sorted(x["custom_id"] for x in output + errors) == sorted(x["custom_id"] for x in lines)
    skipped = [e for e in errors if e["error"]]
    assert skipped and all(e["error"]["code"] == "batch_cancelled" and e["response"] is None for e in skipped)
    assert client.batches.cancel(b.id).status == "cancelled"         # again: nothing changes


def test_a_batch_ends_with_its_kept_job(server, client):
    f = client.files.create(file=("slow2.jsonl", jsonl(slow_lines(100, "j"))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    job = b.model_extra["asyncinterp"]["job"]
    assert client.get(f"/jobs/{job}", cast_to=object)["kind"] == "batch"        # a batch is a kept job
    wait_batch(client, b.id, until=("in_progress",))
    client.delete(f"/jobs/{job}", cast_to=object)                                # stopped as a job
    b = wait_batch(client, b.id)
    assert b.status == "cancelled" and b.cancelled_at


def test_a_batch_past_its_window_expires(client):
    lines = slow_lines(200, "e")
    f = client.files.create(file=("late.jsonl", jsonl(lines)), purpose="batch")
    b = wait_batch(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                 completion_window="1s").id)
    assert b.status == "expired" and b.expired_at
    errors = read_lines(client, b.error_file_id)
    late = [e for e in errors if e["error"]]
    assert late and all(e["error"]["code"] == "batch_expired" for e in late)
    assert b.request_counts.completed + b.request_counts.failed == 200


def test_files_and_batches_belong_to_their_key(server, client):
    f = client.files.create(file=("mine.jsonl", jsonl(completion_lines()[:2])), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    with server.client(OTHER) as other:
        for call in (lambda: other.files.retrieve(f.id), lambda: other.files.content(f.id),
                     lambda: other.files.delete(f.id), lambda: other.batches.retrieve(b.id),
                     lambda: other.batches.cancel(b.id),
                     lambda: other.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                  completion_window="24h")):
            with pytest.raises(openai.NotFoundError):
                call()
        assert f.id not in [x.id for x in other.files.list()]
        assert b.id not in [x.id for x in other.batches.list()]
    with server.client(ADMIN) as admin:                 # an admin lists every key's batches
        assert b.id in [x.id for x in admin.batches.list(limit=100)]
    with server.client("not-a-key") as stranger, pytest.raises(openai.AuthenticationError):
        stranger.batches.list()
    assert b.id in [x.id for x in client.batches.list(limit=100)]
    wait_batch(client, b.id)
    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)
    assert client.batches.retrieve(b.id).status == "completed"     # a batch keeps its own copy of its input
    with pytest.raises(openai.ConflictError, match="completed"):
        client.batches.cancel(b.id)
    json.dumps(client.batches.retrieve(b.id).model_dump())
