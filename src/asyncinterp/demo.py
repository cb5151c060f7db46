"""``asyncinterp demo``: real interpretability on a real model, in well under two minutes.

On SmolLM2-135M-Instruct (bundled, offline) it shows

1. the model's answer to "The capital of France is";
2. **causal tracing** (activation patching): the clean prompt "The Eiffel
   Tower is located in the city of" and the corrupted "The Colosseum is
   located in the city of" differ only in the subject. Each layer's clean
   residual stream is patched into the corrupted run, at the subject tokens
   together and at each single position, and P(" Paris") is measured. All
   patched runs of one position are invokes of one batched forward pass;
3. the **logit lens**: what each layer's residual stream at the last
   position would predict if decoded directly;
4. **steering during generation**: a direction (mean activation difference
   of ocean vs. city sentences) added to one layer at every step.

Tables go to stdout, a heatmap to ``<out>/causal_trace.png`` and the numbers
to ``<out>/causal_trace.csv``. The functions here are also a worked example
of the library; each is short and uses only the public API.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field

import torch

CLEAN = "The Eiffel Tower is located in the city of"
CORRUPT = "The Colosseum is located in the city of"
TARGET = " Paris"
QUESTION = "The capital of France is"
STEER_PROMPT = "I went to the store and"
OCEAN = ["The ocean waves crashed on the beach and the sea was blue.",
         "Sharks and whales swim deep in the sea.",
         "We sailed the boat across the ocean."]
CITY = ["The city streets were busy and the traffic was loud.",
        "Cars and buses drive along the road.",
        "We drove the car across the country."]


def _layers(lm):
    """The list of transformer blocks of a Llama- or GPT-2-style model."""
    if hasattr(lm.module, "model") and hasattr(lm.module.model, "layers"):
        return lm.model.layers
    return lm.transformer.h


def _progress(iterable, desc, enabled, total=None):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm
    return tqdm(iterable, desc=desc, total=total, leave=False, file=sys.stderr)


def target_id(lm, text: str) -> int:
    """The first token of ``text`` (the demo's target must start with it)."""
    return lm.to_tokens(text)[0]


# --------------------------------------------------------------------------- causal tracing

def record_layers(lm, prompt):
    """Every block's output (the residual stream) for ``prompt``, plus the final next-token probabilities."""
    layers = _layers(lm)

    async def record(m):
        states = [(await layer.output).clone() for layer in layers]
        probs = (await m.lm_head.output)[:, -1].softmax(-1)
        return states, probs[0]
    return lm.trace(prompt, record, logits_to_keep=1)


def _patch(layer, positions, clean_state, target):
    async def patch(m):
        h = await layer.output
        h[:, positions] = clean_state[:, positions]
        return float((await m.lm_head.output)[0, -1].softmax(-1)[target])
    return patch


def patch_runs(lm, corrupt, clean_states, target, positions, progress=False, desc="patching"):
    """P(target) after patching each layer's clean state at ``positions`` into ``corrupt``.

    ``positions`` is a list of position lists; the result has one row per
    layer and one column per entry. Each entry is one forward pass with one
    invoke per layer.
    """
    layers = _layers(lm)
    out = torch.zeros(len(layers), len(positions))
    for j in _progress(range(len(positions)), desc, progress):
        with lm.trace() as tr:
            invs = [tr.invoke(corrupt, _patch(layer, positions[j], clean_states[i], target), logits_to_keep=1)
                    for i, layer in enumerate(layers)]
        for i, inv in enumerate(invs):
            out[i, j] = inv.result
    return out


def subject_positions(lm, clean, corrupt):
    """Positions where the two prompts' tokens differ (they must have the same length)."""
    a = lm.tokenizer(clean)["input_ids"]
    b = lm.tokenizer(corrupt)["input_ids"]
    if len(a) != len(b):
        raise ValueError(f"the clean and corrupted prompts must have the same number of tokens "
                         f"({len(a)} vs {len(b)}) so that positions can be patched one to one")
    return [i for i, (x, y) in enumerate(zip(a, b)) if x != y]


@dataclass
class Tracing:
    tokens: list            # clean prompt tokens (strings)
    subject: list           # subject positions
    by_position: torch.Tensor  # [layers, positions]
    by_subject: torch.Tensor   # [layers]
    p_clean: float
    p_corrupt: float


def causal_trace(lm, clean=CLEAN, corrupt=CORRUPT, target=TARGET, progress=False) -> Tracing:
    """Patch every layer's clean residual stream into the corrupted run: at all subject tokens, and at each position.

    Positions before the first subject token hold the same states in both
    runs (the prompts agree up to there and attention is causal), so they are
    not run: patching them cannot change anything.
    """
    tid = target_id(lm, target)
    subject = subject_positions(lm, clean, corrupt)
    states, p_clean = record_layers(lm, clean)
    _, p_corrupt = record_layers(lm, corrupt)
    n = states[0].shape[1]
    first = subject[0] if subject else 0
    cols = [subject] + [[p] for p in range(first, n)]
    table = patch_runs(lm, corrupt, states, tid, cols, progress, desc="causal tracing")
    by_position = torch.full((table.shape[0], n), float(p_corrupt[tid]))
    by_position[:, first:] = table[:, 1:]
    tokens = [lm.decode([t]) for t in lm.tokenizer(clean)["input_ids"]]
    return Tracing(tokens, subject, by_position, table[:, 0], float(p_clean[tid]), float(p_corrupt[tid]))


def format_tracing(tr: Tracing, target=TARGET) -> str:
    labels = [repr(t)[1:-1].strip() or "_" for t in tr.tokens]
    labels = [("*" + lab if i in tr.subject else lab)[:7] for i, lab in enumerate(labels)]
    head = "layer | subj* | " + " ".join(f"{lab:>7}" for lab in labels)
    lines = [f"P({target!r}) clean {tr.p_clean:.3f}, corrupted {tr.p_corrupt:.3f}; "
             f"after patching the clean residual stream into the corrupted run:", head, "-" * len(head)]
    for i in range(tr.by_position.shape[0]):
        row = " ".join(f"{float(v):7.3f}" for v in tr.by_position[i])
        lines.append(f"{i:5d} | {float(tr.by_subject[i]):5.3f} | {row}")
    lines.append("(* = subject tokens; 'subj*' patches all subject tokens at once)")
    return "\n".join(lines)


def save_heatmap(tr: Tracing, path, target=TARGET, corrupt=CORRUPT) -> str:
    """Save the layer x position heatmap of P(target) (plus the all-subject-tokens row) as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = tr.by_position.T.numpy()  # positions x layers
    top = tr.by_subject[None, :].numpy()
    labels = [repr(t)[1:-1] + (" *" if i in tr.subject else "") for i, t in enumerate(tr.tokens)]
    vmax = max(1e-6, float(data.max()), float(top.max()))
    width = max(6.0, 0.28 * data.shape[1] + 3)
    fig, (ax0, ax) = plt.subplots(2, 1, figsize=(width, 0.45 * data.shape[0] + 2.4), dpi=120, sharex=True,
                                  gridspec_kw={"height_ratios": [1, data.shape[0]], "hspace": 0.08})
    ax0.imshow(top, cmap="Purples", vmin=0.0, vmax=vmax, aspect="auto")
    ax0.set_yticks([0], ["all subject *"])
    ax0.set_title(f"Causal tracing: P({target!r}) in the corrupted run {corrupt!r}\n"
                  "after patching one layer's clean residual stream (* = subject tokens)", fontsize=10)
    im = ax.imshow(data, cmap="Purples", vmin=0.0, vmax=vmax, aspect="auto")
    ax.set_yticks(range(len(labels)), labels)
    ax.set_xticks(range(0, data.shape[1], 2 if data.shape[1] > 16 else 1))
    ax.set_xlabel("layer whose clean output is patched in (single position per row)")
    fig.colorbar(im, ax=[ax0, ax], label=f"P({target!r})", fraction=0.04, pad=0.02)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)
    return str(path)


def save_csv(tr: Tracing, path) -> str:
    with open(path, "w") as f:
        f.write("layer,subject," + ",".join(f"pos{i}" for i in range(len(tr.tokens))) + "\n")
        for i in range(tr.by_position.shape[0]):
            f.write(f"{i},{float(tr.by_subject[i]):.6f}," +
                    ",".join(f"{float(v):.6f}" for v in tr.by_position[i]) + "\n")
    return str(path)


# --------------------------------------------------------------------------- logit lens

def logit_lens(lm, prompt=CLEAN, target=TARGET):
    """Per layer: the top next-token guess (decoded through final norm + lm_head) and P(target)."""
    layers = _layers(lm)
    tid = target_id(lm, target)
    norm = lm.model.norm if hasattr(lm.module, "model") else lm.transformer.ln_f

    async def lens(m):
        rows = []
        for layer in layers:
            h = (await layer.output)[:, -1]
            probs = m.lm_head(norm(h)).softmax(-1)[0]   # ad-hoc call: no hook points fire
            top = int(probs.argmax())
            rows.append((top, float(probs[top]), float(probs[tid]), int((probs > probs[tid]).sum()) + 1))
        return rows
    return lm.trace(prompt, lens)


def format_lens(lm, rows, target=TARGET) -> str:
    lines = [f"layer | top token            p(top) | p({target!r}) rank", "-" * 50]
    for i, (top, p_top, p_t, rank) in enumerate(rows):
        tok = repr(lm.decode([top]))[:20]
        lines.append(f"{i:5d} | {tok:<20} {p_top:6.3f} | {p_t:9.4f} {rank:6d}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- steering

def mean_direction(lm, layer_index, positive, negative, progress=False):
    """Mean residual-stream difference (tokens after the first) between two sets of sentences."""
    layer = _layers(lm)[layer_index]

    async def mean_state(m):
        return (await layer.output)[0, 1:].mean(0).clone()

    texts = [(t, 1.0 / len(positive)) for t in positive] + [(t, -1.0 / len(negative)) for t in negative]
    total = 0
    for text, weight in _progress(texts, "steering vector", progress):
        total = total + weight * lm.trace(text, mean_state)
    return total


def steer(layer, vector, scale):
    """An intervention adding ``scale * vector`` to ``layer``'s output at every generation step."""
    async def steering(m):
        async for _ in m.steps():
            h = await layer.output
            if h.shape[1] > 1:
                h[:, 1:] += scale * vector   # prefill: every prompt token but the first (attention sink)
            else:
                h += scale * vector          # decode: the one new token
    return steering


# --------------------------------------------------------------------------- the demo

@dataclass
class DemoResult:
    answer: str
    tracing: Tracing
    lens: list
    baseline: str
    steered: str
    files: list = field(default_factory=list)
    seconds: float = 0.0


def run_demo(lm=None, out_dir="asyncinterp-demo", progress=True, print_fn=print,
             steer_layer=None, steer_scale=2.0, new_tokens=20) -> DemoResult:
    """Run every part of the demo on ``lm`` (default: bundled SmolLM2) and print the results."""
    start = time.perf_counter()
    if lm is None:
        from .models import smollm2
        print_fn("Loading SmolLM2-135M-Instruct (bundled; converted once on first use) ...")
        lm = smollm2()
    os.makedirs(out_dir, exist_ok=True)
    n_layers = len(_layers(lm))
    steer_layer = min(8, n_layers - 1) if steer_layer is None else steer_layer
    grad = torch.no_grad()
    with grad:
        answer = lm.generate(QUESTION, max_new_tokens=1).text
        print_fn(f"\n== 1. Next token ==\n{QUESTION!r} -> {answer!r}")

        print_fn(f"\n== 2. Causal tracing (activation patching, {n_layers} layers) ==")
        t0 = time.perf_counter()
        tr = causal_trace(lm, progress=progress)
        print_fn(format_tracing(tr))
        passes = tr.by_position.shape[1] - (tr.subject[0] if tr.subject else 0) + 1
        print_fn(f"{passes * n_layers} patched runs in {passes} batched forward passes (one invoke per layer), "
                 f"{time.perf_counter() - t0:.1f} s")
        png = save_heatmap(tr, os.path.join(out_dir, "causal_trace.png"))
        csv = save_csv(tr, os.path.join(out_dir, "causal_trace.csv"))
        print_fn(f"heatmap: {png}\nnumbers: {csv}")

        print_fn(f"\n== 3. Logit lens on {CLEAN!r} (last position) ==")
        lens = logit_lens(lm)
        print_fn(format_lens(lm, lens))

        print_fn(f"\n== 4. Steering during generation (layer {steer_layer}, ocean - city direction) ==")
        vector = mean_direction(lm, steer_layer, OCEAN, CITY, progress)
        layer = _layers(lm)[steer_layer]
        baseline = lm.generate(STEER_PROMPT, max_new_tokens=new_tokens).text
        steered = lm.generate(STEER_PROMPT, steer(layer, vector, steer_scale), max_new_tokens=new_tokens).text
        print_fn(f"prompt:   {STEER_PROMPT!r}\nbaseline: {baseline!r}\nsteered:  {steered!r}  "
                 f"(+{steer_scale} x direction at every step)")
    seconds = time.perf_counter() - start
    print_fn(f"\nDone in {seconds:.1f} s. Files in {os.path.abspath(out_dir)}")
    return DemoResult(answer, tr, lens, baseline, steered, [png, csv], seconds)


@contextlib.contextmanager
def _quiet_transformers():
    """Silence transformers' progress bars and advisory warnings during the demo."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:  # pragma: no cover
        yield
        return
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


def main(args) -> int:
    """Entry point of ``asyncinterp demo`` (``args`` from the CLI's parser)."""
    from .models import smollm2, tiny
    with _quiet_transformers():
        if args.model == "smollm2":
            print("Loading SmolLM2-135M-Instruct (bundled; converted once on first use) ...", flush=True)
            lm = smollm2(cache_dir=args.cache_dir, rebuild=args.rebuild)
        elif args.model in ("tiny", "tiny-llama", "tiny-gpt2"):
            lm = tiny("gpt2" if args.model == "tiny-gpt2" else "llama")
        else:
            from .models.hf.language import LanguageModel
            lm = LanguageModel.from_pretrained(args.model)
        run_demo(lm, out_dir=args.out, progress=not args.no_progress)
    return 0
