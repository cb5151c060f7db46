"""The API reference builds from the docstrings with warnings as errors, and covers the public API."""

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_api_reference_builds_without_warnings(tmp_path):
    out = tmp_path / "api"
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(ROOT / "scripts" / "build_api_docs.py"), "--out", str(out)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log
    assert "warn" not in log.lower(), log

    def page(name):
        return (out / name).read_text()

    top = page("asyncinterp.html")
    for name in ("wrap", "Model.trace", "Model.atrace", "LanguageModel", "Cache", "Future", "gather", "scan",
                 "VLLM", "ReplacementError"):
        assert f'id="{name}"' in top, name
    serve = page("asyncinterp/serve.html")
    for name in ("Batcher", "Batcher.trace", "Server", "Client"):
        assert f'id="{name}"' in serve, name
    models = page("asyncinterp/models.html")
    for name in ("LanguageModel", "smollm2", "tiny", "VLLM"):
        assert f'id="{name}"' in models, name
    assert 'id="VLLM"' in page("asyncinterp/models/vllm.html")
    kernel = page("asyncinterp/kernel.html")
    for name in ("Future", "AsyncInterpError", "MissedHookPoint"):
        assert f'id="{name}"' in kernel, name
    assert 'id="RunHost"' in page("asyncinterp/hooks/host.html")


def test_broken_cross_reference_is_caught():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import build_api_docs as b
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert b._resolves("StopForward", "asyncinterp.run", "Run.start", False)
    assert b._resolves("close", "asyncinterp.client.clients", "Client", True)
    assert b._resolves("asyncinterp.hooks.host.RunHost", "asyncinterp", "", False)
    assert not b._resolves("NoSuchThing", "asyncinterp.run", "Run.start", False)
