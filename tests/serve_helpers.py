"""Shared set-up for the serving tests: one BLAS thread per module, the tiny GPT-2, a CLI server to wait for.

Import the fixtures by name (``from serve_helpers import model, one_thread``):
pytest picks them up from the importing module.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time

import httpx
import pytest
import torch

from asyncinterp.models import tiny


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Deterministic BLAS: batched results bit-equal to solo runs (server workers inherit it)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    return tiny("gpt2")


def wait_healthy(proc, url: str, timeout: float = 90, interval: float = 0.2) -> None:
    """Wait until the server subprocess ``proc`` answers ``/v1/health`` at ``url``; fail with its stderr if it
    exits, or after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"server exited: {err[-3000:]}")
        try:
            if httpx.get(f"{url}/v1/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"server did not come up within {timeout:g} s")
        time.sleep(interval)


def stop_server(proc, timeout: float = 20) -> tuple[str, list]:
    """Stop the server subprocess ``proc`` as Ctrl-C does (killed if it outlives ``timeout`` s).

    Returns its stderr and the JSON log records in it.
    """
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate(timeout=10)
    return err, [json.loads(line) for line in err.splitlines() if line.startswith("{")]


# a submitted busy loop that never ends on its own (cut by the request's budget or deadline)
SPIN = """
async def f(m):
    h = await m.transformer.h[0].output
    n = 0
    while True:
        n += 1
"""
