"""A scripted fake model for kernel tests: points are names, the host knows a fixed order."""

from asyncinterp.kernel import PointTrap, trap


class P(PointTrap):
    """A fake hook point: awaiting it yields itself to the kernel."""

    __slots__ = ("key",)

    def __init__(self, name):
        self.key = name

    def describe(self):
        return self.key

    def __await__(self):
        # through the kernel's own awaitable, like real hook points: error messages
        # then name the intervention's line, not this file
        return trap(self).__await__()


class FakeHost:
    """Plays the model: fixed point order (empty: no static order), records activations."""

    def __init__(self, order=("a", "b", "c", "d")):
        self.order = list(order)
        self.activated = []

    def activate(self, trap, task):
        self.activated.append(trap.key)

    def already_ran(self, trap, current):
        if trap.key not in self.order or current.key not in self.order:
            return False
        return self.order.index(trap.key) < self.order.index(current.key)

    def view_of(self, task, trap):
        return trap.key   # never called: this host does not replace entries

    def parked_holding(self, task):
        pass

    def left_step_loop(self, task):
        pass
