"""Write docs/architectures.md: every architecture x every semantic point, as checked against the reference.

    python scripts/architectures_table.py           # rewrite docs/architectures.md
    python scripts/architectures_table.py --check   # exit 1 if the committed file differs

The table is not written by hand: it is the result of ``tests/arch_matrix.py``
(each architecture built tiny with O(1)-scale weights, every point compared
with plain torch hooks and eager attention weights). ``tests/test_architectures.py``
regenerates it and fails when the committed file differs, so it cannot drift
from the code.
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architectures.md"

SHORT = {"resid_pre": "resid_pre", "resid_mid": "resid_mid", "resid_post": "resid_post", "attn.q": "q",
         "attn.k": "k", "attn.v": "v", "attn.z": "z", "attn.pattern": "pattern", "mlp.pre": "mlp.pre",
         "mlp.post": "mlp.post", "mlp.router": "router", "mlp.routed": "routed", "embed": "embed",
         "final_norm": "final_norm", "logits": "logits", "edit resid_post": "edit resid_post",
         "edit attn.z": "edit z"}

#: causal-LM model types of transformers 5.19 not in the matrix, by why (checked by hand, see the doc)
NOT_COVERED = [
    ("encoder or encoder-decoder models offered with a causal-LM head (no decoder-only residual stream to "
     "name; not attempted)",
     "bart bert bert-generation big_bird bigbird_pegasus blenderbot blenderbot-small camembert data2vec-text "
     "electra ernie marian mbart megatron-bert mvp pegasus plbart prophetnet rembert roberta "
     "roberta-prelayernorm roc_bert roformer trocr whisper xlm xlm-roberta xlm-roberta-xl xlnet xmod "
     "modernbert-decoder"),
    ("no attention or not only attention: state-space, recurrent and hybrid layers (not attempted)",
     "bamba falcon_h1 falcon_mamba granitemoehybrid jamba kimi_linear lfm2 lfm2_moe mamba mamba2 nemotron_h "
     "olmo_hybrid qwen3_5 qwen3_5_moe qwen3_5_moe_text qwen3_5_text qwen3_next recurrent_gemma rwkv xlstm "
     "zamba zamba2"),
    ("multimodal or composite configs (a vision/audio tower or nested text config; their text models are "
     "covered where listed: gemma3_text, llama4_text)",
     "aria_text emu3 fuyu gemma3 gemma3n gemma3n_text gemma4 gemma4_assistant gemma4_text gemma4_unified "
     "gemma4_unified_assistant gemma4_unified_text git got_ocr2 llama4 mllama moshi musicgen musicgen_melody "
     "phi4_multimodal qwen4_exp qwen4_exp_text minimax_m3_vl_text cohere_compass_text inkling_text"),
    ("decoder-only, tried in this round and left out: the tiny build fails with these settings (axk1, axk2, "
     "codegen, dbrx, deepseek_v32, dots1, glm4_moe_lite, gpt_neo, longcat_flash, openai-gpt, youtu), the "
     "layers are not under a name the standard names know (biogpt, ctrl, gpt_neox_japanese, xglm: every point "
     "is a clear error there), the reference's residual formula does not fit (doge, minimax: scaled residual "
     "branches), or resid_mid / fused q/k/v are refused as not verified (cohere2_moe, flex_olmo, granitemoe_swa, "
     "granitemoeshared, hyperclovax, jetmoe, persimmon, zaya). nanochat calls its final norm module twice "
     "(after the embedding too), so the standard name `final_norm` is refused there (the error says to read "
     "`lm_head.input`)",
     "axk1 axk2 biogpt codegen cohere2_moe ctrl dbrx deepseek_v32 doge dots1 flex_olmo glm4_moe_lite gpt_neo "
     "gpt_neox_japanese granitemoe_swa granitemoeshared hyperclovax jetmoe longcat_flash minimax nanochat "
     "openai-gpt persimmon xglm youtu zaya"),
    ("decoder-only, not attempted", "blt cpmant deepseek_v4 glm_moe_dsa gpt-sw3 hrm_text hunyuan_v1_moe hy_v4 "
     "minicpm3"),
]


def _reason(note: str) -> str:
    """The refusal's own words, with module paths made generic (``layers[i].mlp``) and its label dropped."""
    text = note.split(" is not available here: ", 1)[-1]
    text = re.sub(r"^architecture '[\w-]+': ", "", text)
    text = re.sub(r"\b[\w]+(?:\.[\w]+)*\.(\d+)\.([\w.]*\w)", r"layers[i].\2", text)
    text = re.sub(r"\b[\w]+(?:\.[\w]+)*\.(\d+)\b", "layers[i]", text)
    text = re.sub(r"layers\[i\]\.(feed_forward|ffn|block_sparse_moe)\b", "layers[i].mlp", text)
    text = re.sub(r"has no '(router|routed)'", "has no 'router' / 'routed'", text)
    return text.strip()


def render(results: dict) -> str:
    sys.path.insert(0, str(ROOT / "tests"))
    import arch_matrix as am
    reasons: list[str] = []

    def ref(note):
        r = _reason(note)
        if r not in reasons:
            reasons.append(r)
        return reasons.index(r) + 1

    def symbol(status, note):
        if status == "ok":
            return "✓"
        if status == "refused":
            return f"R{ref(note)}"
        if status == "absent":
            return f"—{ref(note)}"
        if status == "skipped":
            return "·"
        return f"✗ {status.upper()}"

    counts = {"ok": 0, "refused": 0, "absent": 0, "wrong": 0, "error": 0, "unchecked": 0}
    layer_counts = dict(counts)
    rows = []
    built = [name for name in results if "build" not in results[name]]
    for name in built:
        cells = results[name]
        row = [f"`{name}`"]
        for column in am.COLUMNS:
            cell = cells[column]
            per = cell.get("per_layer") or []
            if column not in am.EDITS:
                counts[cell["status"]] += 1
                for s, _ in per:
                    layer_counts[s] += 1
            if per and len({(s, _reason(n) if s != "ok" else "") for s, n in per}) > 1:
                parts = []
                for i, (s, n) in enumerate(per):
                    sym = symbol(s, n)
                    if parts and parts[-1][0] == sym:
                        parts[-1][2] = i
                    else:
                        parts.append([sym, i, i])
                row.append(" ".join(f"{sym} L{a}" if a == b else f"{sym} L{a}–{b}" for sym, a, b in parts))
            elif column in am.EDITS and cell["status"] == "ok":
                row.append("✓")
            else:
                row.append(symbol(cell["status"], cell["note"]))
        rows.append(row)
    have = counts["ok"] + counts["refused"]
    share = 100.0 * counts["ok"] / have if have else 0.0
    lines = [
        "# Architectures: every semantic point, checked against the model",
        "",
        "<!-- generated by scripts/architectures_table.py from tests/arch_matrix.py; do not edit by hand:",
        "     tests/test_architectures.py fails when this file differs from what the code gives -->",
        "",
        f"{len(built)} causal-LM architectures of transformers 5.19, each built tiny from its own config "
        f"class ({am.LAYERS} layers, width {am.WIDTH}, {am.HEADS} heads) with O(1)-scale random weights and its "
        "special features switched on where the config allows (sliding windows, attention and final-logit "
        "soft-caps, NoPE layers, partial rotary, q/k norms, parallel residuals, multi-query attention, logit "
        "scales, MoE with a dense first layer; the settings are in `tests/arch_matrix.py`). Every point is "
        "read with asyncinterp at every layer and compared with an independent reference taken on a plain "
        "Hugging Face forward: torch forward hooks and pre-hooks on the real modules, the eager attention "
        "function's own output for `attn.z`, and `output_attentions=True` (eager attention) for "
        "`attn.pattern`. The edit columns add the same random delta at layer 1's `resid_post` / `attn.z` "
        "in place and with a hand-written torch hook, and compare the logits.",
        "",
        "Models run with `attn_implementation=\"sdpa\"` where the architecture has it (the pattern is then "
        "computed from the arguments sdpa received), except Gemma-2/3 and VaultGemma, which run eager: "
        "their sdpa path drops the attention soft-cap, so only eager computes what their config says.",
        "",
        "## Counts (architecture × point)",
        "",
        "| | cells | layer cells |",
        "|---|---|---|",
        f"| ✓ equal to the reference at every layer where the tensor exists | {counts['ok']} | "
        f"{layer_counts['ok']} |",
        f"| R refused, clearly, although the architecture computes the tensor | {counts['refused']} | "
        f"{layer_counts['refused']} |",
        f"| — refused because the architecture has no such tensor (the error says what to use) | "
        f"{counts['absent']} | {layer_counts['absent']} |",
        f"| silently wrong | {counts['wrong']} | {layer_counts['wrong']} |",
        f"| obscure error / unchecked | {counts['error'] + counts['unchecked']} | "
        f"{layer_counts['error'] + layer_counts['unchecked']} |",
        "",
        f"Of the cells where the architecture has the tensor, {share:.1f}% give a value "
        f"({counts['ok']} of {have}); the rest are clear refusals. Edits: "
        f"{sum(results[n][c]['status'] == 'ok' for n in built for c in am.EDITS)} of "
        f"{sum(results[n][c]['status'] != 'skipped' for n in built for c in am.EDITS)} edit checks equal the "
        "hand-written hook (· = the point is refused on that architecture).",
        "",
        "## The table",
        "",
        "✓ right · R*n* refused (reason *n* below) · —*n* no such tensor in this architecture (reason *n*) · "
        "L*i* layers where a cell differs by layer (MoE and dense layers)",
        "",
        "| architecture | " + " | ".join(SHORT[c] for c in am.COLUMNS) + " |",
        "|---|" + "---|" * len(am.COLUMNS),
    ]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    lines += ["", "## Reasons (the errors' own words)", ""]
    lines += [f"{i}. {r}" for i, r in enumerate(reasons, 1)]
    failed = [name for name in results if "build" in results[name]]
    lines += ["", "## Not covered", ""]
    if failed:
        lines += ["Could not be built tiny here:", ""]
        lines += [f"* `{name}`: {results[name]['build']}" for name in failed]
        lines += [""]
    lines += ["Other causal-LM model types of transformers 5.19 (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), by why "
              "they are not in the matrix:", ""]
    for why, names in NOT_COVERED:
        lines += [f"* {why}: " + ", ".join(f"`{n}`" for n in names.split())]
    lines += [
        "",
        "MoE points: `mlp.per_expert` is checked in `tests/test_moe.py` (Mixtral, Qwen2-MoE, OLMoE), not "
        "here. Blocks whose router child is itself named `router` (GPT-OSS, Granite-MoE, PhiMoE, Llama-4) "
        "answer `mlp.router` with that module (real names win): awaiting it says to await "
        "`mlp.router.output`.",
        "",
    ]
    return "\n".join(lines)


def main(argv) -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    import arch_matrix as am
    text = render(am.check_all())
    if "--check" in argv:
        same = DOC.exists() and DOC.read_text() == text
        print("docs/architectures.md is up to date" if same else "docs/architectures.md differs: regenerate it")
        return 0 if same else 1
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
