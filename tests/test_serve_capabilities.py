"""``GET /v1/capabilities`` through a real server: every point the model gives, with the shape and dtype a
local trace of the same prompt gives, and what it refuses with the refusal's own message."""

import httpx
import pytest

from asyncinterp.models import tiny
from asyncinterp.serve import Server
from asyncinterp.serve.http.capabilities import PROBE
from remote_helpers import Live

KEY = "caps-key"


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def served(request):
    model = tiny(request.param)
    live = Live(Server(model, api_keys=[KEY]))
    yield model, live
    live.close()


def test_capabilities_list_every_point_with_the_shapes_a_local_trace_gives(served):
    model, live = served
    r = httpx.get(f"{live.url}/v1/capabilities", headers={"authorization": f"Bearer {KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    caps = r.json()
    n = len(model.to_tokens(PROBE))
    assert caps["layers"] == len(model.layers) and caps["probe"]["tokens"] == n
    for i in range(caps["layers"]):
        for name in ("resid_pre", "resid_post", "attn.q", "attn.k", "attn.v", "attn.pattern", "mlp.post"):
            assert f"layers.{i}.{name}" in caps["points"], (name, caps["refused"].get(f"layers.{i}.{name}"))
    assert "logits" in caps["points"]

    # the shapes and dtypes equal those of a local trace, point by point (each awaited alone)
    for name, info in caps["points"].items():
        async def read(m, name=name):
            v = await m.at(name)
            return v[0] if isinstance(v, tuple) else v
        v = model.trace(PROBE, read)
        assert info["shape"] == ["n" if d == n else d for d in v.shape], name
        assert info["dtype"] == str(v.dtype).replace("torch.", ""), name
    for name, why in caps["refused"].items():
        assert why and ":" in why, (name, why)          # the refusal's type and its message
    # no mixture-of-experts block: its points are not listed as refusals
    assert not any(name.endswith(("router", "per_expert", "routed")) for name in caps["refused"])
    # computed once
    again = httpx.get(f"{live.url}/v1/capabilities", headers={"authorization": f"Bearer {KEY}"}, timeout=60)
    assert again.json() == caps


def test_capabilities_need_a_key(served):
    _, live = served
    assert httpx.get(f"{live.url}/v1/capabilities", timeout=30).status_code == 401
