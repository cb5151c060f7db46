"""Sharded values under tensor parallelism: tasks see the full tensor, writes go back to every rank's shard.

Under tensor parallelism each rank holds a slice of some activations: the
output of a column-parallel linear layer (its output features), the input of a
row-parallel one, the heads of an attention block, or a ``DTensor`` that a
transformers TP plan hands on. A :class:`Sharding` says where those slices sit
inside one hook value (``paths``: positions inside nested tuples/lists, each
split along one dimension into :class:`Part` s). It is the one mechanism of
every engine (transformers' TP plans, the column/row-parallel layers of
:mod:`asyncinterp.distributed.layers`, vLLM's workers, see
:mod:`asyncinterp.models.vllm.tp`); only the collective (``all_gather``)
and the rules that find the sharded points differ.

* ``gather(value)`` all-gathers each sharded tensor and puts the pieces in
  the unsharded order (merged layers are reassembled part by part, replicas
  appear once): the task sees exactly what the model has at TP=1.
* ``scatter(full, token, result, original)`` runs after the tasks: when they
  changed nothing (the in-place version counters did not move) nothing
  happens; otherwise each rank takes its own slice of the full value (edited
  in place or replaced) and the hook returns it, so every rank continues with
  consistent values. Inference tensors (vLLM), which keep no version counter,
  are copied into their shards in place.

Points that no rule marks as sharded cost nothing extra (replicated values:
layer outputs, the residual stream, row-parallel outputs after their
all-reduce). A ``DTensor`` found in a hook value is gathered with
``full_tensor()`` and rebuilt with its own placements.

:func:`local_shard` is the explicit opt-in to this rank's slice (a view into
the gathered tensor, so edits through it are re-sharded like any other).
"""

from __future__ import annotations

import torch

from .envoy import HookPoint
from .modules import tensor_version

__all__ = ["Part", "Sharding", "local_shard", "sharded_output_hook", "sharded_input_hook", "ShardedHooks",
           "torch_all_gather"]


class Part:
    """One logical piece of a sharded dimension: ``size`` features per rank, taken from ``ranks`` in order."""

    __slots__ = ("size", "ranks", "pos")

    def __init__(self, size: int, ranks, pos: int):
        self.size = int(size or 0)  # features of this part on one rank (0: all the rank has; one-part shardings)
        self.ranks = list(ranks)    # the ranks whose copies make up the full part (replicas once)
        self.pos = int(pos)         # where this rank's copy sits in the full part


def even(size, world, rank):
    """The parts of a dimension split evenly over ``world`` ranks (``size`` per rank; 0: what each rank has)."""
    return [Part(size, range(world), rank)]


def torch_all_gather(group=None):
    """An ``all_gather(t) -> [world, *t.shape]`` over a ``torch.distributed`` group (gloo, nccl)."""
    import torch.distributed as dist

    def all_gather(t):
        world = dist.get_world_size(group)
        out = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(out, t.contiguous(), group=group)
        return torch.stack(out)
    return all_gather


def _has_dtensor(value):
    cls = _dtensor_class()
    if cls is None:
        return False
    if isinstance(value, cls):
        return True
    if isinstance(value, (tuple, list)):
        return any(isinstance(v, cls) or (isinstance(v, (tuple, list)) and any(isinstance(w, cls) for w in v))
                   for v in value)
    return False


_DTENSOR = []


def _dtensor_class():
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:   # pragma: no cover - torch built without distributed
            DTensor = None
        _DTENSOR.append(DTensor)
    return _DTENSOR[0]


class Sharding:
    """How the tensors at ``paths`` of a hook value are split over the tensor-parallel ranks.

    ``paths``: ``{path: [Part, ...]}``, a path being a tuple of indices into
    the nested value (``()`` the value itself, ``(0, 0)`` the first positional
    argument of an ``inputs`` value); ``dims``: ``{path: dim}`` (default the
    last dimension); ``all_gather(t)`` returns ``[world, *t.shape]``.
    """

    def __init__(self, paths: dict, rank: int, world: int, all_gather=None, dims: dict | None = None):
        self.paths = paths
        self.rank = rank
        self.world = world
        self.all_gather = all_gather
        self.dims = dims or {}

    # ----------------------------------------------------------------- access
    @staticmethod
    def get_at(value, path):
        """The item at ``path`` (a tuple of indices) inside nested ``value``."""
        for i in path:
            value = value[i]
        return value

    @staticmethod
    def set_at(value, path, new):
        """A copy of nested ``value`` with ``new`` at ``path`` (containers rebuilt, ``value`` untouched)."""
        if not path:
            return new
        head, rest = path[0], path[1:]
        if isinstance(value, tuple):
            items = list(value)
            items[head] = Sharding.set_at(items[head], rest, new)
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        if isinstance(value, list):
            items = list(value)
            items[head] = Sharding.set_at(items[head], rest, new)
            return items
        if isinstance(value, dict):
            out = dict(value)
            out[head] = Sharding.set_at(out[head], rest, new)
            return out
        raise TypeError(f"cannot address {path} in {type(value).__name__}")

    def _find(self, value, path):
        try:
            return self.get_at(value, path)
        except (IndexError, KeyError, TypeError):
            return None

    # ------------------------------------------------------------ gather/scatter
    def gather(self, value):
        """``(full value, token)``: every sharded tensor replaced by the full tensor (a collective call).

        ``token`` remembers the in-place version of each gathered tensor, for :meth:`scatter`.
        """
        out = value
        token = []
        with torch.no_grad():
            for path, parts in self.paths.items():
                local = self._find(value, path)
                if not isinstance(local, torch.Tensor):
                    continue
                dim = self.dims.get(path, -1) % local.dim()
                every = self.all_gather(local)            # [world, *local.shape]
                pieces, offset = [], 0
                for part in parts:
                    size = part.size or local.shape[dim]
                    for r in part.ranks:
                        pieces.append(every[r].narrow(dim, offset, size))
                    offset += size
                full = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)
                out = self.set_at(out, path, full)
                token.append((path, None if full.is_inference() else tensor_version(full)))
        return out, token

    def local(self, full: torch.Tensor, path=()) -> torch.Tensor:
        """This rank's slice of a full tensor at ``path`` (a view where it is one piece)."""
        parts = self.paths[path]
        dim = self.dims.get(path, -1) % full.dim()
        pieces, offset = [], 0
        for part in parts:
            size = part.size or full.shape[dim] // len(part.ranks)
            start = offset + part.pos * size
            pieces.append(full.narrow(dim, start, size))
            offset += size * len(part.ranks)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)

    def scatter(self, full, token, result, original):
        """After the tasks: what the hook returns so that this rank continues with its slice of their value.

        ``full``/``token``: what :meth:`gather` returned; ``result``: the
        tasks' replacement (``None``: none); ``original``: the value the hook
        was called with. Returns ``None`` when nothing changed.
        """
        final = full if result is None else result
        if result is None and all(v is not None and tensor_version(self.get_at(full, p)) == v for p, v in token):
            return None            # read only: nothing to write back
        out = final
        with torch.no_grad():
            for path, _ in token:
                target = self.get_at(original, path)
                piece = self.local(self.get_at(final, path), path).to(dtype=target.dtype)
                if target.is_inference():
                    target.copy_(piece)       # vLLM (inference mode): the shard is updated where it lives
                    piece = target
                else:
                    piece = piece.contiguous() if not piece.is_contiguous() else piece.clone()
                out = self.set_at(out, path, piece)
        if result is None and all(v is None for _, v in token):
            return None            # inference tensors were copied in place: the module goes on with them
        return out


class DTensorSharding:
    """The ``DTensor`` s inside a hook value (a TP plan that hands them on): gathered whole, rebuilt after."""

    def gather(self, value):
        cls = _dtensor_class()
        token = []

        def walk(v, path):
            nonlocal value
            if isinstance(v, cls):
                full = v.full_tensor()
                token.append((path, v, tensor_version(full)))
                value = Sharding.set_at(value, path, full)
            elif isinstance(v, (tuple, list)) and len(path) < 2:
                for i, item in enumerate(v):
                    walk(item, path + (i,))
        walk(value, ())
        return value, token

    def scatter(self, full, token, result, original):
        from torch.distributed.tensor import Partial, Replicate, distribute_tensor
        final = full if result is None else result
        if result is None and all(tensor_version(Sharding.get_at(full, p)) == v for p, _, v in token):
            return None
        out = final
        for path, dt, _ in token:
            placements = [Replicate() if isinstance(p, Partial) else p for p in dt.placements]
            new = distribute_tensor(Sharding.get_at(final, path).detach(), dt.device_mesh, placements,
                                    src_data_rank=None)
            out = Sharding.set_at(out, path, new)
        return out


_DTENSORS = DTensorSharding()


def sharded_output_hook(inner, shard, run):
    """Wrap a run's forward hook ``inner``: tasks see the gathered value, the model gets its shard back.

    ``shard``: the point's :class:`Sharding`, or ``None`` (then only a
    ``DTensor`` in the value is gathered; a replicated value costs one type check).
    """
    def hook(module, args, output):
        if run.in_adhoc_call:
            return None
        sh = shard
        if sh is None:
            if not _has_dtensor(output):
                return inner(module, args, output)
            sh = _DTENSORS
        full, token = sh.gather(output)
        result = inner(module, args, full)
        return sh.scatter(full, token, result, output)
    return hook


def sharded_input_hook(inner, shard, run):
    """Wrap a run's forward pre-hook ``inner`` (called with ``(args, kwargs)``) like :func:`sharded_output_hook`."""
    def hook(module, args, kwargs):
        if run.in_adhoc_call:
            return None
        sh = shard
        value = (args, kwargs)
        if sh is None:
            if not _has_dtensor(args):
                return inner(module, args, kwargs)
            sh = _DTENSORS
        (full_args, full_kwargs), token = sh.gather(value)
        result = inner(module, full_args, full_kwargs)
        new = sh.scatter((full_args, full_kwargs), token, None if result is None else (result[0], result[1]), value)
        return None if new is None else (tuple(new[0]), dict(new[1]))
    return hook


class ShardedHooks:
    """Mixin of a run over a tensor-parallel model: its point hooks gather and re-shard (see module doc).

    The model answers ``sharding_of(module, kind)`` (``kind``: ``"output"`` or
    ``"inputs"``) with a :class:`Sharding` or ``None``.
    """

    def output_hook(self, point):
        inner = super().output_hook(point)
        return sharded_output_hook(inner, self.model.sharding_of(point.envoy.module, "output"), self)

    def input_hook(self, point):
        inner = super().input_hook(point)
        return sharded_input_hook(inner, self.model.sharding_of(point.envoy.module, "inputs"), self)

    def gather_heads(self, t):
        """A ``[b, heads, ...]`` tensor of this rank's heads (a KV cache) with every rank's heads, in order."""
        return self.model.head_sharding().gather(t)[0]

    def call_adhoc(self, module, args, kwargs):
        """An ad hoc call takes and gives full tensors too: its sharded input is cut, its sharded output gathered."""
        into = self.model.sharding_of(module, "inputs")
        if into is not None and (0, 0) in into.paths and args and isinstance(args[0], torch.Tensor):
            args = (into.local(args[0], (0, 0)).contiguous(),) + tuple(args[1:])
        out = super().call_adhoc(module, args, kwargs)
        shard = self.model.sharding_of(module, "output")
        return out if shard is None else shard.gather(out)[0]


# ----------------------------------------------------------------------------- the explicit local shard


def local_shard(point):
    """The point whose awaited value is *this rank's* shard of ``point`` (an explicit opt-in).

    ``await ai.distributed.local_shard(m.model.layers[0].self_attn.q_proj.output)``
    gives the ``[..., features / world]`` slice this rank computes. It is a
    view into the gathered tensor: in-place edits through it are re-sharded
    like any other; assigning a new local slice replaces just that slice.
    Only module ``output``/``inputs``/``input`` points; on an unsharded point
    it is the value itself.
    """
    envoy = getattr(point, "envoy", None)
    if not isinstance(point, HookPoint) or envoy is None or point.name not in ("output", "inputs", "input") \
            or type(point) is not HookPoint:
        what = point.describe() if hasattr(point, "describe") else repr(point)
        raise TypeError(f"local_shard takes a module's .output, .input or .inputs point, not {what}: e.g. "
                        "local_shard(m.model.layers[0].self_attn.q_proj.output)")
    kind = point.base_kind
    base = envoy.output if kind == "output" else envoy.inputs
    path = () if kind == "output" else (0, 0)

    def sharding():
        find = getattr(type(envoy.root), "sharding_of", None)   # the wrapped model says (an unsharded one: no)
        shard = find(envoy.root, envoy.module, kind) if find is not None else None
        return shard if shard is not None and path in shard.paths else None

    def read(value):
        shard = sharding()
        if shard is None:
            return Sharding.get_at(value, path)
        return shard.local(Sharding.get_at(value, path), path)

    def write(new, value):
        shard = sharding()
        if shard is None:
            return Sharding.set_at(value, path, new)
        full = Sharding.get_at(value, path).clone()
        shard.local(full, path).copy_(new)    # one piece: a view into the clone
        return Sharding.set_at(value, path, full)

    return HookPoint(envoy, f"{point.name}[local shard]", base, read, write)
