"""Overlap producing the next items with consuming the current one (one background thread)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
_END = object()


def prefetched(load: Callable[[Any], T], items: Iterable, ahead: int = 1, threads: int = 1) -> Iterator[T]:
    """`load(item)` for each item, in order; up to `ahead` items are loaded by `threads` background
    threads while the caller works on the current one (0: loaded when asked for). `items` may be
    endless."""
    iterator = iter(items)
    if not ahead:
        yield from map(load, iterator)
        return
    with ThreadPoolExecutor(max_workers=threads) as pool:

        def submit() -> bool:
            item = next(iterator, _END)
            if item is not _END:
                upcoming.append(pool.submit(load, item))
            return item is not _END

        upcoming: deque = deque()
        while len(upcoming) < ahead and submit():
            pass
        while upcoming:
            current = upcoming.popleft().result()
            submit()
            yield current
