"""``attn.pattern`` from the attention the model really runs, on every transformers architecture.

The pattern is not re-derived from projections (which misses q/k norms,
soft-caps, partial rotary, NoPE layers, sliding windows, sinks...). It is
taken where transformers' attention function receives the final q and k:

* **attention-interface models** (almost all): while ``attn.pattern`` of a
  block is awaited in a run, that block's ``config`` is a per-run proxy whose
  ``_attn_implementation`` names :data:`KEY`, registered once in
  ``ALL_ATTENTION_FUNCTIONS``. The block then calls :func:`_watched`, which
  calls the implementation the model was using (sdpa, eager, ...) unchanged
  for the output, and the model's own ``eager_attention_forward`` (same
  module file, so its soft-cap, sinks and scaling) on the same q, k, mask and
  keyword arguments for the probabilities (under sdpa, torch's formula on
  the same arguments: sdpa has no soft-cap, so none is applied, as in the
  model). Only this block in this run is
  touched; the proxy is removed when the run ends. Blocks nobody awaits never
  see it, and no other call pays anything.
* **older models that compute the weights themselves** (GPT-J, Falcon, BLOOM,
  MPT): the block's ``output_attentions`` keyword is turned on for the call
  and the weights it returns are the pattern.

Fires before the block's output projection (position: its input). Read-only.
"""

from __future__ import annotations

import inspect
import sys
import threading

import torch

from ..kernel.errors import ReplacementError
from .archs import PointUnavailableError
from .modules import add_forward_pre_hook, submodules
from .points import Point

__all__ = ["KEY", "PatternPoint", "ZPoint", "uses_interface", "watch_of"]

KEY = "asyncinterp_watched"
_CONFIG_ATTR = "_attn_implementation"


class PatternError(PointUnavailableError):
    """The pattern of this attention block cannot be computed (the message says why)."""


def _interface():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return ALL_ATTENTION_FUNCTIONS


def uses_interface(module) -> bool:
    """Whether ``module``'s class dispatches through transformers' attention interface."""
    mod = sys.modules.get(type(module).__module__)
    return (mod is not None and hasattr(mod, "ALL_ATTENTION_FUNCTIONS") and hasattr(mod, "eager_attention_forward")
            and hasattr(module, "config") and "ALL_ATTENTION_FUNCTIONS" in _source(type(module)))


def interface_calls(module) -> int:
    """How many times ``module``'s forward calls the attention function (2 in differential attention)."""
    return _source(type(module)).count("attention_interface(")


_sources: dict = {}


def _source(cls) -> str:
    text = _sources.get(cls)
    if text is None:
        try:
            text = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            text = ""
        _sources[cls] = text
    return text


def _returns_weights(module) -> bool:
    try:
        return "output_attentions" in inspect.signature(module.forward).parameters or \
            type(module).__name__.startswith("Mpt")
    except (TypeError, ValueError):
        return False


class _WatchedConfig:
    """A block's config during a run where its pattern is awaited: the same values, another attention function."""

    def __init__(self, original, watch):
        vars(self).update(original=original, watch=watch)
        setattr(self, _CONFIG_ATTR, KEY)

    def __getattr__(self, name):
        return getattr(vars(self)["original"], name)


def _eager_mask(mask, query, key, kwargs, module):
    """The additive float mask the eager function expects, from what the running implementation was given."""
    n, n_ctx = query.shape[-2], key.shape[-2]
    if mask is None:
        causal = kwargs.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        if not causal or n == 1:
            return None
        keep = torch.ones(n, n_ctx, dtype=torch.bool, device=query.device).tril(n_ctx - n)
        mask = keep[None, None]
    if not isinstance(mask, torch.Tensor):
        raise PatternError(f"the attention mask is a {type(mask).__name__} (flex attention?); attn.pattern needs a "
                           "tensor mask: run the model with attn_implementation='sdpa' or 'eager'")
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(
            ~mask, torch.finfo(query.dtype).min)
    return mask


def _sdpa_weights(module, query, key, mask, kwargs):
    """softmax(q kᵀ · scale + mask) as ``sdpa_attention_forward`` has torch compute it (no soft-cap: sdpa has none)."""
    scaling = kwargs.get("scaling")
    scale = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    if key.shape[1] != query.shape[1]:
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
    scores = (query.float() @ key.float().transpose(-1, -2)) * scale
    if kwargs.get("position_bias") is not None:
        scores = scores + kwargs["position_bias"].float()
    add = _eager_mask(mask, query, key, kwargs, module)
    if add is not None:
        if add.dtype == torch.bool:
            scores = scores.masked_fill(~add, float("-inf"))
        else:
            scores = scores + add[..., :scores.shape[-1]].float()
    return scores.softmax(-1).to(query.dtype)


def _watched(module, query, key, value, attention_mask, *args, **kwargs):
    """The attention function of a watched block: the real implementation, with the block's points around it."""
    watch = vars(module.config)["watch"]
    impl = watch.impl
    eager = sys.modules[type(module).__module__].eager_attention_forward
    real = eager if impl in (None, "eager") else _interface()[impl]
    if watch.run.in_adhoc_call or threading.get_ident() != watch.thread:   # not this run's forward
        return real(module, query, key, value, attention_mask, *args, **kwargs)
    watch.calls += 1
    if watch.calls > 1:
        raise PatternError(f"{module.__class__.__name__} called the attention function twice in one call "
                           "(differential attention?): attn.z and attn.pattern of this block are not one tensor; "
                           "read the block's submodules instead")
    if watch.pattern is not None:
        watch.fire_pattern(module, eager, query, key, value, attention_mask, args, kwargs)
    out = real(module, query, key, value, attention_mask, *args, **kwargs)
    if watch.z is not None:
        out = watch.fire_z(out)
    return out


class _Watch:
    """One attention block in one run: its points fired from the attention function (pattern before, z after)."""

    def __init__(self, run, module, impl):
        self.run, self.module, self.impl = run, module, impl
        self.thread = threading.get_ident()
        self.calls = 0             # attention-function calls in the block's current call
        self.pattern = None
        self.z = None

    def fire_pattern(self, mod, eager, query, key, value, mask, args, kwargs):
        point, impl = self.pattern, self.impl
        if impl in (None, "eager"):              # the model's own eager function: exactly its weights
            kw = {k: v for k, v in kwargs.items() if k not in ("is_causal", "dropout")}
            _, weights = eager(mod, query, key, value, _eager_mask(mask, query, key, kwargs, mod),
                               *args, dropout=0.0, **kw)
        elif impl == "sdpa":                     # what torch's sdpa computes from these arguments
            weights = _sdpa_weights(mod, query, key, mask, kwargs)
        else:
            raise PatternError(f"{point.label}: the model runs attn_implementation={impl!r}, whose "
                               "probabilities asyncinterp does not reproduce; load it with "
                               "attn_implementation='sdpa' or 'eager' to read attn.pattern")
        if weights is None:
            raise PatternError(f"{point.label}: {type(mod).__name__}'s eager attention returned no weights")
        heads = _heads(point.envoy)
        gather = getattr(self.run, "gather_heads", None)        # tensor parallel: this rank's heads only
        if gather is not None and heads and weights.shape[1] != heads:
            weights = gather(weights)
        self.run.fire(point, weights)

    def fire_z(self, out):
        point = self.z
        z = out[0] if isinstance(out, tuple) else out
        heads = _heads(point.envoy)
        if heads and z.shape[2] != heads:
            raise PatternError(f"{point.label}: the attention function returned {z.shape[2]} heads of {heads} "
                               "(tensor parallel shards?); read the output projection's .input instead")
        # fired as [b, n, heads * d_head] (layouts cut 3-D values along the sequence too: left padding), shown
        # per head by the point's read; a flat copy (z not contiguous) is written back after the firing
        flat = z.flatten(2)
        new = self.run.fire(point, flat)
        if new is None:
            if not z.is_contiguous():
                z.copy_(flat.view(z.shape))
            return out
        new = new.view(z.shape)
        return (new,) + tuple(out[1:]) if isinstance(out, tuple) else new


def _heads(envoy):
    return getattr(getattr(envoy.root.module, "config", None), "num_attention_heads", None)


def watch_of(run, envoy):
    """The :class:`_Watch` of attention block ``envoy`` in ``run``, installed on first use (see module doc)."""
    watches = run.state(_Watch, dict)
    module = envoy.module
    watch = watches.get(module)
    if watch is None:
        _register()
        original = module.config
        impl = getattr(original, _CONFIG_ATTR, None)
        if isinstance(original, _WatchedConfig):       # a run inside a run: watch what the outer one runs
            impl = vars(original)["watch"].impl
        watch = watches[module] = _Watch(run, module, impl)
        module.config = _WatchedConfig(original, watch)
        run.on_cleanup(_Restore(module, original))

        def new_call(mod, args):
            watch.calls = 0
        run.on_cleanup(add_forward_pre_hook(module, new_call))
        out = out_projection(envoy)            # the block and every ancestor take the hooked path (lazy hooks)
        run.keep_ancestors(out if out is not None else envoy)
        run.keep_alive(module)
    return watch


def _register() -> None:
    iface = _interface()
    if KEY not in iface:
        type(iface).register(KEY, _watched)


def _read_only(new, value):
    raise ReplacementError(
        "attn.pattern is read-only: the model's attention kernel never materialises it (it is computed for "
        "reading from the q, k and mask the kernel received). Edit attn.q / attn.k or attn.z instead")


class PatternPoint(Point):
    """``attn.pattern`` of one attention block: ``[b, heads, n, n_ctx]`` probabilities (see module doc)."""

    __slots__ = ("envoy", "label", "position", "before", "arch")
    kind_label = "semantic points"

    def __init__(self, envoy, before, arch: str):
        self.envoy = envoy
        self.key, self.read, self.gradient, self.order_cache = self, None, None, None
        self.write = _read_only
        self.label = f"{envoy.path}.pattern"
        self.before = before          # the envoy of the output projection (fires before its input), or None
        self.arch = arch
        self.position = (before.module, "inputs") if before is not None else (envoy.module, "output")

    def describe(self) -> str:
        return self.label

    def activate_in(self, run, task) -> None:
        if self.envoy.root is not run.model:
            raise PatternError(f"{self.label} belongs to another wrapped model")
        done = run.state(PatternPoint, set)
        if self in done:
            return
        done.add(self)
        module = self.envoy.module
        if uses_interface(module):
            self._watch(run, module)
        elif _returns_weights(module):
            self._weights(run, module)
        else:
            raise PatternError(f"{self.label}: {self.arch}'s attention ({type(module).__name__}) neither uses "
                               "transformers' attention interface nor returns its weights")

    def _watch(self, run, module):
        watch_of(run, self.envoy).pattern = self

    def _weights(self, run, module):
        point = self
        impl = getattr(getattr(module, "config", None), _CONFIG_ATTR, None)
        if impl not in (None, "eager"):
            raise PatternError(f"{self.label}: {self.arch}'s attention ({type(module).__name__}) only computes its "
                               f"weights on its eager path, and this model runs attn_implementation={impl!r} "
                               "(turning the weights on would change what it computes); load the model with "
                               "attn_implementation='eager' to read attn.pattern")

        def pre(mod, args, kwargs):
            if run.in_adhoc_call or "output_attentions" not in inspect.signature(mod.forward).parameters:
                return None
            return args, {**kwargs, "output_attentions": True}

        def post(mod, args, kwargs, output):
            if run.in_adhoc_call:
                return None
            weights = output[1] if isinstance(output, tuple) and len(output) > 1 else None
            if not isinstance(weights, torch.Tensor):
                raise PatternError(f"{point.label}: {type(mod).__name__} returned no attention weights")
            run.fire(point, weights)
            return None
        run.on_cleanup(module.register_forward_pre_hook(pre, with_kwargs=True))
        run.on_cleanup(module.register_forward_hook(post, with_kwargs=True))
        run.keep_ancestors(self.envoy)


class ZPoint(Point):
    """``attn.z``: what the attention function returned, ``[b, n, heads, d_head]``, before the output projection.

    Fired right after transformers' attention function (sdpa, eager...) returns, from the same per-run hook as
    ``pattern`` (see module doc); editable in place or by replacement (TransformerLens's ``hook_z``).
    """

    __slots__ = ("envoy", "label", "position")
    kind_label = "semantic points"

    def __init__(self, envoy, before):
        self.envoy = envoy
        self.key, self.gradient, self.order_cache = self, None, None
        heads = _heads(envoy)
        self.read = lambda t: t.unflatten(-1, (heads, -1))
        self.write = lambda new, old: new.reshape(old.shape) if isinstance(new, torch.Tensor) else new
        self.label = f"{envoy.path}.z"
        self.position = (before.module, "inputs") if before is not None else (envoy.module, "output")

    def describe(self) -> str:
        return self.label

    def activate_in(self, run, task) -> None:
        if self.envoy.root is not run.model:
            raise PatternError(f"{self.label} belongs to another wrapped model")
        watch_of(run, self.envoy).z = self


class _Restore:
    def __init__(self, module, config):
        self.module, self.config = module, config

    def remove(self):
        self.module.config = self.config


def out_projection(attn_envoy):
    """The output projection child of an attention block (``o_proj``, ``c_proj``, ``dense``, ``out_proj``...)."""
    subs = submodules(attn_envoy.module)
    for name in ("o_proj", "c_proj", "dense", "out_proj", "wo"):
        if name in subs:
            return attn_envoy.child(name)
    return None
