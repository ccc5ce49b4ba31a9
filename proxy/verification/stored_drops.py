"""Dropping a stored blob found damaged, the one way the server and the cache commands do it:
under the artifact's fill lock (the caller's), the file goes only while it is still the very
file that was read (otherwise it is gone, or a fill replaced it and its record is the fill's),
and then its record stops vouching for it. Whoever deletes it reports it: once, naming which
copy held the damage (a replica's local copy, or the stored blob itself)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from proxy.core.errors import IntegrityKind
from proxy.store.damage import DamagedFile, Dropped
from proxy.store.protocol import BlobStore, MetadataIndex

# What a package's record says about the stored file (not about the signed package): cleared
# when the file goes, so the next fill records its own.
FILE_FACTS = ("h1", "size", "stored_as")


async def drop_damaged(archives: BlobStore, key: str, damage: DamagedFile,
                       unvouch: Callable[[], Awaitable[None]]) -> Dropped:
    """Drop the damaged blob at key if it is still the file damage was found in, and if the
    blob itself went, `unvouch` its record; returns what went. On a store with local copies
    of shared blobs (S3), damage in this replica's copy takes that copy alone: the shared
    object is deleted only when its own bytes fail the check too (and then unvouched)."""
    dropped = await archives.drop_damaged(key, damage.identity, damage.expected)
    if dropped is Dropped.BLOB:
        await unvouch()
    return dropped


def what_went(dropped: Dropped) -> str:
    """What a drop did, for messages: the fate of the bytes."""
    if dropped is Dropped.LOCAL_COPY:
        return "dropped it alone (the object in the bucket read back intact, and stays)"
    return "dropped, to be fetched again"


def integrity_kind(dropped: Dropped, damage: DamagedFile) -> IntegrityKind:
    """The kind an integrity failure is counted as: damage to a local copy alone is
    hot_copy."""
    return "hot_copy" if dropped is Dropped.LOCAL_COPY else damage.kind


async def forget_package_file(index: MetadataIndex, record: str) -> None:
    """Clear what a package's record says about its stored file (FILE_FACTS); the signed
    facts stay."""
    found = await index.get(record)
    if found is not None:
        await index.set(record, {**found, **dict.fromkeys(FILE_FACTS)})
