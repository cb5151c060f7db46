"""Interventions the serving benchmark registers on ``asyncinterp serve --interventions`` (benchmarks/serving_vllm.py).

``read_norm`` is the per-step read of one layer with a small answer (one float
per step), so that the benchmark measures the intervention, not the transfer of
18,000 floats per request that the built-in ``read`` returns. ``calm`` is the named
edit of the "ai named edit" case (installed with ``--edit``, chosen by model name).
"""

from asyncinterp.serve import ModulePath


async def read_norm(m, module: ModulePath):
    target = m
    for part in module.split("."):
        target = target.child(part)
    norms = []
    async for _ in m.steps():
        out = await target.output
        h = out[0] if isinstance(out, tuple) else out
        norms.append(float(h[:, -1].norm()))
    return norms


async def calm(m):
    """A named edit (``--edit calm=serving_vllm_interventions.py:calm``): scale layer 15's residual stream by
    0.98 at every position, once per forward pass."""
    h = await m.model.layers[15].hidden
    h.mul_(0.98)


def register(server):
    server.intervention("read_norm")(read_norm)
