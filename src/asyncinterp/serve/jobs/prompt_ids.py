"""A tenant's prompts, tokenized once per server: the token ids of prompt strings a job's owner sent before.

Research is a sweep: the same prompts come back with a different layer, strength or
position (a patching sweep, a steering sweep). Tokenizing a job's prompts costs it
100-300 µs on a server whose caches the last forward emptied, as much as the rest of
reading the job. A prompt's ids depend only on the string and the tokenizer, so they
are kept per tokenizer (a server has one), bounded by count and by characters.

**Kept per owner** (the sha256 of the API key, ``""`` on a server without keys). A
hit is faster than a miss, so a cache shared by tenants would tell one of them, by
timing, whether another sent a given prompt: the leak ``docs/serving.md`` rules out
for intervened requests. Here a tenant only ever hits the prompts it sent itself.
"""

from __future__ import annotations

import threading
import weakref

from ...lru import LRU

__all__ = ["MAX_CHARS", "MAX_PROMPTS", "PromptIds", "of"]

#: prompts kept per tokenizer (all owners together), and their characters and ids in all
MAX_PROMPTS = 4096
MAX_CHARS = 16 << 20


class PromptIds:
    """``(owner, prompt) -> ids`` (a tuple: each caller makes its own list), least recently used forgotten."""

    def __init__(self, size: int = MAX_PROMPTS, max_chars: int = MAX_CHARS):
        self._kept = LRU(size, max_weight=max_chars, weigh=lambda key, ids: len(key[1]) + len(ids))

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, owner: str, prompt: str):
        """The ids ``owner`` got for ``prompt`` before, or ``None``."""
        return self._kept.get((owner, prompt))

    def put(self, owner: str, prompt: str, ids) -> None:
        self._kept.put((owner, prompt), tuple(ids))


_BY_TOKENIZER = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def of(tokenizer) -> PromptIds | None:
    """The kept ids of ``tokenizer``'s prompts (one :class:`PromptIds` per tokenizer object, gone with it);
    ``None`` for a tokenizer that cannot be weakly referenced or hashed (its prompts are then not kept)."""
    with _lock:
        try:
            kept = _BY_TOKENIZER.get(tokenizer)
            if kept is None:
                kept = _BY_TOKENIZER[tokenizer] = PromptIds()
        except TypeError:
            return None
        return kept
