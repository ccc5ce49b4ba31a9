"""Fill leases in the metadata index: one fill of an artifact at a time across replicas that
share a store with no locks of its own (an object store), as a backend's `fill_lock`.

A lease is the document `leases/<name>`, created only if absent (S3: If-None-Match: *). Its
holder renews it every third of its duration with a compare-and-set on the version it wrote
last (S3: If-Match on its ETag), and releases it with a delete on that version, so that a
holder never removes a lease another took. Each write carries a fresh random token: no two
writes look alike (an object store's ETag is a hash of the body).

A waiter polls with backoff (`first_poll` doubling up to `max_poll`, a quarter second: a
waiter on another replica serves a package within that of its publish) and takes a lease over
with a compare-and-set on the version it observed (exactly one taker) once the lease expired:
its `expires_at` passed by the waiter's clock, or it did not change for a whole duration by
the waiter's monotonic clock (a holder whose clock runs ahead cannot block a fill for long).
A lease document that cannot be read (empty, cut short, written by something else) counts as
one with no expiry: taken over once it stayed the same for a whole duration. A waiter gives
up after `max_wait` seconds in all (503): a holder that keeps renewing cannot hold its
clients forever.
Between polls it asks `ready` whether the artifact was published meanwhile, and then stops
waiting at once (the lock is entered, not held): waiters on other replicas serve a package as
soon as it is published, not when the holder is done with it (its h1 pass).

A holder whose renewal finds its lease taken (it stalled beyond the duration) is `lost`: it is
logged and counted, and its fill goes on. Its clients are reading its spool, and publishing
verified bytes is atomic and idempotent: the worst outcome is a second download, never a
wrong blob. Index errors are retried for `error_patience` seconds, then the caller gets 503.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from proxy.core.errors import ProxyError, Unavailable
from proxy.core.metrics import Metrics
from proxy.store import layout
from proxy.store.protocol import BlobStore, MetadataIndex, Ready

log = logging.getLogger(__name__)

T = TypeVar("T")
# acquired (at once), waited (for another holder), taken_over (an expired lease), lost.
OUTCOMES = ("acquired", "waited", "taken_over", "lost")


@dataclass(frozen=True)
class LeaseTimings:
    """How long a lease lasts unrenewed, how waiters poll, how long index errors are retried."""

    seconds: float = 30.0
    first_poll: float = 0.05
    max_poll: float = 0.25
    error_patience: float = 5.0
    max_wait: float = 1800.0

    @classmethod
    def for_duration(cls, seconds: float, max_wait: float = 1800.0) -> LeaseTimings:
        """The timings of leases that last seconds unrenewed, waited for max_wait at most."""
        return cls(seconds=seconds, max_wait=max_wait)

    @property
    def renew_every(self) -> float:
        """A renewal every third of the duration: two may fail before the lease expires."""
        return self.seconds / 3


async def fill_unless_published(blobs: BlobStore, name: str, what: str,
                                published: Callable[[], Awaitable[T | None]],
                                fill: Callable[[], Awaitable[T]],
                                locked: Callable[[], None] | None = None,
                                follow: Callable[[], Awaitable[T | None]] | None = None) -> T:
    """What `published` finds, else the result of `fill` run under the fill lock. Checked
    again once the lock is taken (another fill may just have published it), and while
    waiting for another holder: a waiter serves the artifact as soon as it is published.
    locked() is called as soon as the lock is taken, before that second look (to start
    what the fill will need meanwhile). A waiter also asks `follow` (if given) for what it can
    send while another process fills it (proxy.store.fill_notices), and stops waiting once
    that answers."""
    found: T | None = None

    async def ready() -> bool:
        nonlocal found
        found = await published()
        if found is None and follow is not None:
            found = await follow()
        return found is not None

    while True:
        async with blobs.fill_lock(name, what, ready) as held:
            if held:
                if locked is not None:
                    locked()
                found = await published()
                return found if found is not None else await fill()
            if found is not None:  # else it went again meanwhile: wait for the lock
                return found


def lease_outcomes(metrics: Metrics) -> Callable[[str], None]:
    """Counts lease outcomes as tfproxy_fill_leases_total{outcome}."""
    return lambda outcome: metrics.fill_leases.labels(outcome).inc()


def lease_key(name: str) -> str:
    """The index key of the lease on one fill."""
    return layout.LEASE_RECORDS + name


class FillLeases:
    """Fill leases over one index, for one replica: a backend's `fill_lock`. Waiters in this
    replica are woken at once when a lease taken here is released."""

    def __init__(self, index: MetadataIndex, timings: LeaseTimings | None = None,
                 on_outcome: Callable[[str], None] | None = None) -> None:
        self.index = index
        self.timings = timings or LeaseTimings()
        self._on_outcome = on_outcome
        self.holder = f"{socket.gethostname()} pid {os.getpid()}"
        self._wakeups: dict[str, tuple[asyncio.Event, int]] = {}

    def lock(self, name: str, what: str, ready: Ready | None = None) -> IndexLease:
        """The lease on one fill, as an async context manager that yields whether it is held
        (False: `ready` said the artifact was published while waiting)."""
        return IndexLease(self, name, what, ready)

    def count(self, outcome: str) -> None:
        """Report one lease outcome (a metric)."""
        if self._on_outcome is not None:
            self._on_outcome(outcome)

    async def wait_release(self, key: str, seconds: float) -> None:
        """Sleep up to seconds, less if a lease on key is released in this replica."""
        event, waiting = self._wakeups.get(key, (asyncio.Event(), 0))
        self._wakeups[key] = (event, waiting + 1)
        try:
            async with asyncio.timeout(seconds):
                await event.wait()
        except TimeoutError:
            pass
        finally:
            event, waiting = self._wakeups.get(key, (event, 1))
            if waiting <= 1:
                self._wakeups.pop(key, None)
            else:
                self._wakeups[key] = (event, waiting - 1)

    def released(self, key: str) -> None:
        """Wake this replica's waiters for key."""
        found = self._wakeups.pop(key, None)
        if found is not None:
            found[0].set()

    async def patiently(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """call, retried with backoff while the index fails (not ProxyErrors: out of space is
        already an answer), for error_patience seconds; then 503."""
        give_up = time.monotonic() + self.timings.error_patience
        delay = self.timings.first_poll
        while True:
            try:
                return await call()
            except ProxyError:
                raise
            except Exception as exc:
                if time.monotonic() + delay > give_up:
                    log.error("fill lease %s: the store does not answer: %r", what, exc)
                    raise Unavailable(f"cannot coordinate the fill of {what}: the store "
                                      "does not answer; try again shortly") from exc
                log.warning("fill lease %s: the store failed (%r); retrying", what, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.timings.max_poll)


class IndexLease:
    """One fill's lease: entered when acquired (or when the artifact is ready), renewed in
    the background while held, released on exit."""

    def __init__(self, leases: FillLeases, name: str, what: str, ready: Ready | None) -> None:
        self._leases = leases
        self._index = leases.index
        self._timings = leases.timings
        self._key = lease_key(name)
        self._name = name
        self._what = what
        self._ready = ready
        self._owner = uuid.uuid4().hex
        self._version: str | None = None
        self._renewal: asyncio.Task[None] | None = None
        self.lost = False

    @property
    def held(self) -> bool:
        """Whether this lease is held (entered, not lost, not released)."""
        return self._version is not None and not self.lost

    async def __aenter__(self) -> bool:
        outcome = await self._acquire()
        if outcome is None:
            return False
        self._leases.count(outcome)
        self._renewal = asyncio.create_task(self._renew())
        return True

    async def __aexit__(self, *_exc: object) -> None:
        if self._renewal is not None:
            self._renewal.cancel()
            await asyncio.gather(self._renewal, return_exceptions=True)
            self._renewal = None
        version, self._version = self._version, None
        if version is None or self.lost:
            return
        try:
            await self._index.delete_if(self._key, version)
        except Exception as exc:  # it expires on its own
            log.warning("fill lease %s: not released (%r); it expires in %.0f s",
                        self._name, exc, self._timings.seconds)
        self._leases.released(self._key)

    def _document(self) -> dict[str, Any]:
        return {"owner": self._owner, "holder": self._leases.holder, "what": self._what,
                "expires_at": time.time() + self._timings.seconds,
                "write": uuid.uuid4().hex}

    async def _acquire(self) -> str | None:
        """acquired, waited or taken_over once held; None if ready said to stop waiting.
        Each poll reads the lease (and asks `ready`); it is created only when it is absent."""
        delay = self._timings.first_poll
        waited = False
        seen: tuple[str, float] | None = None  # a version, and since when (monotonic)
        give_up = time.monotonic() + self._timings.max_wait
        absent = True  # as far as this waiter knows: try to create it
        while True:
            if absent:
                await self._leases.patiently(
                    self._name, lambda: self._index.create(self._key, self._document()))
            found = await self._leases.patiently(
                self._name, lambda: self._index.get_versioned(self._key))
            absent = found is None
            if found is None:  # released meanwhile: create it at once
                continue
            document, version = found
            if document.get("owner") == self._owner:  # created by this call (or the retry)
                self._version = version
                return "waited" if waited else "acquired"
            if seen is None or seen[0] != version:
                seen = (version, time.monotonic())
            if self._expired(document, time.monotonic() - seen[1]):
                if await self._take_over(document, version):
                    return "taken_over"
                await asyncio.sleep(delay)  # another took it: look again after a pause
                continue
            waited = True
            if self._ready is not None and await self._ready():
                self._leases.count("waited")
                return None
            if time.monotonic() >= give_up:
                raise Unavailable(
                    f"waited {self._timings.max_wait:.0f} s for another replica's fill of "
                    f"{self._what} ({document.get('holder', 'an unknown holder')}); try again")
            await self._leases.wait_release(self._key, delay)
            delay = min(delay * 2, self._timings.max_poll)

    def _expired(self, document: dict[str, Any], unchanged_for: float) -> bool:
        expires_at = document.get("expires_at")
        if isinstance(expires_at, int | float) and expires_at <= time.time():
            return True
        return unchanged_for >= self._timings.seconds

    async def _take_over(self, document: dict[str, Any], version: str) -> bool:
        taken = await self._leases.patiently(
            self._name, lambda: self._index.replace(self._key, self._document(), version))
        if taken is None:
            return False  # another waiter took it, or its holder renewed or released it
        self._version = taken
        log.warning("fill lease %s: took over from %s, whose lease expired unrenewed",
                    self._name, document.get("holder", "an unknown holder"))
        return True

    async def _renew(self) -> None:
        """Renew every third of the duration until released; stop when the lease was taken
        or could not be renewed before it expired (lost)."""
        while True:
            await asyncio.sleep(self._timings.renew_every)
            version = self._version
            assert version is not None
            renewed = await self._renewed(version)
            if renewed is None:
                self.lost = True
                self._leases.count("lost")
                log.warning("fill lease %s: lost (not renewed in time: another replica may "
                            "fill it too); this fill goes on and publishes the same verified "
                            "bytes", self._name)
                return
            self._version = renewed

    async def _renewed(self, version: str) -> str | None:
        """The version of the renewed lease; None if it was taken, or if the store failed
        until it expired."""
        expires = time.monotonic() + self._timings.seconds - self._timings.renew_every
        delay = self._timings.first_poll
        while True:
            try:
                return await self._index.replace(self._key, self._document(), version)
            except Exception as exc:
                if time.monotonic() + delay >= expires:
                    return None
                log.warning("fill lease %s: renewal failed (%r); retrying", self._name, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._timings.max_poll)
