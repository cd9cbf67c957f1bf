"""Overlap producing the next item with consuming the current one (one background thread)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
_END = object()


def prefetched(load: Callable[[Any], T], items: Iterable, overlap: bool = True) -> Iterator[T]:
    """`load(item)` for each item, in order; with `overlap`, the next item is loaded in a
    background thread while the caller works on the current one. `items` may be endless."""
    iterator = iter(items)
    if not overlap:
        yield from map(load, iterator)
        return
    with ThreadPoolExecutor(max_workers=1) as pool:

        def submit():
            item = next(iterator, _END)
            return None if item is _END else pool.submit(load, item)

        upcoming = submit()
        while upcoming is not None:
            current = upcoming.result()
            upcoming = submit()
            yield current
