"""Bounded in-memory holds of derived values (answers as sent), most recently used first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


def keep_recent(held: OrderedDict[K, T], key: K, value: T, limit: int) -> T:
    """Remember value as the most recently used, forgetting the least recently used beyond
    limit; returns value."""
    held[key] = value
    held.move_to_end(key)
    while len(held) > limit:
        held.popitem(last=False)
    return value


class Derived(Generic[T]):
    """Values derived from a source object, one per key, each held while it is asked for
    with that very source (compared by identity: a version list as read, a held document)
    and the same tag (e.g. the expiry of the URLs signed in it)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._held: OrderedDict[Hashable, tuple[object, Hashable, T]] = OrderedDict()

    def get(self, key: Hashable, source: object, tag: Hashable = None) -> T | None:
        """The value held for key if it was derived from source with tag, else None."""
        held = self._held.get(key)
        if held is None or held[0] is not source or held[1] != tag:
            return None
        self._held.move_to_end(key)
        return held[2]

    def put(self, key: Hashable, source: object, value: T, tag: Hashable = None) -> T:
        """Hold value, derived from source with tag, for key; returns value."""
        keep_recent(self._held, key, (source, tag, value), self._limit)
        return value
