"""One firing of a point in progress: the full value, each invoke's view of it, and its replacements.

A run makes a :class:`Firing` when a point fires for a batch that several
invokes share (or when a task replaces a value): each waiting task is resumed
with its own rows (``view_for``), replacements are checked and recorded per
invoke (``replace``) and merged into the value the model continues with
(``result``). :class:`StaleWatch` warns when a task edits, in place, a value
whose firing is already over (the edit would be lost).
"""

from __future__ import annotations

import warnings

from ..kernel.errors import ReplacementError, await_site
from .modules import tensor_version
from .views import Layout, check_replacement

__all__ = ["Firing", "StaleEditWarning", "StaleWatch"]


class StaleEditWarning(UserWarning):
    """An intervention edited, in place, a value it awaited earlier, after the model had moved on."""


class StaleWatch:
    """Watches the tensor a task holds across one wait on a future or a sub-task.

    Armed when a task parks on a future/join while holding the value of a
    point (``kernel.parked_holding``). When the task is resumed, if that point's
    firing is over and the task then changes the tensor in place (the classic:
    it waited on a future set at a later point, then edited what it held), the
    model has moved on and the edit is lost: warn, naming the point. Only the
    task's own resumption is watched, so the model's own in-place ops are not
    blamed.
    """

    __slots__ = ("run", "view", "point", "version")

    def __init__(self, run, view, point):
        self.run = run
        self.view = view
        self.point = point
        self.version = None

    def before(self):
        if not self.run.in_firing(self.point.key):   # still inside that firing: edits count
            self.version = tensor_version(self.view)

    def after(self, task):
        if self.version is None or tensor_version(self.view) == self.version:
            return
        where = await_site(task.coro) if not task.done else "its end"
        warnings.warn(StaleEditWarning(
            f"intervention {task.name!r} edited the value of {self.point.describe()} in place after the model had "
            f"run past {self.point.describe()} (it waited on a future or sub-task, and is now at {where}): the "
            "model has already used that value, so the edit is lost. Edit values right after awaiting them "
            "(before awaiting anything else), or replace a later point instead."), stacklevel=2)


class Firing:
    """One hook point firing: the full value, per-invoke views, replacements."""

    __slots__ = ("point", "value", "layout", "views", "replaced", "reshaped")

    def __init__(self, point, value, layout):
        self.point = point
        self.value = value
        self.layout = layout
        self.views = None         # group -> its view, made on first use (none for the whole-batch layout)
        self.replaced = None      # group -> its replacement
        self.reshaped = None      # a whole-batch replacement of another shape (opted in)

    def base_view(self, group):
        """What invoke ``group`` sees of the value now (its replacement, if it made one)."""
        replaced = self.replaced
        if replaced is not None and group in replaced:
            return replaced[group]
        layout = self.layout
        if type(layout) is Layout:   # every invoke sees the whole value: nothing to slice or cache
            return self.value
        views = self.views
        if views is None:
            views = self.views = {}
        elif group in views:
            return views[group]
        v = views[group] = layout.view(self.value, group)
        return v

    def view_for(self, task, trap):
        """The value ``task`` is resumed with at ``trap`` (``kernel.provide``'s ``get_value``)."""
        replaced = self.replaced
        layout = self.layout
        if replaced is None and type(layout) is Layout:   # one invoke (the common case): the value itself
            v = self.value
        else:
            group = task.group
            views = self.views
            if replaced is not None and group in replaced:
                v = replaced[group]
            elif views is None:
                v = layout.view(self.value, group)
                if type(layout) is not Layout:
                    self.views = {group: v}
            elif group in views:
                v = views[group]
            else:
                v = views[group] = layout.view(self.value, group)
        read = trap.read
        return v if read is None else read(v)

    def replace(self, group, trap, new, shape_change: bool = False, dtype_change: bool = False):
        old = self.base_view(group)
        if trap.write is not None:
            new = trap.write(new, old)
        check_replacement(trap.key.describe(), new, old, shape_change=shape_change, dtype_change=dtype_change)
        if shape_change and not self.layout.covers_all(group):
            raise ReplacementError(
                f"{trap.describe()}: a shape-changing replacement must cover the whole batch, but this invoke "
                "owns only some of its rows; run it as its own trace, or keep the shape")
        if self.replaced is None:
            self.replaced = {}
        self.replaced[group] = new
        if self.views:
            self.views.pop(group, None)
        if shape_change:
            self.reshaped = new

    def result(self):
        if not self.replaced:
            return None
        if self.reshaped is not None:
            return self.reshaped
        return self.layout.merge(self.value, self.replaced)
