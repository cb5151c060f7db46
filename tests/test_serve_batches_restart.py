"""A batch survives ``kill -9`` of its server: the stock ``openai`` client sees it finish after the restart.

A real ``asyncinterp serve`` subprocess on a state directory runs a 100-line batch (plain requests, a
named edit chosen by model name, logprobs). In the middle of it (some lines answered, most not) the
server is killed with SIGKILL and started again on the same state. The batch resumes by itself (its kept
job's lease runs out and the new server claims it); in the end every line is answered exactly once, and
each answer equals the synchronous answer to the same request.
"""

import time

import pytest

from batch_helpers import EXACT, CliServer, chat_gpt2_dir, comparable, jsonl, line, read_lines, sync_answer, \
    wait_batch
from serve_helpers import one_thread  # noqa: F401 - fixtures are found by name

MODEL, KEY = "tiny-gpt2", "restart-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = CliServer(chat_gpt2_dir(tmp_path_factory.mktemp("model")),
                  ["--served-model-name", MODEL, "--api-key", KEY, "--edit", "calm=ablate:module=transformer.h.0.mlp",
                   "--job-lease", "2", *EXACT], tmp_path_factory.mktemp("state"))
    s.start()
    yield s
    s.stop()


def test_a_batch_killed_mid_way_finishes_after_the_restart_with_each_line_once(server):
    lines = []
    for i in range(100):
        body = {"model": f"{MODEL}:calm" if i % 3 == 1 else MODEL, "prompt": f"Line {i} of the batch",
                "max_tokens": 12, "temperature": 0}
        if i % 3 == 2:
            body["logprobs"] = 2
        lines.append(line(f"r-{i}", "/v1/completions", body))
    client = server.client(KEY)
    f = client.files.create(file=("restart.jsonl", jsonl(lines)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 120
    while client.batches.retrieve(b.id).request_counts.completed < 10:
        assert time.monotonic() < deadline, "the batch did not start"
        time.sleep(0.02)
    server.kill()                                   # SIGKILL in the middle of the batch
    client.close()
    server.start()                                  # the same state directory and port
    client = server.client(KEY)
    before = client.batches.retrieve(b.id)
    assert before.status == "in_progress" and 10 <= before.request_counts.completed < 100, before
    b = wait_batch(client, b.id)
    assert b.status == "completed", b
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (100, 100, 0)
    assert b.model_extra["asyncinterp"]["restarts"] == 1          # the kept job records the restart
    output = read_lines(client, b.output_file_id)
    assert b.error_file_id is None
    assert [x["custom_id"] for x in output] == [x["custom_id"] for x in lines]   # each line once, none lost
    for x, got in zip(lines, output):
        status, body = sync_answer(server, KEY, x["url"], x["body"])
        assert status == 200 and got["response"]["status_code"] == 200
        assert comparable(got["response"]["body"]) == comparable(body), x["custom_id"]
    job = client.get(f"/jobs/{b.model_extra['asyncinterp']['job']}", cast_to=object)
    assert job["state"] == "succeeded" and len(job["restarts"]) == 1 and job["kind"] == "batch"
    client.close()
