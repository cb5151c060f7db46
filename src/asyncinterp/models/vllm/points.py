"""vLLM's own points: the residual stream of decoder layers (read, replace, skip), attn.q/k/v, attn.pattern.

vLLM's module tree differs from transformers' in three ways that the points
here hide, so that one intervention reads the same values on both engines
(see docs/semantic-points.md and the parity table in docs/vllm.md):

* **Decoder layers pass pairs.** A layer takes ``(positions, hidden, residual)``
  and returns ``(mlp_out, residual)``; the residual stream is the *sum* of the
  pair (the next layer's fused add-RMSNorm adds them). ``.hidden`` /
  ``resid_post`` fold the pair into one live tensor; ``layers[i].output = h``,
  ``.hidden = h`` and ``layers[i].skip(h)`` take the stream ``h`` (this
  request's ``[1, n, hidden]``) and write it into the request's rows of the
  flat layout as ``(h, 0)``, so the stream is exactly ``h``.
* **q, k and v are columns of one merged projection.** ``qkv_proj`` outputs
  ``[q | k | v]`` (under tensor parallelism each rank holds its share of the
  heads; :mod:`.tp` gathers them in the unsharded order). ``attn.q/k/v`` are
  three points fired one after the other from one tap on that output, as
  ``[1, n, heads, d_head]`` live views (before rotary); replacements are
  written back into their columns.
* **The attention kernel never forms the probabilities**, and reads past keys
  from a paged KV cache. ``attn.pattern`` is computed when awaited from the
  rotated q and k that reach the kernel (the inner ``attn`` module's inputs),
  with the keys of earlier steps kept by the point itself from the step it
  was first awaited (the paged cache is not read back).

Everything is per request: each invoke sees its own rows of the flat token
layout (:mod:`.layout`) with a leading batch dimension of one.
"""

from __future__ import annotations

from collections import namedtuple

import torch

from ...hooks.envoy import Envoy, HookPoint, point
from ...hooks.modules import submodules
from ...hooks.points import Point
from ...kernel.errors import NotInRunError, OutOfOrderError, ReplacementError, await_site
from ...kernel.scheduler import current_kernel, current_task

# ----------------------------------------------------------------------------- the residual stream


def _is_pair(out) -> bool:
    """True for a decoder layer's ``(mlp_out, residual)`` output."""
    return (isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor)
            and isinstance(out[1], torch.Tensor))


def fold_residual(out):
    """``(mlp_out, residual)`` -> the residual stream, as a live view (folds residual into mlp_out in place)."""
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor):
        h, r = out
        if isinstance(r, torch.Tensor):
            h.add_(r)
            r.zero_()
        return h
    return out


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)} ({value.dtype}, {value.device})"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)} item(s): ({', '.join(_describe(v) for v in value)})"
    return f"a {type(value).__name__}"


def _stream_form(shape, pair_ok: bool) -> str:
    rows = "[1, tokens of this request in this step, hidden]" if len(shape) == 3 else "[tokens, hidden]"
    form = f"the residual stream after the layer, a tensor of shape {tuple(shape)} ({rows})"
    if pair_ok:
        form += ", or the layer's raw output pair (mlp_out, residual) of two such tensors, whose sum is the stream"
    return form


_STREAM_HINT = ("Take the shape from a value of this step (e.g. `h = await m.layers[i].resid_pre`, or the "
                "previous layer's `.hidden`), or edit the awaited tensor in place.")


def _check_tensor(label, new, like, shape, pair_ok):
    """Raise :class:`ReplacementError` unless ``new`` is a tensor of ``shape`` with ``like``'s dtype and device."""
    if not isinstance(new, torch.Tensor):
        raise ReplacementError(f"{label}: expected {_stream_form(shape, pair_ok)}; got {_describe(new)}. "
                               + _STREAM_HINT)
    if tuple(new.shape) != tuple(shape):
        raise ReplacementError(f"{label}: expected {_stream_form(shape, pair_ok)}; got {_describe(new)}. "
                               + _STREAM_HINT)
    if like is not None and new.dtype != like.dtype:
        raise ReplacementError(f"{label}: the value has dtype {new.dtype} but the model computes in {like.dtype}; "
                               f"convert it first (`value.to({like.dtype})`)")
    if like is not None and new.device != like.device:
        raise ReplacementError(f"{label}: the value is on {new.device} but the model runs on {like.device}; "
                               f"move it there first (`value.to({str(like.device)!r})`)")


def check_stream(label, new, like, pair_ok: bool = True):
    """``new`` as ``(stream, residual or None)`` after checking it against ``like`` (this invoke's stream rows).

    A tensor is the residual stream itself; with ``pair_ok`` a pair of tensors
    is the layer's raw ``(mlp_out, residual)`` output. Anything else, or
    another shape, dtype or device, is a :class:`ReplacementError` naming
    ``label``, the expected form and what to do.
    """
    shape = tuple(like.shape)
    if pair_ok and isinstance(new, (tuple, list)):
        if len(new) != 2:
            raise ReplacementError(f"{label}: expected {_stream_form(shape, True)}; got {_describe(new)}")
        for part in new:
            _check_tensor(label, part, like, shape, True)
        return new[0], new[1]
    _check_tensor(label, new, like, shape, pair_ok)
    return new, None


def stream_writer(label: str, pair_ok: bool):
    """The ``write`` of a decoder layer's output points: a stream ``h`` becomes ``(h, 0)`` for this invoke's rows."""
    def write(new, out):
        if not _is_pair(out):          # not a (hidden, residual) layer: the value replaces the output as it is
            return new
        h, r = check_stream(label, new, out[0], pair_ok)
        return (h, torch.zeros_like(out[1]) if r is None else r)
    return write


def fold_args(inputs, at=0):
    """``(args, kwargs)`` of a call taking ``(x, residual)`` at ``args[at:at + 2]`` -> the stream ``x + residual``.

    Live, as for ``.hidden``: the residual is folded into ``x`` in place (``x += residual; residual = 0``,
    the callee computes exactly the same) and ``x`` is returned.
    """
    args, kwargs = inputs
    h = args[at] if len(args) > at else kwargs.get("hidden_states", kwargs.get("x"))
    r = args[at + 1] if len(args) > at + 1 else kwargs.get("residual")
    if isinstance(r, torch.Tensor):
        h.add_(r)
        r.zero_()
    return h


def unfold_args(label: str, at=0):
    """The ``write`` of a folded ``(x, residual)`` input: the stream ``new`` becomes ``(new, 0)``."""
    def write(new, inputs):
        args, kwargs = inputs
        old = args[at] if len(args) > at else kwargs.get("hidden_states", kwargs.get("x"))
        if isinstance(old, torch.Tensor):
            check_stream(label, new, old, pair_ok=False)
        args = list(args)
        if len(args) > at + 1 and isinstance(args[at + 1], torch.Tensor):
            args[at + 1] = torch.zeros_like(args[at + 1])
        elif isinstance(kwargs.get("residual"), torch.Tensor):
            kwargs = {**kwargs, "residual": torch.zeros_like(kwargs["residual"])}
        if len(args) > at:
            args[at] = new
        else:
            kwargs = {**kwargs, "hidden_states" if "hidden_states" in kwargs else "x": new}
        return tuple(args), kwargs
    return write


def gate_half(out):
    t = out[0] if isinstance(out, tuple) else out
    return t[..., :t.shape[-1] // 2]


def with_gate_half(new, out):
    t = out[0] if isinstance(out, tuple) else out
    if not isinstance(new, torch.Tensor):
        raise ReplacementError(f"replacement for mlp.pre must be a tensor, got {type(new).__name__}")
    full = t.clone()
    full[..., :t.shape[-1] // 2] = new
    return (full,) + tuple(out[1:]) if isinstance(out, tuple) else full


# ----------------------------------------------------------------------------- decoder layers


class _StreamPoint(point):
    """A point of a vLLM decoder layer whose replacement is given as the residual stream (see ``stream_writer``)."""

    def __init__(self, base=None, read=None, pair_ok: bool = False, doc: str | None = None):
        point.__init__(self, base=base, read=read, doc=doc)
        self.pair_ok = pair_ok

    def __get__(self, envoy, owner=None):
        if envoy is None:
            return self
        hp = envoy.points.get(self.name)
        if hp is None:
            write = stream_writer(f"{envoy.path}.{self.name}", self.pair_ok)
            base = None if self.base is None else getattr(envoy, self.base)
            hp = envoy.points[self.name] = HookPoint(envoy, self.name, base, self.read, write)
        return hp


class LayerEnvoy(Envoy):
    """A decoder layer of a vLLM model: ``.hidden`` (the residual stream after it), stream-aware writes and skip."""

    output = _StreamPoint(pair_ok=True, doc=(
        "the layer's raw output, vLLM's (mlp_out, residual) pair (each [1, n, hidden] per request; their sum is "
        "the residual stream). Assign the stream (a [1, n, hidden] tensor) or a pair of that form"))
    hidden = _StreamPoint(base="output", read=fold_residual, doc=(
        "the residual stream after this layer ([1, n, hidden] per request), equal to transformers' "
        "layer output / hidden_states[i + 1]. vLLM's layers return (mlp_out, residual) whose *sum* is the "
        "stream; reading .hidden folds the residual into mlp_out in place (mlp_out += residual; "
        "residual = 0) and returns mlp_out, so editing it in place or assigning it changes the stream"))

    def standard_name(self, name: str):
        found = Envoy.standard_name(self, name)
        if found is None and name == "mlp":
            subs = submodules(self.module)
            if "fc1" in subs and "fc2" in subs:         # OPT: the MLP's linears are the layer's own children
                from ...hooks.semantic import PointUnavailableError
                raise PointUnavailableError(
                    f"{self.path}.mlp: on {type(self.root.module).__name__}, this {type(self.module).__name__} has no "
                    "MLP module (fc1, its activation and "
                    "fc2 are children of the layer itself), so mlp.pre / mlp.post are not available on vLLM; read "
                    f"{self.path}.fc1.output (a tuple: [0] is the activation's input) or {self.path}.fc2.inputs")
        return found

    def skip(self, value) -> None:
        """The residual stream after this layer is ``value`` for this request, on the layer's next call.

        ``value``: this request's stream, ``[1, n, hidden]`` with ``n`` its
        tokens in that step (as ``.hidden`` / ``resid_pre`` show it), or the
        raw pair ``(mlp_out, residual)`` of two such tensors. The layer still
        runs (other requests in the batch need it, and it fills its KV cache
        for this request, so later steps stay consistent); this request's rows
        of its output become ``(value, 0)``. The value is checked at once when
        this step's rows are known, otherwise when the layer runs (a wrong
        value is then raised in the intervention at its current ``await``).
        Call it before the layer runs in the step.
        """
        skip_layer(self, value)


class FirstLayerEnvoy(LayerEnvoy):
    """A decoder layer that returns ``(stream, residual)`` with the stream *first* (StableLM, Cohere, EXAONE-4).

    The second element is a stale copy nobody adds (see :mod:`.archs`), so ``.hidden`` is the
    first element itself, not the pair's sum; writes give ``(stream, 0)`` as on other layers.
    """

    hidden = _StreamPoint(base="output", read=lambda out: out[0] if isinstance(out, tuple) else out, doc=(
        "the residual stream after this layer ([1, n, hidden] per request): the first element of the "
        "layer's (stream, residual) output; edit it in place or assign it"))


class UncheckedLayerEnvoy(LayerEnvoy):
    """A decoder layer of an architecture not in :mod:`.archs`: ``.hidden`` and ``skip`` refuse (the stream's form
    there is unknown, e.g. vLLM's Transformers backend runs a ``[1, tokens, hidden]`` batch)."""

    @property
    def hidden(self):
        from ...hooks.semantic import PointUnavailableError
        from .archs import unsupported_reason
        raise PointUnavailableError(f"{self.path}.hidden is not available: {unsupported_reason(self.root.module)}")

    def skip(self, value) -> None:
        from ...hooks.semantic import PointUnavailableError
        from .archs import unsupported_reason
        raise PointUnavailableError(f"{self.path}.skip(...) is not available: {unsupported_reason(self.root.module)}")


class _Skip:
    __slots__ = ("task", "value", "label")

    def __init__(self, task, value, label):
        self.task = task
        self.value = value      # (stream, residual or None)
        self.label = label


class LayerSkips:
    """Per run: the pending ``skip``\\ s of vLLM decoder layers, applied by one forward hook per skipped layer."""

    def __init__(self):
        self.pending = {}       # layer module -> [_Skip]

    def add(self, run, envoy, entry: _Skip) -> None:
        module = envoy.module
        entries = self.pending.get(module)
        if entries is None:
            entries = self.pending[module] = []

            def hook(mod, args, output):
                return apply_skips(run, entries, output)
            # first of the layer's hooks, so that tasks awaiting its output see the skipped value
            run.on_cleanup(module.register_forward_hook(hook, prepend=True))
            run.keep_ancestors(envoy)
        entries.append(entry)


def skip_layer(envoy, value) -> None:
    """``layers[i].skip(value)`` on vLLM (see :meth:`LayerEnvoy.skip`)."""
    kernel = current_kernel()
    task = current_task()
    if kernel is None or task is None:
        raise NotInRunError(f"{envoy.path}.skip(...) must be called inside an intervention, before the layer runs")
    run = kernel.host
    if envoy.root is not run.model:
        raise NotInRunError(f"{envoy.path} belongs to another wrapped model; skip the layers of the envoy your "
                            "intervention received")
    label = f"{envoy.path}.skip(...) at {await_site(task.coro)}"
    _refuse_if_ran(run, kernel, envoy, label)
    like = _stream_rows_now(run, task.group, envoy)
    if like is not None:
        value = check_stream(label, value, like)
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, torch.Tensor) for v in value):
        value = (value[0], value[1])
    elif isinstance(value, torch.Tensor):
        value = (value, None)
    else:
        raise ReplacementError(
            f"{label}: expected the residual stream after the layer for this request, a [1, n, hidden] tensor "
            f"(n: its tokens in this step), or the layer's raw output pair (mlp_out, residual) of two such "
            f"tensors; got {_describe(value)}. " + _STREAM_HINT)
    run.state(LayerSkips, LayerSkips).add(run, envoy, _Skip(task, value, label))


def _refuse_if_ran(run, kernel, envoy, label) -> None:
    """An :class:`OutOfOrderError` if the layer already ran (or is delivering its output) in this step."""
    out = envoy.output
    now = kernel.current_point
    if kernel.has_run(out) or (now is not None and getattr(now, "key", None) is out.key):
        raise OutOfOrderError(
            f"{label}: {envoy.path} already ran in this engine step (the intervention is at "
            f"{now.describe() if now is not None else 'its start'}), so there is nothing left to skip; a skip never "
            "moves on to the next step. Call skip before the layer runs (e.g. after awaiting a point of an "
            f"earlier layer), or assign `{envoy.path}.hidden = value` right after awaiting it to change this "
            "call's output")


def _hidden_size(module):
    size = getattr(module, "hidden_size", None)
    return size if isinstance(size, int) else None


def _stream_rows_now(run, group, envoy):
    """A tensor shaped as ``group``'s stream rows in the current step, or ``None`` when not known yet."""
    spans = getattr(run.layout, "spans", None)
    span = spans.get(group) if isinstance(spans, dict) else None
    hidden = _hidden_size(envoy.module)
    if span is None or hidden is None:
        return None
    param = next(envoy.module.parameters(), None)
    dtype = param.dtype if param is not None else torch.get_default_dtype()
    device = param.device if param is not None else "cpu"
    return torch.empty((1, span[1] - span[0], hidden), dtype=dtype, device=device)


def apply_skips(run, entries, output):
    """The layer's forward hook: write the due skips into their request's rows (``None``: nothing to do)."""
    if not entries or run.in_adhoc_call or getattr(run, "halted", False):
        return None
    kernel = run.kernel
    active = kernel.active
    due = [s for s in entries if not s.task.closed and (active is None or s.task.group in active)]
    entries[:] = [s for s in entries if s not in due and not s.task.closed]
    if not due:
        return None
    if not _is_pair(output):
        for s in due:
            kernel.fail(s.task, ReplacementError(
                f"{s.label}: this layer does not return vLLM's (hidden, residual) pair but "
                f"{_describe(output)}; replace its output instead (`await layer.output`, then assign it)"))
        return None
    h, r = output
    new_h = new_r = None
    spans = run.layout.spans
    for s in due:
        span = spans.get(s.task.group)
        rows = slice(None) if span is None else slice(span[0], span[1])
        like = h[rows] if span is None else h[rows].unsqueeze(0)
        try:
            stream, residual = check_stream(s.label, s.value[0] if s.value[1] is None else s.value, like)
        except ReplacementError as err:
            kernel.fail(s.task, err)
            continue
        if new_h is None:
            new_h, new_r = h.clone(), r.clone()
        new_h[rows] = stream.reshape(like.shape[-2:]) if span is not None else stream
        if residual is None:
            new_r[rows] = 0
        else:
            new_r[rows] = residual.reshape(like.shape[-2:]) if span is not None else residual
    return None if new_h is None else (new_h, new_r)


# ----------------------------------------------------------------------------- attn.q / .k / .v


def _qkv_columns(proj, index: int):
    """``(start, stop, head_dim)`` of q (0), k (1) or v (2) in the full ``[q | k | v]`` output of ``proj``."""
    d = int(proj.head_size)
    dv = int(getattr(proj, "v_head_size", d) or d)
    q = int(proj.total_num_heads) * d
    kv = int(proj.total_num_kv_heads)
    bounds = [(0, q, d), (q, q + kv * d, d), (q + kv * d, q + kv * d + kv * dv, dv)]
    return bounds[index]


class QKVPart(Point):
    """``attn.q`` / ``.k`` / ``.v`` on vLLM: one part of the merged ``qkv_proj`` output, ``[1, n, heads, d_head]``.

    The three parts are three points, fired one after the other (q, k, v)
    from one tap on ``qkv_proj.output`` that the first awaited part installs;
    under tensor parallelism that output is gathered first (all heads, in the
    unsharded order) and re-sharded after. Each invoke sees a live view of its
    rows of the part's columns, before rotary (vLLM rotates q and k in place
    right after: clone a value kept past the next ``await``); in-place edits
    and replacements are written back into the merged tensor, so the model
    computes with them.
    """

    __slots__ = ("owner", "label", "proj", "index", "position")
    kind_label = "semantic points"

    def __init__(self, owner, name: str, proj):
        self.key, self.gradient = self, None
        self.read = self.heads
        self.write = self.columns_of
        self.owner = owner
        self.label = f"{owner.path}.{name}"
        self.proj = proj
        self.index = "qkv".index(name)
        self.position = (proj.module, "output")

    def describe(self) -> str:
        return self.label

    def heads(self, cols):
        d = _qkv_columns(self.proj.module, self.index)[2]
        return cols.view(*cols.shape[:-1], -1, d)

    def columns_of(self, new, old):
        """A replacement ``[..., heads, d_head]`` as the part's columns ``[..., heads * d_head]``."""
        want = tuple(self.heads(old).shape)
        if not isinstance(new, torch.Tensor) or tuple(new.shape) != want:
            raise ReplacementError(
                f"replacement for {self.label} must be a tensor of shape {want} ([1, tokens of this request in "
                f"this step, heads, d_head]), got {_describe(new)}; edit the awaited tensor in place, or build "
                "the replacement from it")
        return new.reshape(old.shape)

    def activate_in(self, run, task) -> None:
        if self.proj.root is not run.model:
            raise NotInRunError(f"{self.label} belongs to another wrapped model")
        parts = run.state(QKVPart, dict)
        module = self.proj.module
        slots = parts.get(module)
        if slots is None:
            slots = parts[module] = [None, None, None]
            run.tap(self.proj.output, lambda value: fire_parts(run, slots, value))
        slots[self.index] = self


def fire_parts(run, slots, value) -> None:
    """Tap on ``qkv_proj.output``: fire the awaited parts in order; replacements go into their columns in place."""
    t = value[0] if isinstance(value, tuple) else value
    for part in slots:              # by index: a part activated while an earlier one fires is fired too
        if part is None:
            continue
        start, stop, _ = _qkv_columns(part.proj.module, part.index)
        cols = t[..., start:stop]
        new = run.fire(part, cols)
        if new is not None:
            cols.copy_(new)


# ----------------------------------------------------------------------------- attn.pattern

#: what the pattern point fires: flat [T, ...] rows (cut per request by the layout) and the run's key store
PatternRows = namedtuple("PatternRows", "q positions groups store")


class KeyStore:
    """The rotated keys one layer's attention used, per request (invoke group), from the step they were first seen.

    vLLM keeps past keys in its paged KV cache, whose layout belongs to the
    attention backend; the pattern point keeps its own copy instead, from the
    first step it is active in the run: ``[positions, kv_heads, d_head]`` per
    request, appended every step.
    """

    def __init__(self):
        self.first = {}       # group -> first position stored
        self.parts = {}       # group -> [keys [n, kv, d]] in position order
        self.length = {}      # group -> positions stored up to (exclusive)

    def add(self, group, start: int, keys) -> None:
        have = self.length.get(group)
        n = keys.shape[0]
        if have is None or start > have:          # new request, or a gap (positions never seen)
            self.first[group] = start
            self.parts[group] = [keys.clone()]
        else:
            if start < have:                       # positions computed again (e.g. after preemption)
                kept = torch.cat(self.parts[group])[:start - self.first[group]]
                self.parts[group] = [kept]
            self.parts[group].append(keys.clone())
        self.length[group] = start + n

    def keys(self, group, n_ctx: int, label: str):
        """``[n_ctx, kv_heads, d_head]``: the keys of positions ``0..n_ctx-1`` of ``group``'s request."""
        from ...hooks.semantic import PointUnavailableError
        first = self.first.get(group, 0)
        if group not in self.first or first > 0:
            raise PointUnavailableError(
                f"{label} is not available at this step: the keys of positions 0..{first - 1} of this request "
                "were computed before this layer's attn.pattern was first awaited in the run (or vLLM's prefix "
                "cache supplied them), and vLLM's paged KV cache is not read back. attn.pattern is available at "
                "every step of a request when it is first awaited in the request's first step (its prompt): "
                "await it from step 0 on (e.g. in every step of `async for step in m.steps()`). Or read it "
                "with ai.LanguageModel on the same weights")
        parts = self.parts[group]
        if len(parts) > 1:
            parts[:] = [torch.cat(parts)]
        return parts[0][:n_ctx]


def _read_only(label):
    def write(new, value):
        raise ReplacementError(
            f"{label} is read-only: it is computed from q and k for reading, and vLLM's attention kernel never "
            "forms it. Edit attn.q / attn.k, or the attention output (attn.attn.output), instead")
    return write


class PatternPoint(Point):
    """``attn.pattern`` on vLLM: softmax(q k^T * scale + causal mask), ``[1, heads, n, n_ctx]``, when awaited.

    Computed from the rotated q and k at the inputs of the attention op (the
    inner ``attn`` module, after your edits of ``attn.q``/``attn.k``), key/value
    heads repeated for grouped-query attention, in float32, cast to the model's
    dtype; the model's computation is untouched. It fires at that op's inputs.
    Cost, only once awaited in a run: a tap on that op's inputs which copies
    every request's new keys each step (the point's own key store, so later
    steps see the earlier positions), and one ``[heads, n, n_ctx]`` matmul and
    softmax per awaiting request. Read-only.
    """

    __slots__ = ("envoy", "inner", "label", "position")
    kind_label = "semantic points"

    def __init__(self, envoy, inner):
        self.key, self.gradient = self, None
        self.envoy = envoy
        self.inner = inner
        self.label = f"{envoy.path}.pattern"
        self.read = self.pattern
        self.write = _read_only(self.label)
        self.position = (inner.module, "inputs")

    def describe(self) -> str:
        return self.label

    def activate_in(self, run, task) -> None:
        if self.envoy.root is not run.model:
            raise NotInRunError(f"{self.label} belongs to another wrapped model")
        stores = run.state(PatternPoint, dict)
        if self in stores:
            return
        store = stores[self] = KeyStore()
        run.tap(self.inner.inputs, lambda value: self.fire_rows(run, store, value))

    def fire_rows(self, run, store, value) -> None:
        """Tap on the attention op's inputs: store this step's keys per request, fire the rows."""
        args, kwargs = value
        q = args[0] if args else kwargs["query"]
        k = args[1] if len(args) > 1 else kwargs["key"]
        d = int(self.inner.module.head_size)
        tokens = q.shape[0]
        q = q.reshape(tokens, -1, d)
        k = k.reshape(tokens, -1, d)
        groups = torch.full((tokens,), -1, dtype=torch.long)
        positions = torch.zeros(tokens, dtype=torch.long)
        spans = getattr(run.layout, "spans", None) or {}
        for group, span in spans.items():
            a, b = span[0], span[1]
            start = run.request_step(group).positions.start
            store.add(group, start, k[a:b])
            groups[a:b] = group
            positions[a:b] = torch.arange(start, start + b - a)
        run.fire(self, PatternRows(q, positions, groups, store))

    def pattern(self, rows):
        """The view's read: this request's ``[1, heads, n, n_ctx]`` probabilities."""
        from ...hooks.semantic import PointUnavailableError
        q, positions, groups, store = rows
        if groups.dim() != 2:
            raise PointUnavailableError(
                f"{self.label} is per request: this invoke has no prompt of its own (it sees every request's "
                "tokens back to back); await it in an invoke with a prompt")
        pos = positions[0]
        keys = store.keys(int(groups[0, 0]), int(pos[-1]) + 1, self.label)
        return attention_probs(q[0], keys, pos, self.inner.module, self.label).unsqueeze(0)


def attention_probs(q, keys, pos, module, label):
    """softmax(q k^T * scale + mask) for ``q`` ``[n, heads, d]`` at positions ``pos`` over ``keys`` ``[n_ctx, kv, d]``.

    What the attention op was configured with is applied as it applies it: its ``scale``, a
    logits soft-cap (``cap * tanh(s / cap)``), ALiBi slopes (``slope_h * (key_pos - query_pos)``)
    and a sliding window. Attention sinks are refused.
    """
    from ...hooks.semantic import PointUnavailableError
    impl = getattr(module, "impl", None)
    if getattr(impl, "sinks", None) is not None:
        raise PointUnavailableError(f"{label}: attention with sinks (extra softmax logits per head) is not supported")
    scale = getattr(impl, "scale", None) or q.shape[-1] ** -0.5
    qh = q.float().transpose(0, 1)                         # [heads, n, d]
    kh = keys.float().transpose(0, 1)                      # [kv, n_ctx, d]
    if kh.shape[0] != qh.shape[0]:
        kh = kh.repeat_interleave(qh.shape[0] // kh.shape[0], dim=0)
    scores = qh @ kh.transpose(-1, -2) * float(scale)      # [heads, n, n_ctx]
    cap = getattr(impl, "logits_soft_cap", None)
    if cap:
        scores = float(cap) * torch.tanh(scores / float(cap))
    key_pos = torch.arange(kh.shape[1], device=scores.device)
    qpos = pos[:, None].to(scores.device)
    slopes = getattr(impl, "alibi_slopes", None)
    if slopes is not None:
        slopes = torch.as_tensor(slopes, dtype=torch.float32, device=scores.device)
        scores = scores + slopes[:, None, None] * (key_pos[None, :] - qpos)[None].float()
    allowed = key_pos[None, :] <= qpos
    window = getattr(module, "sliding_window", None)
    if isinstance(window, int) and window > 0:
        allowed &= key_pos[None, :] > qpos - window
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1).to(q.dtype)
