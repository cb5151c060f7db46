"""``asyncinterp serve DIR --tensor-parallel-size N`` on the transformers engine: the server starts its ranks itself.

The command the user types starts N rank processes with the launcher
(:mod:`asyncinterp.distributed.launch`; nobody types ``torchrun``) and waits
for them. Every rank loads the model directory with transformers' own plan
(``tp_plan="auto"``, gloo) and the same server configuration (registered
interventions included). Rank 0 serves HTTP as usual. Before its batcher runs
a batch, it posts the batch's submissions to the group's key-value store, each
in the job wire form (:mod:`asyncinterp.client.job_form`: msgpack, no pickle;
each intervention as its registered name and parameters, each invoke's seed in
its options). The other ranks follow: they read each job, bind the same
registered interventions and run the same batch through their own batcher, so every
rank runs the same job and the collectives line up (see
:mod:`asyncinterp.models.hf.tp`).

Limits: interventions must be registered ones (builtins or ``--interventions``
files); submitted source (``--allow-code``) is refused under tensor
parallelism. A request cancelled on rank 0 in the middle of a shared
generation is not mirrored on the others (the ranks may then fall out of step
and the job stops with a collective timeout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from datetime import timedelta

from ...client import wire
from ...client.job_form import Named, dumps_job
from ...job import InvokeSpec
from ..jobs.job_wire import JobParts, read_job
from ..http.app import Server
from ..scheduling.batcher import Batcher
from ..jobs.errors import RequestFailed
from ..scheduling.submission import Submission

__all__ = ["launch_ranks", "main"]

_ENV = "ASYNCINTERP_SERVE_ARGS"
_KEY = "asyncinterp/serve/batch/"
_STOP = b"stop"


def launch_ranks(args) -> int:
    """In the command's own process: start ``args.tensor_parallel_size`` ranks serving ``args.model``; wait.

    With ``--ray-address`` the ranks are Ray actors on different nodes instead (:mod:`.tp_ray`)."""
    from ...distributed.group import configured_timeout
    from ...distributed.launch import start
    if not os.path.isdir(args.model):
        print(f"asyncinterp serve: --tensor-parallel-size on the transformers engine serves a model directory "
              f"(loaded with tp_plan='auto'), not {args.model!r}", file=sys.stderr)
        return 2
    if args.allow_code:
        print("asyncinterp serve: --allow-code is not available with --tensor-parallel-size (submitted code is "
              "not mirrored to the other ranks); register interventions with --interventions FILE", file=sys.stderr)
        return 2
    if getattr(args, "ray_address", None):
        from .tp_ray import run      # the ranks on Ray nodes, this process serves the front
        return run(args)
    payload = json.dumps({k: v for k, v in vars(args).items() if k != "func"})
    job = start(["-m", "asyncinterp.serve.scale.tp_serve"], nproc=args.tensor_parallel_size,
                timeout=configured_timeout(), env=dict(os.environ, **{_ENV: payload}))
    try:
        job.wait(None, grace=5.0)
    except KeyboardInterrupt:
        job.kill()
        return 130
    return job.returncode


class _Channel:
    """Batches from rank 0 to the others, through the process group's key-value store."""

    def __init__(self):
        from ...distributed.group import store
        self.store = store()
        self.n = 0

    def send(self, payload: bytes) -> None:
        self.n += 1
        self.store.set(f"{_KEY}{self.n}", payload)
        if self.n > 2:
            self.store.delete_key(f"{_KEY}{self.n - 2}")

    def recv(self) -> bytes:
        self.n += 1
        key = f"{_KEY}{self.n}"
        while True:
            try:
                self.store.wait([key], timedelta(seconds=600))
                return self.store.get(key)
            except Exception as exc:  # noqa: BLE001 - a wait timeout: go on waiting; rank 0 gone: stop
                if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                    return _STOP


class _TPServer(Server):
    """Rank 0's server: remembers each bound intervention's ``{"name", "params"}`` so the others can bind it too."""

    def bind_intervention(self, spec, timeout, required=True):
        if isinstance(spec, dict) and "source" in spec:
            raise RequestFailed("refused", "submitted code is not served under tensor parallelism; use a "
                                           "registered intervention (GET /v1/model)")
        bound = super().bind_intervention(spec, timeout, required)
        fn = bound[0]
        if fn is not None:
            fn.tp_spec = {"name": spec} if isinstance(spec, str) else {"name": spec.get("name"),
                                                                        "params": spec.get("params") or {}}
        return bound


class _LeaderBatcher(Batcher):
    """Rank 0's batcher: posts each batch for the other ranks before running it."""

    channel = None

    def _run(self, live):
        jobs, mirrored = [], []
        for sub in live:
            specs = [[getattr(fn, "tp_spec", None) for fn in served.fns] for served in sub.invokes]
            if any(s is None for fns in specs for s in fns):
                sub.answer(False, RuntimeError("under tensor parallelism only registered interventions can run"))
                continue
            jobs.append(_job_form(sub, specs))
            mirrored.append(sub)
        if not mirrored:
            return None
        self.channel.send(wire.packb({"jobs": jobs}))
        return super()._run(mirrored)


def _job_form(sub, specs) -> bytes:
    """A submission as the other ranks read it: the job wire (:mod:`asyncinterp.client.job_form`), each
    intervention as its registered name and parameters, each invoke's own seed in its options."""
    invokes = tuple(InvokeSpec(served.input, tuple(Named(s["name"], s.get("params") or {}) for s in fns),
                               served.kwargs or {}, {"seed": served.gen.get("seed")} if sub.kind == "generate" else {})
                    for served, fns in zip(sub.invokes, specs))
    generation = dict(sub.gen) if sub.kind == "generate" else {}
    if sub.kind == "generate":
        generation["max_new_tokens"] = sub.max_new_tokens
    return dumps_job(JobParts(invokes, sub.kind, sub.on_error, False, generation, {}))


def _submission(job) -> Submission:
    """A follower's copy of rank 0's submission, its interventions bound by name here."""
    generation = dict(job.generation)
    max_new_tokens = generation.pop("max_new_tokens", None)
    sub = Submission(job.kind, [(spec.input, spec.fns, dict(spec.kwargs)) for spec in job.invokes],
                     on_error=job.on_error, gen=generation, max_new_tokens=max_new_tokens)
    for served, spec in zip(sub.invokes, job.invokes):
        if job.kind == "generate":
            served.gen = dict(generation, seed=spec.options.get("seed"))
    sub.start()
    return sub


def _registered_only(spec):
    raise RequestFailed("refused", "under tensor parallelism only registered interventions can run")


def _server_kwargs(args, keys):
    return dict(api_keys=keys, allow_code=False, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                max_queue=args.max_queue, timeout=args.timeout, code_budget=args.code_budget,
                max_body_bytes=args.max_body_bytes, max_new_tokens=args.max_new_tokens, exact=args.exact,
                name=args.served_model_name or args.model, builtin_interventions=not args.no_builtins,
                prompt_tokens_details=args.enable_prompt_tokens_details)


def _load(args):
    import torch  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ...models.hf import tp  # noqa: F401 (LanguageModel(tp model) support)
    from ...models.hf.language import LanguageModel
    hf = AutoModelForCausalLM.from_pretrained(args.model, tp_plan="auto").eval()
    return LanguageModel(hf, AutoTokenizer.from_pretrained(args.model))


def _lead(args, model, keys, channel) -> int:
    from ..http.startup import load_interventions
    log = logging.getLogger("asyncinterp.serve")
    batcher = _LeaderBatcher(model, max_batch=args.max_batch, max_wait_ms=args.max_wait_ms,
                             max_queue=args.max_queue, exact=args.exact, name=f"serve-{args.model}")
    batcher.channel = channel
    server = _TPServer(model, batcher=batcher, **_server_kwargs(args, keys))
    for path in args.interventions:
        load_interventions(server, path)
    import uvicorn
    config = uvicorn.Config(server.asgi, host=args.host, port=args.port, log_level="warning", access_log=False)
    log.info("serving", extra={"fields": {"event": "startup", "model": server.name, "engine": "transformers",
                                          "tensor_parallel_size": args.tensor_parallel_size,
                                          "host": args.host, "port": args.port}})
    try:
        uvicorn.Server(config).run()
    finally:
        channel.send(_STOP)
        batcher.close()
    return 0


def _follow(args, model, keys, channel) -> int:
    from ..http.startup import load_interventions
    server = Server(model, **_server_kwargs(args, keys))
    for path in args.interventions:
        load_interventions(server, path)

    async def loop():
        while True:
            payload = await asyncio.to_thread(channel.recv)
            if payload == _STOP:
                return 0
            def named(spec):
                return server.bind_intervention({"name": spec.get("name"), "params": spec.get("params")},
                                                server.timeout)[0]
            batch = [_submission(read_job(data, compile=_registered_only, named=named))
                     for data in wire.unpackb(payload)["jobs"]]
            try:
                await asyncio.to_thread(server.batcher._run, batch)
            except Exception:  # noqa: BLE001 - rank 0 reports it to its client (see distributed.group.agree)
                logging.getLogger("asyncinterp.serve").exception("tensor-parallel follower: batch failed")
    return asyncio.run(loop())


def main() -> int:
    from ...distributed import init, rank
    from ..http.startup import setup_logging
    args = argparse.Namespace(**json.loads(os.environ[_ENV]))
    setup_logging(args.log_format, args.log_level)
    init()
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    keys = list(args.api_key) + [k.strip() for k in os.environ.get("ASYNCINTERP_API_KEYS", "").split(",") if k.strip()]
    model = _load(args)
    channel = _Channel()
    return _lead(args, model, keys, channel) if rank() == 0 else _follow(args, model, keys, channel)


if __name__ == "__main__":
    sys.exit(main())
