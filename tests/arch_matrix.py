"""Every causal-LM architecture built tiny, every semantic point checked against an independent reference.

Used by ``tests/test_architectures.py`` and ``scripts/architectures_table.py``
(which writes docs/architectures.md from :func:`check_all`).

Each architecture is built from its own config class: 3 layers, width 32,
O(1)-scale random weights (HF's 0.02 init makes every wrong scale, missing
rotary or soft-cap invisible), with its special features switched on where
the config allows: sliding windows, attention and final logit soft-caps,
NoPE layers, partial rotary, q/k norms, parallel residuals, multi-query
attention, logit scales, MoE with a dense first layer.

The reference is *not* asyncinterp: plain torch hooks on one Hugging Face
forward (``register_forward_hook`` / ``register_forward_pre_hook`` on the
real modules), the eager attention function's own output for ``attn.z`` and
``output_attentions=True`` (eager attention) for ``attn.pattern``. The q/k/v
layouts of fused projections are written out here from the modeling files,
separately from ``asyncinterp.hooks.archs``.
"""

from __future__ import annotations

import sys
import time
import traceback

import torch
from transformers import AutoConfig, AutoModelForCausalLM

import asyncinterp as ai
from asyncinterp.hooks.semantic import PointUnavailableError
from asyncinterp.kernel.errors import ModulePathError

WIDTH, HEADS, KV, HEAD_DIM, FFN, VOCAB, LAYERS = 32, 4, 2, 8, 64, 96, 3
N = 7
COMMON = dict(vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=FFN, num_hidden_layers=LAYERS,
              num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HEAD_DIM, max_position_embeddings=64,
              pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
_MOE = dict(num_local_experts=4, num_experts_per_tok=2)
_FEW = dict(num_experts_per_tok=2, moe_intermediate_size=32)
_QMOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
             mlp_only_layers=[0], norm_topk_prob=True)

#: model_type -> config keywords (on top of COMMON) that switch its special features on
ARCHITECTURES: dict[str, dict] = {
    "llama": {}, "mistral": dict(sliding_window=4), "qwen2": dict(use_sliding_window=True, sliding_window=4,
                                                                   max_window_layers=1),
    "qwen3": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
    "gemma": {}, "gemma2": dict(sliding_window=4, attn_logit_softcapping=3.0, final_logit_softcapping=2.0,
                                query_pre_attn_scalar=8),
    "gemma3_text": dict(sliding_window=4, attn_logit_softcapping=3.0, final_logit_softcapping=2.0,
                        query_pre_attn_scalar=8, layer_types=["sliding_attention", "full_attention",
                                                              "sliding_attention"]),
    "vaultgemma": dict(sliding_window=4, attn_logit_softcapping=3.0, final_logit_softcapping=2.0,
                       query_pre_attn_scalar=8),
    "qwen2_moe": dict(_QMOE, shared_expert_intermediate_size=32),
    "qwen3_moe": dict(_QMOE), "mixtral": dict(_MOE, sliding_window=4),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2), "granitemoe": dict(_MOE, logits_scaling=2.0),
    "phimoe": dict(_MOE), "gpt_oss": dict(_MOE, sliding_window=4),
    "llama4_text": dict(num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
                        intermediate_size_mlp=FFN, no_rope_layers=[1, 0, 1], attn_temperature_tuning=True,
                        floor_scale=2, attention_chunk_size=4, use_qk_norm=True),
    "phi": dict(partial_rotary_factor=0.5, qk_layernorm=True),
    "phi3": dict(partial_rotary_factor=0.5, sliding_window=4),
    "gpt_neox": dict(partial_rotary_factor=0.25, use_parallel_residual=True),
    "gptj": dict(rotary_dim=4, n_positions=64),
    "opt": dict(ffn_dim=FFN, word_embed_proj_dim=WIDTH, dropout=0.0, do_layer_norm_before=True),
    "falcon": dict(parallel_attn=True, multi_query=True, alibi=False),
    "olmo": dict(clip_qkv=3.0), "olmo2": {}, "olmo3": dict(sliding_window=4),
    "deepseek_v2": dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                        first_k_dense_replace=1, head_dim=4, num_key_value_heads=HEADS),
    "deepseek_v3": dict(q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=32,
                        first_k_dense_replace=1, n_group=2, topk_group=1, head_dim=4, num_key_value_heads=HEADS),
    "bloom": {}, "gpt_bigcode": dict(multi_query=True, n_positions=64), "starcoder2": dict(sliding_window=4),
    "cohere": dict(use_qk_norm=True, logit_scale=0.5), "cohere2": dict(logit_scale=0.5, sliding_window=4),
    "granite": dict(logits_scaling=2.0, attention_multiplier=0.2, residual_multiplier=0.7,
                    embedding_multiplier=1.5),
    "smollm3": dict(no_rope_layer_interval=2), "glm": dict(partial_rotary_factor=0.5), "glm4": {},
    "exaone4": dict(sliding_window=4, sliding_window_pattern=2),
    "stablelm": dict(partial_rotary_factor=0.25, use_parallel_residual=True, qk_layernorm=True),
    "mpt": dict(attn_config={"alibi": True}, expansion_ratio=2, max_seq_len=64),
    "gpt2": dict(n_positions=64), "helium": {}, "ernie4_5": {}, "seed_oss": {}, "arcee": {}, "apertus": {},
    "ministral": dict(sliding_window=4), "hunyuan_v1_dense": {}, "nemotron": {}, "bitnet": {},
    "cwm": dict(sliding_window=4), "granite_swa": {}, "jais2": {}, "ministral3": {}, "diffllama": {},
    "ernie4_5_moe": dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1),
    "exaone_moe": dict(_FEW, num_experts=4, num_shared_experts=1), "glm4_moe": dict(_FEW, n_routed_experts=4),
    "laguna": dict(_FEW, num_experts=4, shared_expert_intermediate_size=32), "mellum": dict(_FEW, **_MOE),
    "minimax_m2": dict(_FEW, **_MOE), "solar_open": dict(_FEW, n_routed_experts=4),
    "hy_v3": dict(_FEW, num_experts=4), "mimo_v2_flash": dict(_FEW, n_routed_experts=4),
    "afmoe": dict(_FEW, num_experts=4, num_shared_experts=1),
}

#: config keys of COMMON an architecture computes itself (setting them fails)
NOT_SETTABLE = {"falcon": ("head_dim",), "mpt": ("head_dim",), "bloom": ("head_dim",), "gptj": ("head_dim",)}
#: residual branches scaled before the add (Granite's residual_multiplier): config attribute
BRANCH_SCALE = {"granite": "residual_multiplier", "granitemoe": "residual_multiplier"}
#: run with eager attention: their sdpa path drops the attention soft-cap, so only eager computes what the
#: config says (the reference is eager); every other architecture runs sdpa and is checked against eager
EAGER = {"gemma2", "gemma3_text", "vaultgemma"}
#: the fused q/k/v layouts, from the modeling files (reference side): attention child -> how to cut it
FUSED = {
    "gpt2": ("c_attn", "thirds"), "gpt_bigcode": ("c_attn", "mqa"), "phi3": ("qkv_proj", "gqa"),
    "gpt_neox": ("query_key_value", "heads3"), "bloom": ("query_key_value", "heads3"),
    "falcon": ("query_key_value", "falcon_mq"), "mpt": ("Wqkv", "thirds"),
}
#: architectures without a per-head q/k/v projection (MLA): q/k/v exist but are not projection outputs
MLA = {"deepseek_v2", "deepseek_v3"}
#: the attention output projection of the architectures that do not use transformers' attention interface
OUT_PROJ = {"gptj": "out_proj", "falcon": "dense", "bloom": "dense", "mpt": "out_proj"}
#: layers whose MLP adds the residual itself (its second argument is resid_mid)
MLP_TAKES_RESIDUAL = {"bloom", "mpt"}
#: parallel attention + MLP (config attribute, or always)
PARALLEL = {"gptj": True, "phi": True, "cohere": True, "cohere2": True, "gpt_neox": "use_parallel_residual",
            "stablelm": "use_parallel_residual", "falcon": "parallel_attn"}

LAYER_POINTS = ["resid_pre", "resid_mid", "resid_post", "attn.q", "attn.k", "attn.v", "attn.z", "attn.pattern",
                "mlp.pre", "mlp.post", "mlp.router", "mlp.routed"]
MODEL_POINTS = ["embed", "final_norm", "logits"]
EDITS = ["edit resid_post", "edit attn.z"]
COLUMNS = LAYER_POINTS + MODEL_POINTS + EDITS


def build(model_type: str):
    """The tiny model of ``model_type`` with O(1)-scale weights (float32, eval, sdpa where supported)."""
    kw = {**COMMON, **ARCHITECTURES[model_type]}
    for k in NOT_SETTABLE.get(model_type, ()):
        kw.pop(k)
    cfg = AutoConfig.for_model(model_type, **kw)
    for k, v in kw.items():          # old configs ignore canonical names they map (n_embd...): set them again
        if isinstance(v, dict):
            continue
        try:
            setattr(cfg, k, v)
        except (AttributeError, TypeError, ValueError):
            pass
    torch.manual_seed(0)
    try:
        net = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager" if model_type in EAGER else "sdpa")
    except (ValueError, ImportError):          # no sdpa path in this architecture (GPT-J, BLOOM...)
        net = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.dim() >= 2:
                fan = p.shape[-1] if p.shape[-1] > 1 else p.shape[0]
                scale = 1.0 if "embed" in name or "wte" in name or "wpe" in name else 1.5 / fan ** 0.5
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
            elif name.endswith("bias") or "sinks" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
            else:
                p.copy_(0.6 + 0.8 * torch.rand(p.shape, generator=gen))
    return net.eval()


def _set_eager(net):
    try:
        net.set_attn_implementation("eager")
    except Exception:  # noqa: BLE001 - older classes: set it on every config
        pass
    for mod in net.modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            try:
                cfg._attn_implementation = "eager"
            except Exception:  # noqa: BLE001
                pass


def _set_sdpa(net, impl):
    for mod in net.modules():
        cfg = getattr(mod, "config", None)
        if cfg is not None and hasattr(cfg, "_attn_implementation"):
            try:
                cfg._attn_implementation = impl
            except Exception:  # noqa: BLE001
                pass


def _layers(net):
    for _, mod in net.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) == LAYERS:
            return mod
    raise RuntimeError("no list of decoder layers")


def _child_by_class(layer, *words):
    for name in ("mlp", "feed_forward", "block_sparse_moe", "ffn") if "MLP" in words else ():
        if hasattr(layer, name) and isinstance(getattr(layer, name), torch.nn.Module):
            return name, getattr(layer, name)
    for name, mod in layer.named_children():
        if any(w in type(mod).__name__ for w in words):
            return name, mod
    return None, None


def _first(x):
    return x[0] if isinstance(x, tuple) else x


def _is_proj(mod):
    w = getattr(mod, "weight", None)
    return isinstance(w, torch.Tensor) and w.dim() == 2 and not isinstance(mod, torch.nn.Embedding)


def _heads_of(t, parts, index, hd, heads):
    """Cut a fused q/k/v output ``t`` ([b, n, width]) into ``[b, n, h, hd]`` as the model's attention does."""
    if parts == "thirds":
        return t.chunk(3, dim=-1)[index].unflatten(-1, (-1, hd))
    if parts in ("mqa", "gqa"):
        kvw = (t.shape[-1] - heads * hd) // 2
        return t.split([heads * hd, kvw, kvw], dim=-1)[index].unflatten(-1, (-1, hd))
    if parts == "heads3":
        return t.unflatten(-1, (heads, 3 * hd)).split(hd, dim=-1)[index]
    if parts == "falcon_mq":
        t = t.unflatten(-1, (heads + 2, hd))
        return [t[..., :heads, :], t[..., heads:heads + 1, :], t[..., heads + 1:, :]][index]
    raise ValueError(parts)


def reference(net, model_type, ids):
    """Every point's reference value, ``{(column, layer): tensor}``, from plain torch hooks and eager attention."""
    ref = {}
    handles = []
    layers = _layers(net)
    cfg = net.config
    heads = cfg.num_attention_heads
    last_child = {}

    def keep(key):
        def store(v):
            ref[key] = v.detach().clone()
        return store

    for i, layer in enumerate(layers):
        def pre(mod, args, kwargs, i=i):
            keep(("resid_pre", i))(args[0] if args else kwargs["hidden_states"])

        def post(mod, args, out, i=i):
            keep(("resid_post", i))(_first(out))
        handles.append(layer.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(layer.register_forward_hook(post))
        for cname, child in layer.named_children():
            if isinstance(child, torch.nn.Dropout):
                continue

            def called(mod, args, kwargs, out, i=i, cname=cname):
                last_child[i] = (cname, _first(out), args, kwargs)
            handles.append(child.register_forward_hook(called, with_kwargs=True))
        aname, attn = _child_by_class(layer, "Attention")
        if model_type in FUSED:
            fused, parts = FUSED[model_type]
            hd = getattr(attn, "head_dim", None) or cfg.hidden_size // heads

            def qkv(mod, args, out, i=i, parts=parts, hd=hd):
                for j, n in enumerate("qkv"):
                    keep((f"attn.{n}", i))(_heads_of(_first(out), parts, j, hd, heads))
            handles.append(getattr(attn, fused).register_forward_hook(qkv))
        elif model_type not in MLA:
            for n in "qkv":
                proj = getattr(attn, f"{n}_proj", None)
                if proj is not None:
                    hd = getattr(attn, "head_dim", None) or cfg.hidden_size // heads
                    handles.append(proj.register_forward_hook(
                        lambda mod, args, out, key=(f"attn.{n}", i), hd=hd: keep(key)(out.unflatten(-1, (-1, hd)))))
        if model_type in OUT_PROJ:
            handles.append(getattr(attn, OUT_PROJ[model_type]).register_forward_pre_hook(
                lambda mod, args, i=i: keep(("attn.z", i))(args[0].unflatten(-1, (heads, -1)))))
        _, mlp = _child_by_class(layer, "MLP", "Moe", "MoE", "FeedForward", "Mlp")
        if mlp is not None and hasattr(mlp, "experts") and hasattr(mlp, "gate"):
            handles.append(mlp.gate.register_forward_hook(
                lambda mod, args, out, i=i: keep(("mlp.router", i))(_first(out).view(*ref[("resid_pre", i)].shape[:2], -1))))
            handles.append(mlp.experts.register_forward_hook(
                lambda mod, args, out, i=i: keep(("mlp.routed", i))(_first(out).view(*ref[("resid_pre", i)].shape[:2], -1))))
        elif mlp is not None:
            calls = []

            def on_child(mod, args, out, calls=calls):
                calls.append((mod, args[0] if args else None))
            for child in mlp.children():
                handles.append(child.register_forward_hook(on_child))

            def mlp_done(mod, args, out, i=i, calls=calls):
                projs = [a for m, a in calls if _is_proj(m)]
                acts = [a for m, a in calls if not _is_proj(m) and not isinstance(m, torch.nn.Dropout)
                        and "Norm" not in type(m).__name__]
                if projs:
                    keep(("mlp.post", i))(projs[-1])
                if acts:
                    keep(("mlp.pre", i))(acts[0])
                calls.clear()
            handles.append(mlp.register_forward_hook(mlp_done))
    handles.append(net.get_input_embeddings().register_forward_hook(
        lambda mod, args, out: keep(("embed", None))(out)))
    handles.append(net.get_output_embeddings().register_forward_pre_hook(
        lambda mod, args: keep(("final_norm", None))(args[0])))
    try:
        with torch.no_grad():
            out = net(ids)
            ref[("logits", None)] = out.logits[:, -1].clone()
            mids = {}
            for i in range(LAYERS):
                cname, branch, args, kwargs = last_child[i]
                if model_type in MLP_TAKES_RESIDUAL:
                    mids[i] = args[1] if len(args) > 1 else kwargs["residual"]
                else:
                    scale = getattr(net.config, BRANCH_SCALE.get(model_type, ""), 1.0)
                    mids[i] = ref[("resid_post", i)] - scale * branch.reshape(ref[("resid_post", i)].shape)
                ref[("resid_mid", i)] = mids[i].detach().clone()
    finally:
        for h in handles:
            h.remove()
    # attn.pattern: HF's own eager attention weights; attn.z: what the eager attention function returned
    impl = net.config._attn_implementation
    _set_eager(net)
    patched = []
    try:
        for i, layer in enumerate(layers):
            _, attn = _child_by_class(layer, "Attention")
            mod = sys.modules[type(attn).__module__]
            if hasattr(mod, "eager_attention_forward") and model_type not in OUT_PROJ:
                original = mod.eager_attention_forward

                def spy(module, *args, original=original, **kwargs):
                    out = original(module, *args, **kwargs)
                    idx = [j for j, lay in enumerate(layers) if any(m is module for m in lay.modules())]
                    if idx:
                        ref[("attn.z", idx[0])] = out[0].detach().clone()
                    return out
                if not patched or patched[-1][0] is not mod:
                    patched.append((mod, original))
                    mod.eager_attention_forward = spy
        with torch.no_grad():
            out = net(ids, output_attentions=True)
        for i, w in enumerate(out.attentions or ()):
            if w is not None:
                ref[("attn.pattern", i)] = w.detach().clone()
    finally:
        for mod, original in patched:
            mod.eager_attention_forward = original
        _set_sdpa(net, impl)
    return ref


def exists(model_type, net, column, layer_index):
    """Whether the architecture computes this tensor at all (else a refusal is right)."""
    layers = _layers(net)
    layer = layers[layer_index] if layer_index is not None else None
    _, mlp = _child_by_class(layer, "MLP", "Moe", "MoE", "FeedForward", "Mlp") if layer is not None else (None, None)
    moe = mlp is not None and hasattr(mlp, "experts")
    if column == "resid_mid":
        flag = PARALLEL.get(model_type)
        return not (flag is True or (isinstance(flag, str) and getattr(net.config, flag, False)))
    if column in ("mlp.router", "mlp.routed"):
        return moe
    if column in ("mlp.pre", "mlp.post"):
        return not moe
    return True


def _point(m, column, i):
    if column in MODEL_POINTS:
        return m.logits if column == "logits" else getattr(m, column).output
    e = m.layers[i]
    for part in column.split("."):
        e = getattr(e, part)
    return e


CLEAR = (PointUnavailableError, ModulePathError)


def ours(model, column, layers):
    """``{layer: tensor | exception}`` read by asyncinterp at ``column`` (one trace; per layer if that fails)."""
    got = _ours(model, column, layers)
    if not isinstance(got, Exception) or len(layers) == 1:
        return got if not isinstance(got, Exception) else {i: got for i in layers}
    out = {}
    for i in layers:
        one = _ours(model, column, [i])
        out[i] = one if isinstance(one, Exception) else one[i]
    return out


def _clear(e) -> bool:
    """A clear refusal: our errors for unavailable points, or awaiting a module where a point was meant."""
    return isinstance(e, CLEAR) or (isinstance(e, TypeError) and "is a module" in str(e))


def _ours(model, column, layers):
    async def fn(m):
        got = {}
        for i in layers:
            got[i] = _first(await _point(m, column, i)).detach().clone()
        return got
    ids = torch.randint(3, VOCAB, (2, N), generator=torch.Generator().manual_seed(5))
    try:
        with torch.no_grad():
            return model.trace(ids, fn)
    except Exception as e:  # noqa: BLE001 - classified by the caller
        return e


def _close(a, b):
    if a.shape != b.shape:
        return False, f"shape {tuple(a.shape)} != reference {tuple(b.shape)}"
    scale = max(b.abs().max().item(), 1e-3)
    err = (a.float() - b.float()).abs().max().item()
    return err <= 2e-4 * scale + 1e-5, f"max |diff| {err:.3g} (scale {scale:.3g})"


def edit(model, net, model_type, column):
    """(ours, reference) logits after adding the same delta at layer 1's ``column`` (in place / by hand).

    The reference adds the delta with a torch forward hook on the layer (``resid_post``), or to what the eager
    attention function returns for layer 1's block (``z``; a pre-hook on the output projection for blocks that do
    not use the attention interface).
    """
    ids = torch.randint(3, VOCAB, (2, N), generator=torch.Generator().manual_seed(5))
    layer = _layers(net)[1]
    gen = torch.Generator().manual_seed(7)
    _, attn = _child_by_class(layer, "Attention")
    delta = None
    undo = []
    if column == "resid_post":
        delta = torch.randn(2, N, WIDTH, generator=gen)

        def hook(mod, args, out):
            new = _first(out) + delta
            return (new,) + tuple(out[1:]) if isinstance(out, tuple) else new
        undo.append(layer.register_forward_hook(hook).remove)
    elif model_type in OUT_PROJ:                   # no attention interface: z is the output projection's input
        proj = getattr(attn, OUT_PROJ[model_type])
        width = proj.in_features if hasattr(proj, "in_features") else proj.weight.shape[0]
        delta = torch.randn(2, N, width, generator=gen)
        undo.append(proj.register_forward_pre_hook(lambda mod, args: (args[0] + delta,) + tuple(args[1:])).remove)
    else:                                          # z is what the attention function returns
        mod = sys.modules[type(attn).__module__]
        original = mod.eager_attention_forward

        def spy(module, *args, **kwargs):
            nonlocal delta
            out = original(module, *args, **kwargs)
            if module is not attn:
                return out
            if delta is None:
                delta = torch.randn(out[0].shape, generator=gen)
            return (out[0] + delta,) + tuple(out[1:])
        impl = net.config._attn_implementation
        _set_eager(net)
        mod.eager_attention_forward = spy
        undo.append(lambda: setattr(mod, "eager_attention_forward", original))
        undo.append(lambda: _set_sdpa(net, impl))
    try:
        with torch.no_grad():
            want = net(ids).logits[:, -1].clone()
    finally:
        for fn in undo:
            fn()

    async def fn(m):
        x = await (m.layers[1].resid_post if column == "resid_post" else m.layers[1].attn.z)
        x += delta.view(x.shape)
        return (await m.output).logits[:, -1].clone()
    got = model.trace(ids, fn)
    return got, want


def check(model_type):
    """``{column: {"status": "ok" | "refused" | "absent" | "wrong" | "error", "note": str}}`` for one architecture."""
    net = build(model_type)
    ids = torch.randint(3, VOCAB, (2, N), generator=torch.Generator().manual_seed(5))
    ref = reference(net, model_type, ids)
    model = ai.wrap(net)
    cells = {}
    for column in LAYER_POINTS + MODEL_POINTS:
        idx = [None] if column in MODEL_POINTS else list(range(LAYERS))
        got = ours(model, column, [0] if idx == [None] else idx)
        statuses = []
        for i in idx:
            have = exists(model_type, net, column, i)
            value = got[0 if i is None else i]
            if isinstance(value, Exception) and _clear(value):
                msg = str(value).split("\n")[0]
                statuses.append(("refused" if have else "absent", msg))
                continue
            if isinstance(value, Exception):
                statuses.append(("error", f"{type(value).__name__}: {str(value)[:200]}"))
                continue
            if not have:
                statuses.append(("wrong", "a value where the architecture computes no such tensor"))
                continue
            want = ref.get((column, i))
            if want is None:
                statuses.append(("unchecked", "no reference value was captured"))
                continue
            ok, why = _close(value, want)
            statuses.append(("ok" if ok else "wrong", why))
        cells[column] = _merge(statuses)
    for column in EDITS:
        target = column.split(" ")[1]
        if cells[target]["status"] != "ok":
            cells[column] = {"status": "skipped", "note": f"{target} is not given", "per_layer": []}
            continue
        try:
            got, want = edit(model, net, model_type, target.split(".")[-1] if target == "resid_post" else "z")
            ok, why = _close(got, want)
            cells[column] = {"status": "ok" if ok else "wrong", "note": why, "per_layer": []}
        except Exception as e:  # noqa: BLE001
            cells[column] = {"status": "error", "note": f"{type(e).__name__}: {e}"[:300], "per_layer": []}
    return cells


def _merge(statuses):
    """One cell from per-layer results: the worst status wins; per-layer detail kept."""
    order = ["wrong", "error", "unchecked", "refused", "ok", "absent"]
    kinds = {s for s, _ in statuses}
    worst = min(kinds, key=order.index)
    mixed = len(kinds) > 1
    note = next(n for s, n in statuses if s == worst)
    return {"status": worst, "note": note, "mixed": mixed, "per_layer": statuses}


def check_all(names=None, log=None):
    """``{model_type: cells | {"build": error}}`` for every architecture (or ``names``)."""
    results = {}
    for name in names or sorted(ARCHITECTURES):
        t = time.perf_counter()
        try:
            results[name] = check(name)
        except Exception as e:  # noqa: BLE001 - an architecture that cannot be built or run is reported
            results[name] = {"build": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300],
                             "trace": traceback.format_exc()}
        if log:
            log(f"{name}: {time.perf_counter() - t:.2f}s")
    return results
