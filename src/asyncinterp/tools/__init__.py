"""Research tools built on the public run interface: caches, scan, persistent edits, sessions."""

import inspect

__all__ = ["is_async_fn"]


def is_async_fn(fn) -> bool:
    """True for an ``async def`` function, or an object whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))
