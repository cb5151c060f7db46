"""A sparse autoencoder spliced into a language model's residual stream, with its features as hook points.

    python examples/sae_splice.py [--model tiny]

The SAE here is untrained (random weights, tied to the residual width), so the
numbers show the mechanics, not interpretable features: splicing it in,
reading its feature activations per prompt, and ablating one feature.
"""

import torch

import asyncinterp as ai
from _common import load_model

model = load_model(__doc__)
LAYER = len(model.model.layers) // 2
d = model.config.hidden_size


class SAE(torch.nn.Module):
    def __init__(self, d, k):
        super().__init__()
        self.encoder = torch.nn.Linear(d, k)
        self.act = torch.nn.ReLU()
        self.decoder = torch.nn.Linear(k, d)

    def forward(self, x):
        return self.decoder(self.act(self.encoder(x)))


torch.manual_seed(0)
sae = SAE(d, 4 * d).to(next(model.module.parameters()).dtype)
model.attach("sae", sae)


def spliced(ablate=None):
    async def intervention(m):
        async def features(m):
            f = await m.sae.act.output
            if ablate is not None:
                f[..., ablate] = 0
            return f[0, -1].clone()
        feats = await ai.spawn(features(m))
        h = await m.model.layers[LAYER].output
        m.model.layers[LAYER].output = m.sae(h)
        logits = await m.lm_head.output
        return await feats, logits[0, -1].clone()
    return intervention


prompt = "The capital of France is"
feats, logits = model.trace(prompt, spliced())
top = feats.topk(5)
print(f"SAE spliced at layer {LAYER}: top features at the last token {top.indices.tolist()}")
print(f"next token with the SAE: {model.decode(logits.argmax())!r}")
_, ablated = model.trace(prompt, spliced(ablate=int(top.indices[0])))
best = logits.argmax()
print(f"ablating feature {int(top.indices[0])}: logit of that token {logits[best]:.3f} -> {ablated[best]:.3f}")
assert not torch.equal(ablated, logits)   # the feature's edit reached the model
