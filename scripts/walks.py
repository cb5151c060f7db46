"""Walk a request from its public call (or HTTP request) to the first hook firing, and count the hops.

docs/design.md draws four walks; this script measures them, so that the page states what the code does:

* ``local``: ``model.trace(x, fn)`` on tiny GPT-2 in this process;
* ``remote``: ``ai.remote(url).trace(x, fn)`` against ``asyncinterp serve tiny-gpt2 --allow-code`` (so with
  process isolation: the intervention runs in a supervised worker process);
* ``vllm``: ``POST /v1/completions`` with a registered intervention against ``asyncinterp serve SMOLLM2
  --engine vllm`` (vLLM on CPU);
* ``ray``: the remote trace of ``remote`` through Ray Serve's proxy to ``asyncinterp serve tiny-gpt2
  --allow-code --replicas 1`` on a local Ray cluster (as tests/test_serve_ray.py starts it).

Each walk runs for real. Every Python process of the walk carries the probe of ``scripts/walkprobe.py``
(``scripts/walk_probe/sitecustomize.py``, by ``PYTHONPATH``): after one warm-up request each process
writes the stacks of its threads and asyncio tasks (the baseline), then the measured request runs and at
its first hook firing (``Kernel.provide``) every process writes its stacks again. A hop is an asyncinterp
frame (module and function) on a stack that the request put there: the firing thread's, and each thread
or task of any process whose stack differs from the baseline. Frames of other libraries (uvicorn, httpx,
torch, vLLM, Ray) are not counted; the processes and stacks they connect are.

    PYTHONPATH=src python scripts/walks.py                  # all four walks (vLLM and Ray take minutes)
    PYTHONPATH=src python scripts/walks.py local remote     # the two that tests/test_walks.py checks

It prints markdown: a table of the counts, then each walk's hops. docs/design.md includes that output
between ``<!-- walks -->`` and ``<!-- /walks -->``; tests/test_walks.py reruns the local and remote walks and
checks that their lines are the page's.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = str(ROOT / "src" / "asyncinterp") + os.sep
PROBE_DIR = str(ROOT / "scripts" / "walk_probe")
PROMPT = "The cat sat on the"
START_TIMEOUT_S = 600      # a vLLM engine or a Ray replica on two busy cores
REQUEST_TIMEOUT_S = 120
BASELINE_WAIT_S = 60       # for every process to settle and write its idle stacks
RELEASE_WAIT_S = 120       # for every process to write its stacks while a hook is held
WALKS = ("local", "remote", "vllm", "ray")
TITLES = {"local": "local trace", "remote": "remote trace", "vllm": "OpenAI completion on vLLM",
          "ray": "remote trace on Ray Serve"}
ENTRIES = {"local": "`model.trace(x, fn)`", "remote": "`ai.remote(url).trace(x, fn)`",
           "vllm": "`POST /v1/completions`", "ray": "`ai.remote(url).trace(x, fn)`"}


async def read_first_block(m):
    """The walks' intervention: read the first block's output."""
    return (await m.transformer.h[0].output)[0].sum()


# --------------------------------------------------------------------------- one walk's folder and processes
class Walk:
    """The probe's folder of one walk: arm it, trigger the baseline, read what the processes wrote."""

    def __init__(self, name: str):
        self.name = name
        self.folder = tempfile.mkdtemp(prefix=f"walk-{name}-")
        self.procs: list = []

    def env(self) -> dict:
        env = dict(os.environ)
        env["ASYNCINTERP_WALK_DIR"] = self.folder
        env["PYTHONPATH"] = os.pathsep.join([PROBE_DIR, str(ROOT / "src"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return env

    def probe_here(self):
        sys.path.insert(0, str(ROOT / "scripts"))
        import walkprobe
        walkprobe.install(self.folder).folder = self.folder
        return walkprobe

    def baseline(self) -> None:
        """Every process of the walk writes its idle stacks (each once it has settled; see walkprobe)."""
        open(os.path.join(self.folder, "trigger-baseline"), "w").close()
        deadline = time.monotonic() + BASELINE_WAIT_S
        time.sleep(0.5)
        while time.monotonic() < deadline and set(self.alive_writers()) - set(self.read("baseline")):
            time.sleep(0.1)
        os.remove(os.path.join(self.folder, "trigger-baseline"))

    def arm(self) -> None:
        """Arm the probe; once a hook fires, release it when every process has written its stacks."""
        open(os.path.join(self.folder, "armed"), "w").close()
        threading.Thread(target=self._release_when_written, name="walk-release", daemon=True).start()

    def _release_when_written(self) -> None:
        deadline = time.monotonic() + RELEASE_WAIT_S
        while not self.fired() and time.monotonic() < deadline:
            time.sleep(0.02)
        while time.monotonic() < deadline:
            unwritten = (set(self.read("baseline")) & set(self.alive_writers())) - set(self.read("fire"))
            if not unwritten:
                break
            time.sleep(0.05)
        with contextlib.suppress(OSError):
            open(os.path.join(self.folder, "released"), "w").close()

    def alive_writers(self) -> list:
        """The pids of the processes that carry the probe (each opened its ``out-PID.jsonl``) and still run."""
        pids = []
        for path in pathlib.Path(self.folder).glob("out-*.jsonl"):
            pid = int(path.stem.removeprefix("out-"))
            try:
                state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue    # gone
            if state not in ("Z", "X"):
                pids.append(pid)
        return pids

    def fired(self) -> bool:
        path = os.path.join(self.folder, "fire-signal")
        return os.path.exists(path) and os.path.getsize(path) > 0

    def read(self, kind: str) -> dict:
        out = {}
        for path in pathlib.Path(self.folder).glob("out-*.jsonl"):
            for line in path.read_text().splitlines():
                try:
                    data = json.loads(line)
                except ValueError:
                    continue    # a line still being written
                if data["kind"] == kind:
                    out[data["pid"]] = data
        return out

    def close(self) -> None:
        for proc in self.procs:
            stop(proc)
        if not os.environ.get("WALKS_KEEP"):
            shutil.rmtree(self.folder, ignore_errors=True)


def stop(proc, timeout: float = 60) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc, timeout: float = START_TIMEOUT_S) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v1/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer /v1/health within {timeout:g} s")


def serve(walk: Walk, argv: list, port: int):
    code = "import sys; from asyncinterp.cli import main; sys.exit(main(sys.argv[1:]))"
    proc = subprocess.Popen([sys.executable, "-c", code, "serve", *argv, "--port", str(port), "--log-level", "warning"],
                            env=walk.env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    walk.procs.append(proc)
    return proc


# --------------------------------------------------------------------------- the four walks
def walk_local(walk: Walk) -> None:
    walk.probe_here()
    from asyncinterp.models import tiny
    model = tiny("gpt2")
    x = model.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    model.trace(x, read_first_block)
    walk.baseline()
    walk.arm()
    model.trace(x, read_first_block)


def remote_trace(walk: Walk, url: str) -> None:
    import asyncinterp as ai
    walk.probe_here()
    lm = ai.remote(url, timeout=REQUEST_TIMEOUT_S)
    lm.trace(PROMPT, read_first_block)
    walk.baseline()
    walk.arm()
    lm.trace(PROMPT, read_first_block)


def walk_remote(walk: Walk) -> None:
    port = free_port()
    proc = serve(walk, ["tiny-gpt2", "--allow-code"], port)
    wait_healthy(f"http://127.0.0.1:{port}", proc)
    remote_trace(walk, f"http://127.0.0.1:{port}")


def walk_vllm(walk: Walk) -> None:
    import httpx

    from asyncinterp.models.hf.bundled import smollm2_dir
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(walk, [str(smollm2_dir()), "--engine", "vllm", "--served-model-name", "smollm2", "--dtype", "float32",
                        "--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20)], port)
    wait_healthy(url, proc)
    walk.probe_here()
    body = {"model": "smollm2", "prompt": PROMPT, "max_tokens": 2, "temperature": 0,
            "asyncinterp": {"intervention": "read", "params": {"module": "model.layers.0"}}}

    def ask():
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
        if r.status_code != 200:
            raise RuntimeError(f"/v1/completions answered {r.status_code}: {r.text[:2000]}")
    ask()
    walk.baseline()
    walk.arm()
    ask()


def walk_ray(walk: Walk) -> None:
    import logging

    import ray
    from ray.cluster_utils import Cluster
    os.environ.update({k: v for k, v in walk.env().items() if k in ("ASYNCINTERP_WALK_DIR", "PYTHONPATH")})
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "object_store_memory": 80 << 20,
                                                            "include_dashboard": False})
    try:
        cluster.add_node(num_cpus=1, object_store_memory=80 << 20)
        ray.init(address=cluster.address, logging_level=logging.WARNING, log_to_driver=False)
        port = free_port()
        proc = serve(walk, ["tiny-gpt2", "--allow-code", "--replicas", "1", "--ray-address", cluster.address], port)
        wait_healthy(f"http://127.0.0.1:{port}", proc)
        remote_trace(walk, f"http://127.0.0.1:{port}")
    finally:
        for proc in walk.procs:
            stop(proc)
        ray.shutdown()
        cluster.shutdown()


RUNNERS = {"local": walk_local, "remote": walk_remote, "vllm": walk_vllm, "ray": walk_ray}


# --------------------------------------------------------------------------- from stacks to hops
def ours(frame) -> bool:
    return frame[0].startswith(PACKAGE)


def hop(frame) -> str:
    module = frame[0][len(PACKAGE):].removesuffix(".py").replace(os.sep, ".").removesuffix(".__init__")
    return f"{module}:{frame[2]}"


def shape(frames) -> tuple:
    return tuple((f[0], f[2]) for f in frames)


def request_stacks(walk: Walk) -> list:
    """``[(pid, label, [hops])]``: the stacks the request put there, the firing thread's last."""
    firing = walk.read("firing")
    if len(firing) != 1:
        raise RuntimeError(f"walk {walk.name}: expected one hook firing, got {len(firing)} (is the probe loaded?)")
    (fire_pid, fired), = firing.items()
    base = walk.read("baseline")
    out = []
    # the caller first, the firing process last; within a process in a fixed order (threads and tasks have none)
    for pid, data in sorted(walk.read("fire").items(), key=lambda kv: (kv[0] != os.getpid(), kv[0] == fire_pid, kv[0])):
        idle = {shape(s["frames"]) for s in base.get(pid, {}).get("threads", []) + base.get(pid, {}).get("tasks", [])}
        here = []
        for kind, stacks in (("thread", data["threads"]), ("task", data["tasks"])):
            for s in stacks:
                if s.get("ident") == fired["ident"] and pid == fire_pid:
                    continue
                hops = [hop(f) for f in s["frames"] if ours(f)]
                if hops and shape(s["frames"]) not in idle:
                    here.append((pid, kind, hops))
        out += sorted(here, key=lambda stack: (stack[1], stack[2]))
    hops = []
    for f in fired["frames"]:
        if f[0].endswith("walkprobe.py"):
            break
        if ours(f):
            hops.append(hop(f))
    out.append((fire_pid, "thread", hops))
    return out


def summarize(name: str, stacks: list) -> dict:
    pids = []
    for pid, _, _ in stacks:
        if pid not in pids:
            pids.append(pid)
    frames = [h for _, _, hops in stacks for h in hops]
    return {"name": name, "stacks": stacks, "pids": pids, "hops": len(frames),
            "modules": len({h.split(":")[0] for h in frames})}


def markdown(results: list) -> str:
    lines = ["| walk | entry | processes | stacks | hops (asyncinterp frames) | modules |", "|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {TITLES[r['name']]} | {ENTRIES[r['name']]} | {len(r['pids'])} | {len(r['stacks'])} | "
                     f"{r['hops']} | {r['modules']} |")
    for r in results:
        lines += ["", f"**{TITLES[r['name']]}** ({r['hops']} hops):", ""]
        for pid, kind, hops in r["stacks"]:
            where = f"process {r['pids'].index(pid) + 1}, {kind}"
            lines.append(f"- {where}: " + " → ".join(f"`{h}`" for h in hops))
    return "\n".join(lines)


def run_walk(name: str) -> dict:
    walk = Walk(name)
    try:
        RUNNERS[name](walk)
        deadline = time.monotonic() + 10
        while not walk.fired() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        return summarize(name, request_stacks(walk))
    finally:
        walk.close()


def main(argv) -> int:
    as_json = "--json" in argv
    names = [a for a in argv[1:] if a != "--json"] or list(WALKS)
    unknown = [n for n in names if n not in WALKS]
    if unknown:
        print(f"unknown walk(s) {unknown}: choose among {', '.join(WALKS)}", file=sys.stderr)
        return 2
    if len(names) == 1:
        result = run_walk(names[0])
        print(json.dumps(result) if as_json else markdown([result]))
        return 0
    # each walk in a fresh process of its own: the probe and its patch of the kernel are per process
    results = []
    for name in names:
        out = subprocess.run([sys.executable, __file__, "--json", name], capture_output=True, text=True,
                             timeout=START_TIMEOUT_S + 300, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
        if out.returncode != 0:
            print(out.stderr[-4000:], file=sys.stderr)
            return out.returncode
        results.append(json.loads(out.stdout.splitlines()[-1]))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
