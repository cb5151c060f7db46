"""Steering during generation, and per-step reads of the logits and chosen tokens.

    python examples/steering_generation.py [--model tiny]
"""

import torch

from _common import load_model

model = load_model(__doc__)
LAYER = min(8, len(model.model.layers) - 1)


async def mean_state(m):
    return (await m.model.layers[LAYER].output)[0, 1:].mean(0).clone()


def mean_over(texts):
    return torch.stack([model.trace(t, mean_state) for t in texts]).mean(0)


direction = mean_over(["The ocean waves crashed on the beach and the sea was blue.",
                       "Sharks and whales swim deep in the sea.", "We sailed the boat across the ocean."]) \
    - mean_over(["The city streets were busy and the traffic was loud.",
                 "Cars and buses drive along the road.", "We drove the car across the country."])


def steer(scale):
    async def steering(m):
        confidence = []
        async for _ in m.steps():                    # one iteration per forward pass
            h = await m.model.layers[LAYER].output
            if h.shape[1] > 1:
                h[:, 1:] += scale * direction        # the prompt pass
            else:
                h += scale * direction               # each new token
            probs = (await m.logits).softmax(-1)     # the scores the next token is chosen from
            token = await m.tokens                   # the token chosen at this step
            confidence.append(round(probs[0, token].item(), 2))
        return confidence                            # the loop ends when generation ends
    return steering


prompt = "I went to the store and"
for scale in (0.0, 2.0):
    gen = model.generate(prompt, steer(scale), max_new_tokens=16)
    print(f"scale {scale}: {gen.text!r}\n  p(chosen token) per step: {gen.result}")
