"""The S3 backend's index: each document a small JSON object under `<prefix>index/KEY`
(bytes as base64), created-if-absent with a conditional PutObject (If-None-Match: *; 412 and
409 both mean it exists). A local copy of every document this process read or wrote answers
reads while the bucket is unreachable, so hits keep being served; writes still fail then. A
document the bucket says is gone is forgotten there too.
Compare-and-set (fill leases) uses the objects' ETags: PutObject and DeleteObject If-Match."""

from __future__ import annotations

import base64
import contextlib
import json
import sqlite3
from typing import Any

from proxy.core.errors import InsufficientStorage
from proxy.store.index import MetadataCache
from proxy.store.s3_objects import Conflict, ObjectStore, StoreUnavailable

AREA = "index/"
_BYTES = "$bytes"


def encode(value: dict[str, Any]) -> bytes:
    """A document as JSON; bytes values as {"$bytes": base64}."""
    def bytes_as_text(item: object) -> object:
        if isinstance(item, bytes | bytearray):
            return {_BYTES: base64.b64encode(item).decode()}
        raise TypeError(f"cannot store a {type(item).__name__} in an index document")
    return json.dumps(value, default=bytes_as_text, separators=(",", ":")).encode()


def decode(body: bytes) -> dict[str, Any] | None:
    """A document read back (None if it is not a JSON object)."""
    def text_as_bytes(item: dict[str, Any]) -> object:
        if len(item) == 1 and isinstance(item.get(_BYTES), str):
            return base64.b64decode(item[_BYTES])
        return item
    try:
        value = json.loads(body, object_hook=text_as_bytes)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class S3Index:
    """The MetadataIndex over JSON objects in the bucket, with a local copy for reads while
    the bucket is unreachable."""

    def __init__(self, objects: ObjectStore, local: MetadataCache) -> None:
        self._objects = objects
        self._local = local

    async def get(self, key: str) -> dict[str, Any] | None:
        """The document at key; the local copy while the bucket is unreachable."""
        try:
            body = await self._objects.get_bytes(AREA + key)
        except StoreUnavailable:
            kept = await self._local.get(key)
            if kept is None:
                raise
            return kept
        value = None if body is None else decode(body)
        if value is None:  # gone from the bucket (dropped, pruned): gone here too
            if await self._local.get(key) is not None:
                with contextlib.suppress(OSError, sqlite3.Error, InsufficientStorage):
                    await self._local.delete(key)
        elif await self._local.get(key) != value:
            await self._keep(key, value)
        return value

    async def set(self, key: str, value: dict[str, Any]) -> None:
        """Store (replace) the document at key."""
        await self._objects.put_bytes(AREA + key, encode(value))
        await self._keep(key, value)

    async def create(self, key: str, value: dict[str, Any]) -> bool:
        """Store the document only if key holds none (a conditional put): whether it did."""
        try:
            await self._objects.put_bytes(AREA + key, encode(value), if_absent=True)
        except Conflict:
            return False
        await self._keep(key, value)
        return True

    async def delete(self, key: str) -> None:
        """Remove the document at key, if any."""
        await self._objects.delete(AREA + key)
        await self._local.delete(key)

    # Compare-and-set (the fill leases of proxy.store.leases): a document's version is its
    # object's ETag, the conditions PutObject and DeleteObject with If-Match on it. Never
    # answered from the local copy: a lease read from it could be long gone.

    async def get_versioned(self, key: str) -> tuple[dict[str, Any], str] | None:
        """The document at key and its ETag, or None. One that is not a JSON object (empty,
        cut short, written by something else) is an empty document with its ETag: a lease
        nobody can read is taken over like an expired one, never waited for forever."""
        found = await self._objects.get_tagged(AREA + key)
        if found is None:
            return None
        return decode(found[0]) or {}, found[1]

    async def replace(self, key: str, value: dict[str, Any],
                      expected_version: str) -> str | None:
        """Store value at key only while its object has the ETag expected_version (If-Match);
        its new ETag, or None if it is gone or was written since."""
        try:
            return await self._objects.put_bytes(AREA + key, encode(value),
                                                 if_match=expected_version)
        except (Conflict, LookupError):
            return None

    async def delete_if(self, key: str, expected_version: str) -> bool:
        """Remove the document at key only while its object has the ETag expected_version."""
        try:
            await self._objects.delete(AREA + key, expected_version)
        except (Conflict, LookupError):
            return False
        await self._local.delete(key)
        return True

    async def keys(self, prefix: str) -> list[str]:
        """Every key under prefix (all pages), in order."""
        return [found.key.removeprefix(AREA) for found in await self._objects.list(AREA + prefix)]

    async def _keep(self, key: str, value: dict[str, Any]) -> None:
        # The local copy is a fallback: a full local disk must not fail a write that the
        # bucket took.
        with contextlib.suppress(OSError, sqlite3.Error, InsufficientStorage):
            await self._local.set(key, value)
