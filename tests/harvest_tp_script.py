"""Run by tests/test_harvest_tp.py on 2 ranks: ai.harvest on a tensor-parallel Llama (tp_plan="auto")."""

import sys

from transformers import AutoModelForCausalLM, AutoTokenizer

import asyncinterp as ai
from asyncinterp import distributed as tp


def main(model_dir, data, out):
    tp.init(timeout=60)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, tp_plan="auto", attn_implementation="eager").eval()
    model = ai.LanguageModel(hf, AutoTokenizer.from_pretrained(model_dir))
    res = ai.harvest(model, data, ["blocks.1.hook_resid_post", "layers.0.attn.q", "layers.1.mlp.post"], out,
                     context_size=16, batch_size=4, shard_windows=8, progress=False)
    print(f"rank {tp.rank()} windows {res.windows} shards {res.shards} engine {res.manifest['engine']}", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:4])
