"""What a replica knows of its hot copies (proxy.store.s3): for each, the identity of the local
file (device, inode, size, mtime) as it was when its bytes were written and checked, and their
sha256. A hit compares the open file's identity with it, as the disk backend compares its
files with their records: a copy written to since (damaged in place, truncated, emptied,
replaced by hand) is not the file that was checked, and is never served as it is.

Kept in memory, and in the replica's local index under cache.dir (so that a restart does not
take every copy for damaged): a lookup there happens once per copy and process."""

from __future__ import annotations

import contextlib
import sqlite3
from collections import OrderedDict

from proxy.core.errors import InsufficientStorage
from proxy.core.held import keep_recent
from proxy.store.file_identity import FileIdentity, identity_from_record, identity_to_record
from proxy.store.index import MetadataCache

# Below every key the S3 index's local copy uses (those are index keys: none starts so).
_AREA = "~hot-copies/"
# Copies whose checked identity is held in memory (the rest are read from the local index).
_KNOWN = 65536


class HotCopies:
    """The checked identity and sha256 of each hot copy, by the copy's key."""

    def __init__(self, local: MetadataCache) -> None:
        self._local = local
        self._known: OrderedDict[str, tuple[FileIdentity, str]] = OrderedDict()

    async def record(self, copy_key: str, identity: FileIdentity, sha256: str) -> None:
        """The copy at copy_key is the file with identity, holding bytes with sha256."""
        keep_recent(self._known, copy_key, (identity, sha256), _KNOWN)
        # A full local disk must not fail a hit: the copy is then checked again after a
        # restart, no more.
        with contextlib.suppress(OSError, sqlite3.Error, InsufficientStorage):
            await self._local.set(_AREA + copy_key, {
                "stored_as": identity_to_record(identity), "sha256": sha256})

    async def checked(self, copy_key: str, identity: FileIdentity) -> str | None:
        """The sha256 of the copy at copy_key if it is still the file that was checked (the
        same identity), else None."""
        known = self._known.get(copy_key)
        if known is None:
            known = await self._recorded(copy_key)
            if known is None:
                return None
            keep_recent(self._known, copy_key, known, _KNOWN)
        return known[1] if known[0] == identity else None

    async def forget(self, copy_key: str) -> None:
        """The copy at copy_key went."""
        self._known.pop(copy_key, None)
        with contextlib.suppress(OSError, sqlite3.Error, InsufficientStorage):
            await self._local.delete(_AREA + copy_key)

    async def _recorded(self, copy_key: str) -> tuple[FileIdentity, str] | None:
        try:
            found = await self._local.get(_AREA + copy_key)
        except (OSError, sqlite3.Error):
            return None
        if found is None:
            return None
        identity, sha256 = identity_from_record(found.get("stored_as")), found.get("sha256")
        if identity is None or not isinstance(sha256, str):
            return None
        return identity, sha256
