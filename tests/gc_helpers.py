"""Settling the cyclic garbage collector before a test asserts that code under test leaves no cycles.

One ``gc.collect()`` is not always enough: finalizers and weakref callbacks it
runs can drop the last reference to other cyclic structures, which only the
next collection finds (seen: a vLLM model left behind by ``test_vllm.py`` in
the same process, 27 objects). A test that then asserts ``gc.collect() == 0``
around its own code would count that foreign garbage as its own.
"""

import gc


def settle_garbage(limit: int = 10) -> None:
    """Collect until a collection finds nothing (at most ``limit`` times)."""
    for _ in range(limit):
        if gc.collect() == 0:
            return
