"""Memory is bounded by the shard buffer, not by the dataset: harvesting 10x more windows (from a generator
dataset, streamed) does not raise the peak RSS by anything like the size of what is written."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent('''
    import json, os, resource, sys
    import datasets, torch
    import asyncinterp as ai
    from asyncinterp.models.hf.bundled import tiny_llama

    def rss():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    def docs(n):
        for i in range(n):
            yield {"text": f"Doc {i}: " + " ".join(str((i * 7 + j) % 101) for j in range(60))}

    model, tok = tiny_llama(seed=0)
    lm = ai.LanguageModel(model.eval(), tok)
    out = sys.argv[1]
    sizes = {}
    for name, n in (("small", 40), ("large", 400)):
        data = datasets.IterableDataset.from_generator(docs, gen_kwargs={"n": n})
        r = ai.harvest(lm, data, ["layers.1.mlp.post", "blocks.0.hook_resid_post"], os.path.join(out, name), context_size=64, batch_size=8,
                       shard_windows=16, progress=False)
        sizes[name] = {"windows": r.windows, "rss_mb": rss(),
                       "bytes": sum(os.path.getsize(os.path.join(out, name, f)) for f in os.listdir(os.path.join(out, name)))}
    print(json.dumps(sizes))
''')


def test_peak_rss_does_not_grow_with_the_dataset(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "src"), TOKENIZERS_PARALLELISM="false")
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=900,
                       env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    sizes = json.loads(p.stdout.strip().splitlines()[-1])
    small, large = sizes["small"], sizes["large"]
    written = (large["bytes"] - small["bytes"]) / 2**20
    assert large["windows"] > 8 * small["windows"] and written > 20     # the large run wrote > 20 MB more
    grew = large["rss_mb"] - small["rss_mb"]
    assert grew < 0.25 * written, sizes        # a held dataset or output would add at least `written`
