"""Last-use marks of the S3 backend's blobs, for `prune`: an object store records writes, not
reads, so a replica that opens a blob writes `<prefix>access/KEY` (a tiny JSON object,
{"used": EPOCH}) in the background, at most once an hour per blob. A hit never waits for a
mark, nor fails for one: a failed write is counted (tfproxy_store_operations_total with
operation "mark") and tried again by a hit a minute later at the earliest."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Callable

from proxy.store.s3_objects import Conflict, ObjectInfo, ObjectStore, StoreUnavailable

log = logging.getLogger(__name__)
AREA = "access/"
EVERY = 3600.0
_RETRY_AFTER = 60.0
_READERS = 8  # marks read at once by last_uses
_REMEMBERED = 100_000  # marks remembered before the old ones are forgotten
_CLOSE_WAIT = 2.0


class AccessMarks:
    """The marks of one replica: which blobs it marked when, and the writes under way."""

    def __init__(self, objects: ObjectStore, clock: Callable[[], float] = time.time,
                 every: float = EVERY) -> None:
        self._objects = objects
        self._clock = clock
        self._every = every
        self._marked: dict[str, float] = {}
        self._writing: set[asyncio.Task[None]] = set()

    def used(self, key: str) -> None:
        """Record a use of the blob at key: a mark written in the background, unless this
        replica marked it within the hour."""
        now = self._clock()
        if now - self._marked.get(key, -math.inf) < self._every:
            return
        self._marked[key] = now  # before the write: a burst of hits makes one PUT
        if len(self._marked) > _REMEMBERED:
            self._forget_old(now)
        task = asyncio.create_task(self._write(key, now))
        self._writing.add(task)
        task.add_done_callback(self._writing.discard)

    def written(self, key: str) -> None:
        """The blob at key was just published: its write time counts as a use."""
        self._marked[key] = self._clock()

    async def _write(self, key: str, now: float) -> None:
        try:
            await self._objects.put_bytes(AREA + key, json.dumps({"used": now}).encode(),
                                          operation="mark")
        except (StoreUnavailable, Conflict) as exc:  # counted by the object store
            self._marked[key] = now - self._every + _RETRY_AFTER
            log.debug("no last-use mark for %s: %s", key, exc)

    def _forget_old(self, now: float) -> None:
        self._marked = {key: at for key, at in self._marked.items() if now - at < self._every}

    async def close(self) -> None:
        """Let the writes under way finish (briefly), then cancel the rest."""
        if not self._writing:
            return
        _done, pending = await asyncio.wait(set(self._writing), timeout=_CLOSE_WAIT)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def last_uses(self, prefix: str) -> dict[str, float]:
        """When each blob under prefix was last marked used (every mark listed and read)."""
        marks = await self._objects.list(AREA + prefix)
        reading = asyncio.Semaphore(_READERS)

        async def read(mark: ObjectInfo) -> tuple[str, float]:
            async with reading:
                body = await self._objects.get_bytes(mark.key)
            return mark.key.removeprefix(AREA), _used(body, mark.mtime)

        return dict(await asyncio.gather(*(read(mark) for mark in marks)))

    async def forget(self, key: str) -> None:
        """Delete the mark of the blob at key (gone, or being deleted)."""
        self._marked.pop(key, None)
        await self._objects.delete(AREA + key)


def _used(body: bytes | None, written: int) -> float:
    """The time a mark says, else when it was written."""
    try:
        used = json.loads(body or b"")["used"]
    except (ValueError, KeyError, TypeError):
        return float(written)
    return float(used) if isinstance(used, int | float) else float(written)
