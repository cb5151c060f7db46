"""Module call order: knowing that a point has already run without hooking it.

A task resumed at ``layers[5].output`` that awaits ``layers[3].output`` must
fail at once (out of order), even though nobody hooked layer 3. The hook
layer knows exact counts only for points it hooks, so the first run of every
wrapped model records, once, the order in which modules are entered and left
(global module hooks, this thread, the first top-level pass only). Later runs
answer "has this point already run?" from that record; while the record is
being made, from the live record.
"""

from __future__ import annotations

import threading

import torch
from torch.nn.modules import module as _torch_module


class CallOrder:
    """Enter/exit indices of each module's first call in one forward pass."""

    def __init__(self):
        self.enter = {}   # module -> index
        self.exit = {}
        self.index = {}   # (module, "inputs" | "output") -> index: a point's ``position`` looked up at once
        self.complete = False

    def place_of(self, point):
        """Index of ``point``'s ``position`` in the pass (``None`` if it has none or never ran).

        Once the order is complete, the answer is kept on the point itself
        (``point.order_cache``, for points that have that slot), so later runs
        read it there instead of hashing ``(module, kind)`` into ``index``.
        """
        cached = getattr(point, "order_cache", None)
        if cached is not None and cached[0] is self:
            return cached[1]
        place = self.index.get(point.position)
        if self.complete:
            try:
                point.order_cache = (self, place)
            except AttributeError:   # a point kind without the slot: looked up every time
                pass
        return place

    def ran_before(self, point, current) -> bool:
        """Whether ``point`` comes before ``current`` in the pass (``False`` if either has no place)."""
        target = self.place_of(point)
        if target is None:
            return False
        now = self.place_of(current)
        return now is not None and target < now


class OrderRecorder:
    """Records a :class:`CallOrder` for one pass of ``root`` on this thread."""

    def __init__(self, root: torch.nn.Module, order: CallOrder):
        self.root = root
        self.order = order
        self.members = {id(m) for m in root.modules()}
        self.thread = threading.get_ident()
        self.counter = 0
        self.depth = 0
        self.done = False
        self.handles = []

    def __enter__(self):
        self.handles.append(_torch_module.register_module_forward_pre_hook(self._pre))
        self.handles.append(_torch_module.register_module_forward_hook(self._post))
        return self

    def __exit__(self, *exc):
        self.stop()
        return False

    def stop(self):
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def _pre(self, module, args):
        if self.done or id(module) not in self.members or threading.get_ident() != self.thread:
            return None
        self.counter += 1
        if module not in self.order.enter:
            self.order.enter[module] = self.counter
            self.order.index[(module, "inputs")] = self.counter
        if module is self.root:
            self.depth += 1
        return None

    def _post(self, module, args, output):
        if self.done or id(module) not in self.members or threading.get_ident() != self.thread:
            return None
        self.counter += 1
        if module not in self.order.exit:
            self.order.exit[module] = self.counter
            self.order.index[(module, "output")] = self.counter
        if module is self.root:
            self.depth -= 1
            if self.depth == 0:
                self.order.complete = True
                self.done = True
                self.stop()
        return None
