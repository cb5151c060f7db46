"""What a user who installed only ``asyncinterp[remote]`` runs against a live server (``tests/test_remote_install.py``).

Run as a script: ``python remote_client_script.py URL API_KEY``. It uses ``ai.remote`` (a global client
tensor; two invokes sharing a future; a registered intervention; a session) and ``ai.serve.Client``, then prints
one JSON line: the results (a kept job's too: ``blocking=False``), and every module of ``asyncinterp``, the server's frameworks and the model libraries
that this process loaded (the test checks that none is a server module).
"""

import json
import sys

import torch

import asyncinterp as ai

PROMPT = "The Eiffel Tower is in the city of"


async def sweep(model, layers=(1, 0)):
    """A session: a clean run, then patched runs, the clean activations flowing between them."""
    async def record(m):
        return [(await m.transformer.h[i].output)[:, -1].clone() for i in range(len(m.transformer.h))]

    clean = await model.atrace(PROMPT, record)
    out = []
    for layer in layers:
        async def patch(m, layer=layer):
            h = await m.transformer.h[layer].output
            h[:, -1] = clean[layer]
            return (await m.lm_head.output)[:, -1].softmax(-1).max()
        out.append(float(await model.atrace("The Colosseum is in the city of", patch)))
    return out


DIRECTION = torch.linspace(-1.0, 1.0, 64)


async def steer(m):
    """Steering by a client tensor the function reads as a global (it travels with the job)."""
    h = await m.transformer.h[1].output
    h[:] = h + 4.0 * DIRECTION
    return (await m.lm_head.output)[:, -1].clone()


def patching(lm):
    """Two invokes of one trace sharing a future: activation patching (its patched probabilities)."""
    clean = ai.Future()

    async def record(m):
        clean.set_result((await m.transformer.h[1].output).clone())

    async def patch(m):
        h = await m.transformer.h[1].output
        h[:, -1] = (await clean)[:, -1]
        return (await m.lm_head.output)[:, -1].softmax(-1)

    with lm.trace() as tr:
        tr.invoke(PROMPT, record)
        patched = tr.invoke("The Colosseum is in the city of", patch)
    return patched.result


def main(url, key):
    lm = ai.remote(url, api_key=key)
    try:
        steered = lm.trace(PROMPT, steer)
        patched = patching(lm)
        top = lm.trace(PROMPT, lm.registered("top_k", k=3))
        session = lm.session(sweep)
        job = lm.trace(PROMPT, steer, blocking=False)       # a kept job (the server has --state-dir)
        kept = lm.job(job.id).result(timeout=120)            # reattached by its id
        kept_state = job.status().state
    finally:
        lm.close()
    with ai.serve.Client(url, api_key=key) as client:
        named = client.trace(PROMPT, "top_k", k=3)
    prefixes = ("asyncinterp", "starlette", "uvicorn", "pyseccomp", "prometheus_client", "transformers", "ray",
                "vllm", "sqlalchemy")
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in prefixes)
    print(json.dumps({"steered": steered.tolist(), "patched": patched.tolist(), "top": _plain(top),
                      "named": _plain(named), "session": session, "modules": loaded,
                      "kept": kept.tolist(), "kept_state": kept_state,
                      "asyncinterp": ai.__file__}))


def _plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
