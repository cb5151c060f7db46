"""The one bounded cache: least recently used out first, by count and by total weight, from many threads."""

import threading

import pytest

from asyncinterp.lru import LRU


def test_the_least_recently_used_entry_goes_first():
    gone = []
    cache = LRU(2, on_evict=lambda k, v: gone.append((k, v)))
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1          # "a" is now the most recently used
    cache.put("c", 3)
    assert gone == [("b", 2)] and cache.get("b") is None and len(cache) == 2


def test_the_first_value_stored_is_kept_and_returned():
    cache = LRU(4)
    assert cache.put("k", "first") == "first"
    assert cache.put("k", "second") == "first" and cache.get("k") == "first"


def test_a_total_weight_bounds_it_but_the_newest_entry_stays():
    cache = LRU(100, max_weight=10, weigh=lambda key, _: len(key))
    cache.put("aaaa", 1)
    cache.put("bbbb", 2)
    cache.put("cccc", 3)                 # 12 > 10: "aaaa" goes
    assert cache.get("aaaa") is None and cache.weight == 8
    cache.put("x" * 50, 4)               # heavier than the bound alone: it is kept, the rest goes
    assert len(cache) == 1 and cache.weight == 50


def test_many_threads_never_exceed_the_bound():
    cache = LRU(8)

    def work(t):
        for i in range(2000):
            cache.put((t, i % 20), i)
            cache.get((t, (i * 7) % 20))
    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert len(cache) == 8


def test_it_refuses_a_size_below_one():
    with pytest.raises(ValueError, match="at least one"):
        LRU(0)
