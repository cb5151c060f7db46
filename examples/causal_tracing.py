"""Causal tracing (activation patching) with one batched forward pass per position.

For each layer and position, the clean residual stream of "The Eiffel Tower is located in
the city of" is patched into "The Colosseum is located in the city of"; the table shows
P(" Paris"). Each forward pass holds one invoke per layer. ``asyncinterp demo`` does the same
and draws the heatmap.

    python examples/causal_tracing.py [--model tiny]
"""

from _common import load_model

model = load_model(__doc__)
clean, corrupt = "The Eiffel Tower is located in the city of", "The Colosseum is located in the city of"
target = model.to_tokens(" Paris")[0]
layers = model.model.layers


async def record(m):
    return [(await layer.output).clone() for layer in layers]


def patch(layer, state, position):
    async def fn(m):
        h = await layer.output
        h[:, position] = state[:, position]
        return (await m.lm_head.output)[0, -1].softmax(-1)[target].item()
    return fn


states = model.trace(clean, record)
tokens = [model.decode([t]) for t in model.tokenizer(clean)["input_ids"]]
table = []
for pos in range(len(tokens)):
    with model.trace() as tr:                      # one forward pass, one invoke per layer
        invokes = [tr.invoke(corrupt, patch(layer, states[i], pos), logits_to_keep=1)
                   for i, layer in enumerate(layers)]
    table.append([inv.result for inv in invokes])

print("P(' Paris') after patching layer L at one position (rows: positions; columns: every 3rd layer)")
print(" " * 10 + "".join(f"{i:>6}" for i in range(0, len(layers), 3)))
for tok, row in zip(tokens, table):
    print(f"{tok!r:>10}" + "".join(f"{row[i]:6.2f}" for i in range(0, len(layers), 3)))
