"""Whether the request under way waited for upstream: its access log line then says `miss`,
also when what it got in the end was a stored file (a fill published meanwhile, or one it
waited for: a module archive being cloned, a package another process was filling). The web
layer watches around a lookup; the services say when they missed."""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager

_WAITED: contextvars.ContextVar[list[bool] | None] = contextvars.ContextVar(
    "waited_for_upstream", default=None)


@contextmanager
def watching_waits() -> Iterator[list[bool]]:
    """Within it, [True] once the lookup missed the cache (a holder shared with any task the
    lookup starts: their context is a copy of this one)."""
    holder = [False]
    token = _WAITED.set(holder)
    try:
        yield holder
    finally:
        _WAITED.reset(token)


def missed_the_cache() -> None:
    """The artifact asked for is not stored: the answer waits for upstream."""
    holder = _WAITED.get()
    if holder is not None:
        holder[0] = True
