"""docs/jobs.md's Python blocks run, in order, against a real ``asyncinterp serve tiny-llama --state-dir``
server with process isolation (the page's URL and key replaced by the test server's); its REST table names the routes the server
has."""

import linecache
import re

import httpx
import pytest

from docsnippets import DOCS, python_blocks
from jobs_helpers import JobServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # process isolation (the default with --allow-code): kept jobs run in the supervised worker processes
    srv = JobServer("--api-key", "secret", "--allow-code", "--isolation", "process", model="tiny-llama",
                    state_dir=tmp_path_factory.mktemp("state"))
    srv.start()
    yield srv
    srv.stop()


def test_jobs_page_runs(server):
    blocks = python_blocks("jobs.md")
    assert len(blocks) >= 5
    ns = {"__name__": "__docs__"}
    for i, block in enumerate(blocks):
        block = block.replace('"http://127.0.0.1:8000"', repr(server.url))
        name = f"jobs.md[block {i}]"
        linecache.cache[name] = (len(block), None, block.splitlines(True), name)   # as a notebook cell
        exec(compile(block, name, "exec"), ns)  # noqa: S102 - our docs
    assert ns["job"].status().state == "succeeded" and ns["job"].id == ns["job_id"]


def test_rest_table_matches_the_server(server):
    text = (DOCS / "jobs.md").read_text()
    routes = set(re.findall(r"\| `(GET|POST|DELETE) (/v1/[a-z/]+)", text))
    assert ("GET", "/v1/jobs") in routes and ("DELETE", "/v1/jobs/") in routes
    h = {"authorization": "Bearer secret"}
    assert httpx.get(f"{server.url}/v1/jobs", headers=h, timeout=30).status_code == 200
    for method, path in (("GET", "/v1/jobs/job_x"), ("GET", "/v1/jobs/job_x/result"),
                         ("GET", "/v1/jobs/job_x/events"), ("DELETE", "/v1/jobs/job_x")):
        r = httpx.request(method, f"{server.url}{path}", headers=h, timeout=30)
        assert r.status_code == 404 and "no job" in r.text     # the route exists; the job does not
