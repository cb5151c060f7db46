"""The parts of replicated serving that need no cluster: options, the application builder, the docs' Serve
config, the 502 a lost replica gets (the proxy middleware on real ASGI traffic), and that ``import
asyncinterp`` stays free of Ray. The deployment itself is tested in test_serve_ray.py (marker ``ray``)."""

import json
import re
import subprocess
import sys

import httpx
import msgpack
import pytest

from asyncinterp.serve import cli, errors, openai_compat
from asyncinterp.serve.scale.replica_loss import KIND, MESSAGE, Answers, ReplicaLossAnswers, proxy_middlewares
from docsnippets import DOCS


def test_import_asyncinterp_does_not_import_ray():
    code = ("import sys, asyncinterp, asyncinterp.serve, asyncinterp.serve.cli, asyncinterp.cli\n"
            "asyncinterp.cli.build_parser().parse_args(['serve', 'tiny-gpt2', '--replicas', '2'])\n"
            "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-2000:]


def test_the_502_is_the_servers_own_error_shape():
    answers = Answers()
    assert answers.status == errors.status_of(KIND) == 502
    assert answers.error == {"type": "ReplicaLost", "message": MESSAGE, "traceback": [], "notes": [], "kind": KIND}
    assert (b"x-should-retry", b"false") in answers.headers          # the openai package does not retry it
    assert answers.openai == openai_compat.error_body(502, answers.error)


# --------------------------------------------------------------------------- the proxy middleware
def proxy_like(events):
    """An ASGI app that behaves as Ray Serve's proxy does when the replica dies: it sends ``events`` (maybe none,
    maybe a stream's start) and returns without finishing the answer."""
    async def app(scope, receive, send):
        for event in events:
            await send(event)
    return app


async def ask(app, path, **kw):
    transport = httpx.ASGITransport(app=ReplicaLossAnswers(app))
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
        return await http.post(path, **kw)


@pytest.mark.anyio
async def test_a_lost_replica_before_any_answer_gets_a_clear_502():
    r = await ask(proxy_like([]), "/v1/trace", content=b"\x80")
    assert r.status_code == 502 and r.headers["x-should-retry"] == "false"
    body = msgpack.unpackb(r.content)
    assert body["ok"] is False and body["error"]["kind"] == KIND and "not retried" in body["error"]["message"]
    r = await ask(proxy_like([]), "/v1/chat/completions", json={})
    assert r.status_code == 502 and r.json()["error"]["code"] == KIND
    assert r.json()["error"]["type"] == "server_error"


@pytest.mark.anyio
async def test_a_stream_cut_by_a_lost_replica_ends_with_its_error_event():
    start = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}
    chunk = {"type": "http.response.body", "body": b'data: {"choices": []}\n\n', "more_body": True}
    r = await ask(proxy_like([start, chunk]), "/v1/completions", json={})
    events = re.findall(r"data: (.*)\n\n", r.text)
    assert r.status_code == 200 and events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == KIND
    start = {"type": "http.response.start", "status": 200,
             "headers": [(b"content-type", b"application/x-msgpack-stream")]}
    token = {"type": "http.response.body", "body": msgpack.packb({"event": "token", "token": 5}), "more_body": True}
    r = await ask(proxy_like([start, token]), "/v1/generate", content=b"\x80")
    items = list(msgpack.Unpacker(__import__("io").BytesIO(r.content)))
    assert items[0]["event"] == "token" and items[-1]["event"] == "error" and items[-1]["status"] == 502


@pytest.mark.anyio
async def test_complete_answers_pass_unchanged():
    start = {"type": "http.response.start", "status": 422, "headers": [(b"content-type", b"application/msgpack")]}
    body = {"type": "http.response.body", "body": msgpack.packb({"ok": False}), "more_body": False}
    r = await ask(proxy_like([start, body]), "/v1/trace", content=b"\x80")
    assert r.status_code == 422 and msgpack.unpackb(r.content) == {"ok": False}


@pytest.fixture
def anyio_backend():
    return "asyncio"


# --------------------------------------------------------------------------- options and the builder
def _parse(argv):
    import argparse
    from asyncinterp.serve.scale.replicas import add_arguments
    p = argparse.ArgumentParser()
    cli.configure(p)
    add_arguments(p)
    return p.parse_args(list(argv))


def test_replica_options_are_plain_values_with_keys_resolved(monkeypatch, tmp_path):
    ray_app = pytest.importorskip("asyncinterp.serve.scale.ray_app")
    monkeypatch.setenv("ASYNCINTERP_API_KEYS", "from-env")
    extra = tmp_path / "more.py"
    args = _parse(["tiny-gpt2", "--api-key", "k1", "--replicas", "3", "--interventions", str(extra)])
    options = ray_app.replica_options(args)
    assert json.loads(json.dumps(options)) == options
    assert options["api_key"] == ["k1", "from-env"] and options["interventions"] == [str(extra)]
    assert not set(options) & ray_app.DRIVER_ONLY
    deployment = ray_app.deployment_options(args)
    assert deployment == {"ray_actor_options": {"num_cpus": 1.0}, "num_replicas": 3, "max_ongoing_requests": 64}


def test_the_builder_refuses_what_it_cannot_use():
    ray_app = pytest.importorskip("asyncinterp.serve.scale.ray_app")
    with pytest.raises(ValueError, match="argv"):
        ray_app.build({"model": "tiny-gpt2"})
    with pytest.raises(ValueError, match="not valid"):
        ray_app.build({"argv": "tiny-gpt2 --no-such-flag"})
    with pytest.raises(ValueError, match="not valid"):          # replica counts are Ray Serve's config
        ray_app.build({"argv": "tiny-gpt2 --replicas 2"})
    assert ray_app.build({"argv": "tiny-gpt2 --api-key x"}) is not None


def test_the_docs_serve_config_is_valid_for_ray_serve():
    pytest.importorskip("ray")
    yaml = pytest.importorskip("yaml")
    from ray.serve.schema import ServeDeploySchema
    page = (DOCS / "scale-out.md").read_text()
    config = yaml.safe_load(re.findall(r"```yaml\n(.*?)```", page, flags=re.S)[0])
    schema = ServeDeploySchema.model_validate(config)
    app = schema.applications[0]
    assert app.import_path == "asyncinterp.serve.scale.ray_app:build"
    assert app.deployments[0].name == "AsyncinterpServer"
    assert app.deployments[0].autoscaling_config["max_replicas"] == 8
    from asyncinterp.serve import ray_app
    assert ray_app.DEPLOYMENT_NAME == "AsyncinterpServer"
    ray_app.parse_argv(app.args["argv"])                 # the replicas' command line parses


@pytest.mark.parametrize("flags, message", [(["--replicas", "0"], "at least 1"),
                                            (["--replicas", "2", "--port", "0"], "--port 0"),
                                            (["--replicas", "2", "--tensor-parallel-size", "2"], "without --replicas")])
def test_bad_replica_flags_fail_before_anything_starts(flags, message):
    out = subprocess.run([sys.executable, "-m", "asyncinterp.serve.scale.replicas", "tiny-gpt2", *flags],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and message in out.stderr, out.stderr[-2000:]


def test_the_proxy_callback_gives_the_middleware():
    assert [m.cls for m in proxy_middlewares()] == [ReplicaLossAnswers]
