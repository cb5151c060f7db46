"""Run docs pages twice: every job locally as written, and the same job on a live server through ai.remote.

:class:`Mirror` serves every model a page builds from one real uvicorn server
(a dispatcher app: ``/m<n>/v1/...`` is model ``n``'s :class:`~asyncinterp.serve.Server`,
created when the page first runs a job on it, with ``--allow-code``). While
active, the engines' ``start`` is wrapped: each job is first sent, unchanged,
to the model's server (:class:`~asyncinterp.client.remote.RemoteExecution`,
the same function objects), then run locally as the page wrote it; the
remote results must equal the local ones (1e-5). A job that fails remotely
but not locally is recorded with its error (``records``): the test checks
each against the list of what cannot run remotely in docs/remote.md.
"""

from __future__ import annotations

import linecache

import torch

from asyncinterp.engine import ForwardEngine
from asyncinterp.tools.cache import Cache
from asyncinterp.models.hf.runs import LMForwardEngine, LMGenerateEngine
from asyncinterp.serve import Server
from asyncinterp.client.remote import RemoteExecution, RemoteGeneration, RemoteInvoke, RemoteModel
from docsnippets import python_blocks
from remote_helpers import Live


class Dispatch:
    """An ASGI app: ``/<key>/rest`` goes to ``apps[key]`` as ``/rest``."""

    def __init__(self):
        self.apps = {}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        _, key, rest = (scope["path"] + "/").split("/", 2)
        app = self.apps.get(key)
        if app is None:
            await send({"type": "http.response.start", "status": 404, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        path = "/" + rest.rstrip("/")
        await app({**scope, "path": path, "raw_path": path.encode()}, receive, send)


def same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: remote gave {type(b).__name__}"
        assert a.shape == b.shape, f"{where}: shapes {tuple(a.shape)} vs {tuple(b.shape)}"
        if a.is_floating_point():
            assert torch.allclose(a.float(), b.float(), atol=1e-5, rtol=1e-5), \
                f"{where}: max diff {(a.float() - b.float()).abs().max()}"
        else:
            assert torch.equal(a, b), where
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a!r:.80} vs {b!r:.80}"
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} vs {b!r:.80}"
        for k in a:
            same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, float):
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), f"{where}: {a} vs {b}"
    else:
        assert a == b, f"{where}: {a!r:.80} vs {b!r:.80}"


class Mirror:
    """The live server and the wrapped engines (use as a context manager around running pages)."""

    ENGINES = (ForwardEngine, LMForwardEngine, LMGenerateEngine)

    def __init__(self):
        self.dispatch = Dispatch()
        self.servers = {}        # id(model) -> (model, Server, RemoteModel)
        self.records = []        # {"page", "outcome": "equal" | "remote_failed" | "both_failed", "error"}
        self.page = None
        self._saved = {}
        self.live = Live(None, app=self.dispatch, lifespan="off")
        self.url = self.live.url

    # ------------------------------------------------------------------ pages
    def run_page(self, page: str, namespace: dict | None = None) -> dict:
        """Execute ``page``'s python blocks as docsnippets does, with their source in linecache (as a
        notebook does) so that functions defined there can travel."""
        self.page = page
        ns = {} if namespace is None else namespace
        ns.setdefault("__name__", "__docs__")
        for i, block in enumerate(python_blocks(page)):
            filename = f"<docs {page} block {i}>"
            linecache.cache[filename] = (len(block), None, block.splitlines(True), filename)
            exec(compile(block, filename, "exec"), ns)  # noqa: S102 - our own documentation
        return ns

    # ------------------------------------------------------------------ servers
    def remote_for(self, model) -> RemoteModel:
        entry = self.servers.get(id(model))
        if entry is None:
            key = f"m{len(self.servers)}"
            server = Server(model, allow_code=True, max_batch=64, max_wait_ms=0, timeout=120, code_budget=60,
                            max_body_bytes=64 << 20, max_new_tokens=1024, builtin_interventions=False)
            self.dispatch.apps[key] = server.app
            entry = self.servers[id(model)] = (model, server, RemoteModel(f"{self.url}/{key}", timeout=120))
        return entry[2]

    # ------------------------------------------------------------------ the mirrored run
    def remote_run(self, engine, job):
        """Send ``job`` to the model's server; its remote result carriers, or the exception it raised."""
        remote = self.remote_for(engine.model)
        cls = RemoteGeneration if isinstance(engine, LMGenerateEngine) else RemoteInvoke
        carriers = tuple(cls(i, spec) for i, spec in enumerate(job.invokes))
        try:
            for inv in carriers:
                for fn in inv.spec.fns:
                    from asyncinterp.client.remote_check import check_names
                    check_names(fn, remote.tree())
            RemoteExecution(remote, job.replace(results=carriers, listener=None)).wait()
        except Exception as exc:  # noqa: BLE001 - compared with the local outcome below
            return exc
        for inv in carriers:   # a cache is filled in place: keep what the server recorded before the local run
            inv.caches = {id(fn): dict(fn.recorded) for fn in inv.spec.fns if isinstance(fn, Cache)}
        return carriers

    def compare(self, job, remote, local_exc):
        record = {"page": self.page, "invokes": len(job.invokes)}
        if isinstance(remote, Exception):
            record.update(outcome="both_failed" if local_exc else "remote_failed",
                          error=f"{type(remote).__name__}: {remote}",
                          same_type=local_exc is not None and isinstance(remote, type(local_exc)))
        elif local_exc is not None:
            record.update(outcome="local_only_failed", error=f"{type(local_exc).__name__}: {local_exc}")
        else:
            for i, (here, there) in enumerate(zip(job.results, remote)):
                try:
                    value = here.result
                except Exception:  # noqa: BLE001 - on_error="continue": this invoke failed locally
                    assert there.error is not None, f"{self.page}: invoke {i} failed locally only"
                    continue
                if there.caches:
                    for fn in here.spec.fns:
                        if isinstance(fn, Cache):
                            remote_records = there.caches[id(fn)]
                            assert list(fn.recorded) == list(remote_records), f"{self.page}: cache keys"
                            for key, entries in fn.recorded.items():
                                same(entries, remote_records[key], f"{self.page}: cache {key}")
                else:
                    same(value, there.result, f"{self.page}: invoke {i}")
                if isinstance(there, RemoteGeneration) and hasattr(here, "text"):
                    assert here.text == there.text, f"{self.page}: invoke {i} text {here.text!r} vs {there.text!r}"
            record["outcome"] = "equal"
        self.records.append(record)

    def __enter__(self):
        mirror = self
        for cls in self.ENGINES:
            original = cls.__dict__["start"]
            self._saved[cls] = original

            def start(engine, job, _original=original):
                execution = _original(engine, job)
                if job.stop_per_invoke or not any(spec.fns for spec in job.invokes if not spec.background):
                    # a batch the server runs (not the page's own job), or a plain forward: its output does
                    # not travel (only results do)
                    return execution
                return Mirrored(mirror, engine, job, execution)
            cls.start = start
        return self

    def __exit__(self, *exc):
        for cls, original in self._saved.items():
            cls.start = original
        self._saved.clear()

    def close(self):
        self.live.close()
        for _, server, remote in self.servers.values():
            remote.close()
            server.batcher.close()


class Mirrored:
    """A local execution that first runs its job remotely, then compares (see :class:`Mirror`)."""

    def __init__(self, mirror, engine, job, inner):
        object.__setattr__(self, "_mirror", mirror)
        object.__setattr__(self, "_engine", engine)
        object.__setattr__(self, "_job", job)
        object.__setattr__(self, "_inner", inner)

    def wait(self, cancellable=False):
        mirror, job = self._mirror, self._job
        remote = mirror.remote_run(self._engine, job)
        try:
            self._inner.wait(cancellable)
        except Exception as exc:
            mirror.compare(job, remote, exc)
            raise
        mirror.compare(job, remote, None)

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)
