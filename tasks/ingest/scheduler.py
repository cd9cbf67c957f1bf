"""An ordered, bounded-concurrency scheduler: items (the units of a listing) read in batches on a
pool, their results taken back in the items' order, with a bounded number of batches in flight and
of results waiting, so memory does not grow with the number of items."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass
class Batch(Generic[T]):
    """Units read together: the unread units of up to `span` units of the listing in a row."""

    units: list[T] = field(default_factory=list)
    future: Future | None = None  # once sent
    left: int = 0  # its units not yet taken


def in_order(read: Callable[[list[T]], Future], units: Iterable[T], known: Callable[[T], Any],
             window: int, full: Callable[[list[T]], bool] = bool, span: int = 1) -> Iterator[tuple[T, Any, bool]]:
    """Each unit's outcomes in the units' order, with whether it was read: `known(unit)` when it
    has them, else from `read(batch)`, a Future of the outcomes of a batch of units. A batch is
    sent once `full(batch)` (by default: a unit per batch) or once it covers `span` units of the
    listing, known ones included (so sparse new units, as on a nightly run, still fill `window`
    batches). At most `window` batches are in flight and `window * span` units wait to be taken,
    so memory holds a bounded number of outcomes."""
    pending: deque[tuple[T, Batch | None, Any, bool]] = deque()  # unit, its batch (None: known), place or outcomes
    batch: Batch | None = None
    opened = in_flight = 0

    def send() -> None:
        nonlocal batch
        batch.future = read(batch.units)
        batch = None

    def first() -> tuple[T, Any, bool]:
        nonlocal in_flight
        unit, owner, place, was_read = pending.popleft()
        if owner is None:
            return unit, place, was_read
        if owner.future is None:  # the batch still gathering
            send()
        owner.left -= 1
        in_flight -= owner.left == 0
        return unit, owner.future.result()[place], was_read

    for position, unit in enumerate(units):
        if (outcomes := known(unit)) is None:
            if batch is None:
                batch, opened = Batch(), position
                in_flight += 1
            pending.append((unit, batch, len(batch.units), True))
            batch.units.append(unit)
            batch.left += 1
            if full(batch.units):
                send()
        else:
            pending.append((unit, None, outcomes, False))
        if batch is not None and position + 1 - opened >= span:
            send()
        while in_flight >= window or len(pending) >= window * span:
            yield first()
    while pending:
        yield first()

