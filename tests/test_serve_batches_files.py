"""Uploaded files expire, as OpenAI's do: ``expires_after`` on ``files.create``, else the server's ``--file-ttl``.

A real ``asyncinterp serve`` subprocess (``--file-ttl 3``) driven by the stock ``openai`` client: an upload
that names ``expires_after`` expires then; one that does not expires after the server's 3 s, and from then
on is gone for its owner (retrieve, content, delete, list, and a batch naming it: 404); a bad
``expires_after`` is a 400 naming the field. The store's sweep removes the expired rows.
"""

import asyncio
import time

import openai
import pytest

from asyncinterp.serve.jobs.durable.store import JobStore
from asyncinterp.serve.openai.batches.files import create
from asyncinterp.serve.openai.batches.tables import Tables
from batch_helpers import CliServer, chat_gpt2_dir, jsonl, line
from serve_helpers import one_thread  # noqa: F401 - fixtures are found by name

MODEL, KEY = "tiny-gpt2", "files-key"
LINES = jsonl([line("a", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1})])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = CliServer(chat_gpt2_dir(tmp_path_factory.mktemp("model")),
                  ["--served-model-name", MODEL, "--api-key", KEY, "--file-ttl", "3"], tmp_path_factory.mktemp("state"))
    s.start()
    yield s
    s.stop()


def test_files_expire_after_expires_after_or_the_servers_ttl(server):
    client = server.client(KEY)
    kept = client.files.create(file=("kept.jsonl", LINES), purpose="batch",
                               expires_after={"anchor": "created_at", "seconds": 3600})
    assert kept.expires_at == kept.created_at + 3600 and client.files.retrieve(kept.id).expires_at == kept.expires_at
    short = client.files.create(file=("short.jsonl", LINES), purpose="batch")
    assert short.expires_at == short.created_at + 3                        # --file-ttl 3
    assert client.files.content(short.id).content == LINES
    with pytest.raises(openai.BadRequestError, match="anchor"):
        client.files.create(file=("x.jsonl", LINES), purpose="batch", expires_after={"anchor": "now", "seconds": 3600})
    with pytest.raises(openai.BadRequestError, match="1 hour"):
        client.files.create(file=("x.jsonl", LINES), purpose="batch",
                            expires_after={"anchor": "created_at", "seconds": 10})
    while time.time() < short.expires_at + 0.2:
        time.sleep(0.1)
    for call in (lambda: client.files.retrieve(short.id), lambda: client.files.content(short.id),
                 lambda: client.files.delete(short.id),
                 lambda: client.batches.create(input_file_id=short.id, endpoint="/v1/completions",
                                               completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    listed = [f.id for f in client.files.list()]
    assert kept.id in listed and short.id not in listed
    assert client.files.content(kept.id).content == LINES
    client.close()


def test_the_sweep_removes_expired_files(tmp_path):
    async def go():
        store = await JobStore.open(None, tmp_path)
        db = Tables(store.engine)
        old = await create(db, "o", "old.jsonl", "batch", LINES, ttl=1)
        new = await create(db, "o", "new.jsonl", "batch", LINES, ttl=3600)
        forever = await create(db, "o", "forever.jsonl", "batch", LINES, ttl=None)
        removed = await db.expire_files(now=time.time() + 10)
        left = [r["id"] for r in await db.list_files("o")]
        await store.close()
        return removed, left, (old, new, forever)
    removed, left, (old, new, forever) = asyncio.run(go())
    assert removed == 1 and sorted(left) == sorted([new["id"], forever["id"]]) and old["id"] not in left
    assert forever["expires_at"] is None
