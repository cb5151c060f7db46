"""Logit lens: decode every layer's residual stream at the last position.

    python examples/logit_lens.py [--model tiny]
"""

from _common import load_model

model = load_model(__doc__)
prompt = "The Eiffel Tower is located in the city of"
paris = model.to_tokens(" Paris")[0]


async def lens(m):
    rows = []
    for i, layer in enumerate(m.model.layers):
        h = (await layer.output)[:, -1]
        probs = m.lm_head(m.model.norm(h)).softmax(-1)[0]   # ad-hoc calls fire no hook points
        rows.append((i, model.decode(probs.argmax()), probs.max().item(), probs[paris].item()))
    return rows


print(f"{'layer':>5}  {'top token':<14} {'p':>6}  {'p(Paris)':>8}")
for i, top, p, p_paris in model.trace(prompt, lens):
    print(f"{i:5d}  {top!r:<14} {p:6.3f}  {p_paris:8.4f}")
