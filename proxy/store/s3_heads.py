"""What the S3 backend's latest HEAD of each key found, for the open that follows a stat: a
hit then looks its object up once, and serves exactly the object it vouched for. An open on
its own always asks the bucket (a replica never serves its copy of an object another
replaced), and so does every stat."""

from __future__ import annotations

import time
from collections import OrderedDict

from proxy.core.held import keep_recent
from proxy.store.s3_objects import ObjectInfo

# How soon after a stat an open may use its answer instead of a HEAD of its own.
REUSE_SECONDS = 1.0
_HELD = 4096


class RecentHeads:
    """The latest HEAD answer per key, while it is recent (bounded, most recent first)."""

    def __init__(self) -> None:
        self._found: OrderedDict[str, tuple[ObjectInfo, float]] = OrderedDict()

    def found(self, key: str, info: ObjectInfo | None) -> None:
        """A HEAD of key just found info (None: nothing)."""
        if info is None:
            self._found.pop(key, None)
        else:
            keep_recent(self._found, key, (info, time.monotonic()), _HELD)

    def recent(self, key: str) -> ObjectInfo | None:
        """What a HEAD of key found less than REUSE_SECONDS ago, if one did. It may be stale
        (deleted or replaced since): a use that downloads the object names its ETag
        (If-Match), and so ends in a look at the bucket again."""
        found = self._found.get(key)
        if found is None or time.monotonic() - found[1] > REUSE_SECONDS:
            return None
        return found[0]

    def forget(self, key: str) -> None:
        """key was written, deleted, or found replaced or gone: ask the bucket next time."""
        self._found.pop(key, None)
