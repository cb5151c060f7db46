"""Reductions: what a harvest keeps instead of (or beside) the raw activations.

A reduction sees every :class:`~.batch.HarvestBatch` of a run and keeps a
small state: a running mean and variance per point (:class:`MeanVar`), the
top-k activating windows per direction or SAE feature (:class:`TopK`), a
histogram (:class:`Histogram`). Each has ``update(batch)``, ``state_dict()`` /
``load_state_dict(d)`` (safetensors-ready: a dict of tensors, saved beside
each shard so a resumed run continues), ``merge(other)`` (two partial states
of disjoint windows, e.g. from two Ray actors) and ``result()``.

Results do not depend on how the windows were split: merging the states of
any partition of the windows, in any order, gives the same bits as one
process that saw them all. Top-k and histograms are exact (ties broken by
window id, integer counts). Means and variances are kept per window and
combined with Chan's parallel formula (float64) along a fixed binary tree
over window ids (:class:`_WindowTree`), so the association of the float
additions is fixed by the windows, not by the split.

:func:`difference_of_means` turns two :class:`MeanVar` results into a
steering vector that ``asyncinterp serve --edit NAME=steer:@FILE`` and
``model.edit`` apply (see :mod:`.steering`).
"""

from __future__ import annotations

import copy
import hashlib
import math

import torch

from .batch import HarvestBatch

__all__ = ["MeanVar", "TopK", "Histogram", "PointReduction", "difference_of_means"]

_NO_WINDOW = torch.iinfo(torch.int64).max   # an empty top-k slot: sorts after every real window


class PointReduction:
    """The common part: the point a reduction reads and the checks every update makes."""

    kind = "reduction"

    def __init__(self, point: str, name: str | None = None):
        if not isinstance(point, str) or not point:
            raise TypeError(f"a reduction reads one point, named by a string (got {point!r})")
        if name is not None and (not isinstance(name, str) or not name or "/" in name):
            raise ValueError(f"a reduction's name is a file-name-safe string, got {name!r}")
        self.point = point
        self._name = name

    @property
    def name(self) -> str:
        """The key of this reduction's result (``result-NAME.safetensors``): ``name=`` as given, or
        ``KIND.POINT`` (``mean_var.blocks.1.hook_resid_post``)."""
        return self._name or f"{self.kind}.{self.point}{self._suffix()}"

    def _suffix(self) -> str:
        return ""

    def _acts(self, batch: HarvestBatch) -> torch.Tensor:
        acts = batch.acts.get(self.point)
        if acts is None:
            raise KeyError(f"{self.name}: the harvest has no point {self.point!r}; its points: {sorted(batch.acts)} "
                           "(a reduction's point must be one of the harvested points)")
        if acts.dim() != 3 or acts.shape[0] != batch.window_ids.shape[0]:
            raise ValueError(f"{self.name}: activations of shape {tuple(acts.shape)} for {batch.window_ids.shape[0]} "
                             "windows; expected [windows, positions, width]")
        if not acts.is_floating_point():
            raise TypeError(f"{self.name}: activations of dtype {acts.dtype}; expected floating point")
        return acts

    def _check_other(self, other) -> None:
        if type(other) is not type(self) or other.config() != self.config():
            raise ValueError(f"cannot merge {other!r} into {self!r}: merge states of the same reduction "
                             "(same class, point and settings)")

    def config(self) -> tuple:
        return (self.point,)

    def describe(self) -> dict:
        """What the harvest's manifest records of this reduction: a resume with other settings is refused."""
        h = hashlib.sha256(repr(self.config()).encode())
        return {"class": f"{type(self).__module__}.{type(self).__qualname__}", "name": self.name,
                "point": self.point, "settings_sha256": h.hexdigest()[:16]}

    def __repr__(self):
        return f"{type(self).__name__}({self.point!r})"


# ----------------------------------------------------------------------------- mean and variance
def _chan(a, b):
    """Chan et al.'s parallel combination of ``(count, mean, M2)`` (float64), ``a``'s windows before ``b``'s."""
    na, ma, m2a = a
    nb, mb, m2b = b
    n = na + nb
    delta = mb - ma
    return n, ma + delta * (nb / n), m2a + m2b + delta * delta * (na * nb / n)


class _WindowTree:
    """Per-window ``(count, mean, M2)`` combined along the aligned binary tree over window ids.

    A node ``(start, level)`` covers windows ``[start, start + 2**level)``;
    it exists when all of them were seen and its sibling is not complete yet.
    Two siblings are combined, lower ids first, into their parent as soon as
    both exist. Every node's value is therefore a function of its windows
    only, and the set of nodes of a set of windows is unique: adding windows
    or merging trees in any order gives the same nodes, bit for bit.
    """

    def __init__(self):
        self.nodes: dict[tuple[int, int], tuple] = {}

    def _covered(self, start: int, level: int) -> bool:
        for lv in range(level, 63):                      # this node or an ancestor
            if (start >> lv << lv, lv) in self.nodes:
                return True
        end = start + (1 << level)                       # a descendant
        return level > 0 and any(start <= s < end for (s, lv) in self.nodes if lv < level)

    def add(self, start: int, level: int, value: tuple) -> None:
        if self._covered(start, level):
            raise ValueError(f"windows {start}..{start + (1 << level) - 1} were counted already: a reduction "
                             "must see each window once (merging two states that share windows double-counts)")
        while True:
            sib = start ^ (1 << level)
            other = self.nodes.pop((sib, level), None)
            if other is None:
                self.nodes[(start, level)] = value
                return
            value = _chan(other, value) if sib < start else _chan(value, other)
            start, level = min(start, sib), level + 1

    def total(self):
        """``(count, mean, M2)`` of every window seen (nodes combined in window order), or ``None``."""
        out = None
        for key in sorted(self.nodes):
            out = self.nodes[key] if out is None else _chan(out, self.nodes[key])
        return out


class MeanVar(PointReduction):
    """Running mean and variance of each unit (the last dimension) of ``point``, over all kept positions.

    ``result()``: ``mean`` and ``var`` (``[D]``, float64; ``var`` with Bessel's
    correction, as ``torch.var``), ``std`` and ``count`` (positions seen).
    Numerically stable (no sum of squares): a large common offset does not
    cost precision.
    """

    kind = "mean_var"

    def __init__(self, point: str, name: str | None = None):
        super().__init__(point, name)
        self.tree = _WindowTree()
        self.width = None

    def update(self, batch: HarvestBatch) -> None:
        acts = self._acts(batch)
        self._check_width(acts.shape[-1])
        p = acts.shape[1]
        if p == 0:
            return
        for i, w in enumerate(batch.window_ids.tolist()):
            x = acts[i].to(torch.float64)              # one window at a time: the same shapes, so the same bits
            mean = x.sum(0) / p
            m2 = (x - mean).square().sum(0)
            self.tree.add(int(w), 0, (float(p), mean, m2))

    def _check_width(self, d: int) -> None:
        if self.width is None:
            self.width = d
        elif self.width != d:
            raise ValueError(f"{self.name}: width {d} after {self.width}; a point's width cannot change in a run")

    def merge(self, other: "MeanVar") -> None:
        self._check_other(other)
        if other.width is not None:
            self._check_width(other.width)
        for (start, level), value in sorted(other.tree.nodes.items()):
            self.tree.add(start, level, value)

    def state_dict(self) -> dict:
        keys = sorted(self.tree.nodes)
        d = self.width or 0
        vals = [self.tree.nodes[k] for k in keys]
        return {
            "starts": torch.tensor([k[0] for k in keys], dtype=torch.int64),
            "levels": torch.tensor([k[1] for k in keys], dtype=torch.int64),
            "counts": torch.tensor([v[0] for v in vals], dtype=torch.float64),
            "means": torch.stack([v[1] for v in vals]) if vals else torch.zeros(0, d, dtype=torch.float64),
            "m2": torch.stack([v[2] for v in vals]) if vals else torch.zeros(0, d, dtype=torch.float64),
        }

    def load_state_dict(self, d: dict) -> None:
        _expect_keys(self, d, ("starts", "levels", "counts", "means", "m2"))
        tree = _WindowTree()
        for s, lv, n, mean, m2 in zip(d["starts"].tolist(), d["levels"].tolist(), d["counts"].tolist(),
                                      d["means"], d["m2"]):
            tree.nodes[(s, lv)] = (n, mean.clone(), m2.clone())
        self.tree = tree
        self.width = d["means"].shape[1] if len(tree.nodes) else None

    def result(self) -> dict:
        total = self.tree.total()
        if total is None:
            raise ValueError(f"{self.name}: no windows were seen, so there is no mean")
        n, mean, m2 = total
        var = m2 / (n - 1) if n > 1 else torch.full_like(m2, math.nan)
        return {"mean": mean, "var": var, "std": var.sqrt(), "count": torch.tensor(int(n))}


# ----------------------------------------------------------------------------- top-k windows
class TopK(PointReduction):
    """The ``k`` windows where each feature is largest, a feature being a unit of ``point`` or a direction.

    ``directions``: ``None`` (each unit of the point is a feature), a ``[D]``
    direction or a ``[F, D]`` matrix of directions (a feature's activation is
    the dot product with its direction). ``sae``: an SAE (SAELens's, or any
    module) that reads ``point``; its features are the output of its
    ``feature`` submodule (``hook_sae_acts_post``), as the SAE spliced into the
    model at ``point`` gives them (docs/attach.md; see :mod:`.sae_features`).
    A window's score is the feature's largest
    value over the kept positions (``positions``: where it is, the first such
    position on ties). Ties between windows go to the lower window id, so the
    result does not depend on the order or split in which windows arrive.

    ``result()``: ``values`` ``[F, k]`` (float32, descending), ``window_ids``
    and ``positions`` ``[F, k]`` (int64); slots not filled (fewer than ``k``
    windows seen) have window id ``-1`` and value ``-inf``.
    """

    kind = "top_k"

    def __init__(self, point: str, k: int = 10, directions: torch.Tensor | None = None, name: str | None = None,
                 *, sae: torch.nn.Module | None = None, feature: str = "hook_sae_acts_post"):
        super().__init__(point, name)
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"TopK: k must be a positive integer, got {k!r}")
        if sae is not None and directions is not None:
            raise ValueError("TopK: give directions or an sae, not both")
        self.k = k
        self.sae = None
        if sae is not None:
            from .sae_features import SAEFeatures
            self.sae = SAEFeatures(sae, feature)
        if directions is not None:
            directions = torch.as_tensor(directions)
            if directions.dim() == 1:
                directions = directions[None]
            if directions.dim() != 2 or not directions.is_floating_point():
                raise ValueError(f"TopK: directions must be a float [D] or [F, D] tensor, got "
                                 f"{tuple(directions.shape)} {directions.dtype}")
            directions = directions.detach().to(torch.float32).contiguous()
        self.directions = directions
        self.values = self.window_ids = self.positions = None

    def __deepcopy__(self, memo):            # the settings (directions, SAE) are shared; the state is copied
        out = copy.copy(self)
        for key in ("values", "window_ids", "positions"):
            value = getattr(self, key)
            setattr(out, key, None if value is None else value.clone())
        return out

    def _suffix(self) -> str:
        if self.sae is not None:
            return f".k{self.k}.sae-{self.sae.digest[:8]}"
        if self.directions is None:
            return f".k{self.k}"
        digest = hashlib.sha256(self.directions.numpy().tobytes()).hexdigest()[:8]
        return f".k{self.k}.directions-{digest}"

    def config(self) -> tuple:
        d = self.directions
        return (self.point, self.k, None if d is None else (tuple(d.shape), d.numpy().tobytes()),
                None if self.sae is None else self.sae.digest)

    def _scores(self, acts: torch.Tensor) -> torch.Tensor:
        """``[F, P]`` feature activations of one window ``[P, D]`` (float32)."""
        if self.sae is not None:
            return self.sae(acts).T
        acts = acts.to(torch.float32)
        if self.directions is None:
            return acts.T
        if self.directions.shape[1] != acts.shape[-1]:
            raise ValueError(f"{self.name}: directions of width {self.directions.shape[1]}, but {self.point} has "
                             f"width {acts.shape[-1]}")
        return self.directions @ acts.T

    def update(self, batch: HarvestBatch) -> None:
        acts = self._acts(batch)
        if acts.shape[1] == 0:
            return
        vals, pos = [], []
        for i in range(acts.shape[0]):               # one window at a time: the same shapes, so the same bits
            s = self._scores(acts[i])
            if torch.isnan(s).any():
                raise ValueError(f"{self.name}: NaN activation in window {int(batch.window_ids[i])}; top-k of NaN "
                                 "has no meaning (check the model's dtype and inputs)")
            best = s.amax(1)
            where = torch.arange(s.shape[1]).expand_as(s)
            pos.append(torch.where(s == best[:, None], where, s.shape[1]).amin(1))
            vals.append(best)
        ids = batch.window_ids.to(torch.int64)[None].expand(len(vals[0]), -1)
        self._take(torch.stack(vals, 1), ids, torch.stack(pos, 1))

    def _take(self, values, window_ids, positions) -> None:
        if self.values is not None:
            if self.values.shape[0] != values.shape[0]:
                raise ValueError(f"{self.name}: {values.shape[0]} features after {self.values.shape[0]}")
            values = torch.cat([self.values, values], 1)
            window_ids = torch.cat([self.window_ids, window_ids], 1)
            positions = torch.cat([self.positions, positions], 1)
        # by window id, then (stable) by value descending: ties keep the lower window id first
        order = window_ids.argsort(dim=1, stable=True)
        values, window_ids, positions = (t.gather(1, order) for t in (values, window_ids, positions))
        order = values.argsort(dim=1, descending=True, stable=True)[:, :self.k]
        self.values, self.window_ids, self.positions = (t.gather(1, order) for t in (values, window_ids, positions))
        ids = self.window_ids.sort(1).values
        if bool(((ids[:, 1:] == ids[:, :-1]) & (ids[:, 1:] != _NO_WINDOW)).any()):
            raise ValueError(f"{self.name}: a window was counted twice: a reduction must see each window once "
                             "(merging two states that share windows double-counts)")

    def merge(self, other: "TopK") -> None:
        self._check_other(other)
        if other.values is not None:
            self._take(other.values, other.window_ids, other.positions)

    def state_dict(self) -> dict:
        if self.values is None:
            return {}
        return {"values": self.values, "window_ids": self.window_ids, "positions": self.positions}

    def load_state_dict(self, d: dict) -> None:
        if not d:
            self.values = self.window_ids = self.positions = None
            return
        _expect_keys(self, d, ("values", "window_ids", "positions"))
        if d["values"].shape[1] > self.k:
            raise ValueError(f"{self.name}: a saved state of k={d['values'].shape[1]}, this reduction has k={self.k}")
        self.values, self.window_ids, self.positions = (d[k].clone() for k in ("values", "window_ids", "positions"))

    def result(self) -> dict:
        if self.values is None:
            raise ValueError(f"{self.name}: no windows were seen")
        if self.values.shape[1] < self.k:   # fewer windows than k: pad, so the result always has k columns
            pad = self.k - self.values.shape[1]
            f = self.values.shape[0]
            return {"values": torch.cat([self.values, torch.full((f, pad), -math.inf)], 1),
                    "window_ids": torch.cat([self.window_ids, torch.full((f, pad), -1, dtype=torch.int64)], 1),
                    "positions": torch.cat([self.positions, torch.full((f, pad), -1, dtype=torch.int64)], 1)}
        return {"values": self.values.clone(), "window_ids": self.window_ids.clone(),
                "positions": self.positions.clone()}

    def __repr__(self):
        d = "" if self.directions is None else f", directions={tuple(self.directions.shape)}"
        d += "" if self.sae is None else f", sae={type(self.sae.sae).__name__}"
        return f"TopK({self.point!r}, k={self.k}{d})"


# ----------------------------------------------------------------------------- histograms
class Histogram(PointReduction):
    """Counts of the values at ``point`` (every unit and kept position) in fixed bins.

    Either ``edges`` (increasing bin edges, as ``numpy.histogram``'s ``bins``
    array: bins are ``[e[i], e[i+1])``, the last one closed) or ``bins`` equal
    bins over ``range=(low, high)`` (edges ``torch.linspace(low, high, bins + 1)``
    in float64). The range is fixed before the run, so every window counts into
    the same bins (this point's own range: one ``Histogram`` per point).

    ``result()``: ``counts`` (``[bins]``, int64), ``edges`` (float64), and the
    values ``below`` the first edge, ``above`` the last, and ``nan``.
    """

    kind = "histogram"

    def __init__(self, point: str, edges=None, *, bins: int | None = None, range: tuple | None = None,
                 name: str | None = None):
        super().__init__(point, name)
        if edges is not None:
            if bins is not None or range is not None:
                raise ValueError("Histogram: give either edges, or bins and range")
            edges = torch.as_tensor(edges, dtype=torch.float64).flatten()
        else:
            if not isinstance(bins, int) or bins < 1 or range is None or len(range) != 2:
                raise ValueError("Histogram: give edges=[...], or bins=N with range=(low, high) "
                                 "(the range is fixed before the run: bins must not move while windows arrive)")
            low, high = (float(v) for v in range)
            edges = torch.linspace(low, high, bins + 1, dtype=torch.float64)
        if edges.numel() < 2 or not bool((edges[1:] > edges[:-1]).all()) or not bool(torch.isfinite(edges).all()):
            raise ValueError(f"Histogram: edges must be finite and strictly increasing, at least two; got {edges}")
        self.edges = edges
        self.counts = torch.zeros(edges.numel() + 1, dtype=torch.int64)   # below, the bins, above
        self.nan = torch.zeros((), dtype=torch.int64)

    def _suffix(self) -> str:
        digest = hashlib.sha256(self.edges.numpy().tobytes()).hexdigest()[:8]
        return f".bins{self.edges.numel() - 1}-{digest}"

    def config(self) -> tuple:
        return (self.point, self.edges.numpy().tobytes())

    def update(self, batch: HarvestBatch) -> None:
        x = self._acts(batch).detach().reshape(-1).to(torch.float64)
        isnan = torch.isnan(x)
        self.nan += isnan.sum()
        x = x[~isnan]
        n = self.edges.numel()
        idx = torch.bucketize(x, self.edges, right=True)    # 0: below; i: [e[i-1], e[i]); n: at or above e[-1]
        idx[x == self.edges[-1]] = n - 1                      # the last bin is closed
        self.counts += torch.bincount(idx, minlength=n + 1)

    def merge(self, other: "Histogram") -> None:
        self._check_other(other)
        self.counts += other.counts
        self.nan += other.nan

    def state_dict(self) -> dict:
        return {"counts": self.counts.clone(), "nan": self.nan.clone()}

    def load_state_dict(self, d: dict) -> None:
        _expect_keys(self, d, ("counts", "nan"))
        if d["counts"].shape != self.counts.shape:
            raise ValueError(f"{self.name}: a saved state of {d['counts'].shape[0] - 2} bins, this histogram has "
                             f"{self.counts.shape[0] - 2}")
        self.counts = d["counts"].clone()
        self.nan = d["nan"].clone()

    def result(self) -> dict:
        return {"counts": self.counts[1:-1].clone(), "edges": self.edges.clone(), "below": self.counts[0].clone(),
                "above": self.counts[-1].clone(), "nan": self.nan.clone()}


def _expect_keys(red, d, keys) -> None:
    missing = [k for k in keys if k not in d]
    if missing:
        raise ValueError(f"{red.name}: the saved state lacks {missing} (has {sorted(d)}): not a state of {red!r}")


def difference_of_means(a, b, point: str | None = None):
    """``mean(a) - mean(b)``: a steering vector from two :class:`MeanVar` reductions (or their results).

    ``a`` and ``b`` are the same point over two datasets (e.g. positive and
    negative prompts). Returns a :class:`~.steering.SteeringVector`
    (float32), which saves in the form ``asyncinterp serve --edit`` reads.
    """
    from .steering import SteeringVector
    names = []
    means = []
    for r in (a, b):
        if isinstance(r, MeanVar):
            names.append(r.point)
            r = r.result()
        if not isinstance(r, dict) or "mean" not in r:
            raise TypeError(f"difference_of_means takes MeanVar reductions or their results, got {type(r).__name__}")
        means.append(r["mean"])
    if len(set(names)) > 1:
        raise ValueError(f"difference_of_means of two different points {names}: compare one point over two datasets")
    if means[0].shape != means[1].shape:
        raise ValueError(f"difference_of_means: widths {tuple(means[0].shape)} and {tuple(means[1].shape)} differ")
    point = point or (names[0] if names else None)
    if point is None:
        raise ValueError("difference_of_means of two results: name the point (point='blocks.6.hook_resid_post')")
    return SteeringVector(point, (means[0] - means[1]).to(torch.float32))
