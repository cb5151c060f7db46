"""A CLI server subprocess on a state directory (killed with SIGKILL and started again), and batch helpers.

Used by the batch and runtime-edit tests: they drive the server with the stock ``openai`` client only.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import httpx
import openai

from remote_helpers import free_port
from serve_helpers import wait_healthy

SRC = str(pathlib.Path(__file__).resolve().parent.parent / "src")
FINAL = ("completed", "failed", "cancelled", "expired")
# every request runs alone (a batch line as a synchronous request), deterministic BLAS, one thread: answers are
# bit-equal run to run. (Sharing a forward pass changes logits in their last bits on this CPU: MKL's kernels
# round differently for one row and for several; tokens stay the same.)
EXACT = ["--max-batch", "1", "--deterministic", "--threads", "1"]


class CliServer:
    """``asyncinterp serve MODEL ARGS --state-dir STATE`` on a free port; ``kill()`` is SIGKILL, ``start()`` again."""

    def __init__(self, model: str, args: list, state_dir):
        self.cmd = [sys.executable, "-m", "asyncinterp.serve.cli", model, *args, "--state-dir", str(state_dir)]
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        self.log_path = pathlib.Path(state_dir).with_name(pathlib.Path(state_dir).name + ".log")

    def start(self) -> "CliServer":
        """Start the server (its log goes to a file: a pipe nobody reads would fill and stall it)."""
        env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
        with open(self.log_path, "a") as log:
            self.proc = subprocess.Popen(self.cmd + ["--port", str(self.port)], stderr=log, text=True, env=env,
                                         start_new_session=True)
        try:
            wait_healthy(self.proc, self.url)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{self.log()[-3000:]}") from None
        return self

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def records(self) -> list:
        """The server's JSON log records (every start)."""
        return [json.loads(x) for x in self.log().splitlines() if x.startswith("{")]

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(20)

    def stop(self) -> None:
        """Stop as Ctrl-C does (killed if it outlives 20 s)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.kill()

    def client(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def chat_gpt2_dir(path) -> str:
    """The tiny GPT-2 saved as a model directory with a chat template."""
    from asyncinterp.models import tiny
    lm = tiny("gpt2")
    lm.module.save_pretrained(path)
    lm.tokenizer.chat_template = CHAT_TEMPLATE
    lm.tokenizer.save_pretrained(path)
    return str(path)


def jsonl(lines) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def line(custom_id: str, url: str, body: dict) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def wait_batch(client, batch_id: str, timeout: float = 300, until=FINAL):
    """Poll ``batches.retrieve`` until the batch's status is in ``until`` (fails after ``timeout`` s)."""
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in until:
            return b
        if time.monotonic() > deadline:
            raise AssertionError(f"batch {batch_id} still {b.status} after {timeout:g} s: {b.request_counts}")
        time.sleep(0.05)


def read_lines(client, file_id) -> list:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x.strip()]


def sync_answer(server: CliServer, key: str, url: str, body: dict) -> tuple:
    """``(status, body)`` of the same request sent synchronously, as JSON (``url``: the batch line's)."""
    response = httpx.post(server.url + url, json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120)
    return response.status_code, response.json()


def comparable(body: dict) -> dict:
    """An answer without what differs between two runs of one request: its id and creation time."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}
