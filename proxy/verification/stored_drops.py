"""Dropping a stored blob found damaged, the one way the server and the cache commands do it:
under the artifact's fill lock (the caller's), the file goes only while it is still the very
file that was read (otherwise it is gone, or a fill replaced it and its record is the fill's),
and then its record stops vouching for it. Whoever deletes it reports it: once."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from proxy.store.protocol import BlobStore, MetadataIndex
from proxy.verification.stored_hashes import DamagedFile

# What a package's record says about the stored file (not about the signed package): cleared
# when the file goes, so the next fill records its own.
FILE_FACTS = ("h1", "size", "stored_as")


async def drop_damaged(archives: BlobStore, key: str, damage: DamagedFile,
                       unvouch: Callable[[], Awaitable[None]]) -> bool:
    """Delete the damaged blob at key if it is still the file damage was found in, then
    `unvouch` its record; returns whether this call deleted it."""
    if not await archives.delete(key, damage.identity):
        return False
    await unvouch()
    return True


async def forget_package_file(index: MetadataIndex, record: str) -> None:
    """Clear what a package's record says about its stored file (FILE_FACTS); the signed
    facts stay."""
    found = await index.get(record)
    if found is not None:
        await index.set(record, {**found, **dict.fromkeys(FILE_FACTS)})
