"""Interventions inside a vLLM engine: three requests, continuous batching, one of them steered.

    python examples/vllm_steering.py                      # SmolLM2-135M (bundled), tensor parallel 1
    python examples/vllm_steering.py --model tiny --tp 2  # a tiny random Llama, tensor parallel 2 (CPU workers)
    python examples/vllm_steering.py --model DIR          # any local model directory vLLM can load

(SmolLM2-135M has 9 attention heads, which 2 ranks cannot split: use another model for --tp 2.)

Each invoke is one vLLM request with its own sampling parameters and its own
intervention; each intervention sees only its request's tokens. The steered
request gets a vector added to its residual stream at every step; the others
generate exactly what they generate alone. Then a logit lens and a forced token.
"""

import argparse

import torch

import asyncinterp as ai


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None,
                    help="a model directory, or 'tiny' (a random 2-layer Llama); default: the bundled SmolLM2-135M")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    ap.add_argument("--tokens", type=int, default=12)
    args = ap.parse_args()
    if args.model is None:
        from asyncinterp.models.hf.bundled import smollm2_dir
        args.model = str(smollm2_dir())
    elif args.model == "tiny":
        import tempfile
        from asyncinterp.models.hf.bundled import tiny_llama_dir
        args.model = str(tiny_llama_dir(tempfile.mkdtemp(prefix="tiny-llama-"), seed=0))

    model = ai.VLLM(args.model, dtype="float32", max_model_len=256, kv_cache_memory_bytes=128 << 20,
                    tensor_parallel_size=args.tp, seed=0)
    print(model)
    layer = len(model.model.layers) // 3

    # a steering direction: the difference of the residual stream between two prompts
    async def last_stream(m):
        return (await m.model.layers[layer].hidden)[0, -1].clone()

    happy = model.trace("I am so happy and delighted", last_stream)
    sad = model.trace("I am so sad and miserable", last_stream)
    direction = (happy - sad) / (happy - sad).norm()

    async def steer(m):
        async for _ in m.steps():                         # one iteration per engine step
            h = await m.model.layers[layer].hidden        # this request's tokens: [1, n, hidden]
            h += 8.0 * direction

    async def watch(m):
        tops = []
        async for _ in m.steps():
            tops.append(int((await m.logits).argmax()))
        return tops

    prompts = ["Today I feel", "The weather is", "My favourite food is"]
    with model.generate(max_new_tokens=args.tokens) as tr:
        plain = [tr.invoke(p, watch) for p in prompts]
    with model.generate(max_new_tokens=args.tokens) as tr:
        mixed = [tr.invoke(prompts[0], steer), tr.invoke(prompts[1], watch),
                 tr.invoke(prompts[2], watch, temperature=0.0)]
    print(f"\nsteering layer {layer} of request 0 only:")
    for p, a, b in zip(prompts, plain, mixed):
        print(f"  {p!r:24} plain: {a.text!r}\n  {'':24} run:   {b.text!r}")
    assert mixed[1].text == plain[1].text and mixed[2].text == plain[2].text

    # logit lens on the last prompt token: which token each layer's residual stream points to
    async def lens(m):
        rows = []
        for i, _ in enumerate(m.model.layers):
            h = await m.model.layers[i].hidden
            rows.append(int(m.logits_of(h[:, -1:])[0, 0].argmax()))
        return rows

    tops = model.trace("The capital of France is", lens)
    print("\nlogit lens, 'The capital of France is' ->", [model.decode(t) for t in tops[-6:]], "(last 6 layers)")

    # force a token through the sampler output: it is emitted and fed to the next step
    forced = model.token_id(" Paris")

    async def force_first(m):
        async for step in m.steps():
            await m.tokens
            if step == 0:
                m.tokens = torch.tensor([forced])

    gen = model.generate("The best city is", force_first, max_new_tokens=6)
    print("forced first token:", repr(gen.text))
    model.close()


if __name__ == "__main__":        # vLLM starts tensor-parallel workers with "spawn": keep this guard
    main()
