"""The storage seam: what the services need from a store of blobs (verified archives) and from
an index of small documents (verified facts, version lists, leases). Keys are `/`-separated
names that proxy.store.layout builds; a backend maps them to files, dict entries or object
keys. Backends: proxy.store.disk (files + diskcache), proxy.store.memory (tests); every
backend passes tests/test_store_compliance.py.

A fill writes a local spool first (clients follow it while it grows, see proxy.store.spool),
verifies it, then `publish`es it: atomically, so that no reader ever sees part of a blob. The
disk backend renames the spool into place (no copy); others read or upload it."""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator, AsyncIterable, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, AsyncExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from proxy.config.settings import CacheConfig
from proxy.core.metrics import Metrics
from proxy.store.damage import Dropped
from proxy.store.disk_space import DiskSpace
from proxy.store.file_identity import FileIdentity

# Asked while waiting for a fill lock: whether the artifact was published meanwhile.
Ready = Callable[[], Awaitable[bool]]
# Told of damage a store found and mended by itself: the blob's key, and what was wrong.
DamageListener = Callable[[str, str], None]

# A key segment: no empty, `.` or `..` segment, no backslash, no NUL, no control character.
_UNSAFE_SEGMENT = re.compile(r"\.{0,2}|.*[\\\x00-\x1f].*", re.DOTALL)


@dataclass(frozen=True)
class BlobInfo:
    """A stored blob as a listing or a stat sees it."""

    key: str
    size: int
    mtime: float  # when its bytes were written (epoch seconds)
    # Changes whenever the bytes are replaced (disk: device, inode, size, mtime; an object
    # store: derived from its ETag): index records keep it to tell "the blob we checked".
    identity: FileIdentity


def check_key(key: str) -> str:
    """key, if it is a safe store key (ValueError if not): relative, `/`-separated, and no
    segment that a file system or an object store would read as something else."""
    if not key or any(_UNSAFE_SEGMENT.fullmatch(part) for part in key.split("/")):
        raise ValueError(f"unsafe store key {key!r}")
    return key


class OpenBlob(Protocol):
    """A blob opened for reading: it reads whole, and eviction leaves it alone, until closed."""

    @property
    def info(self) -> BlobInfo:
        """Its key, size, mtime and identity as opened."""
        ...

    @property
    def local_path(self) -> Path | None:
        """A path the operating system opens this very file by (sendfile fast path); None
        when the blob is not a local file (stream it with `chunks`)."""
        ...

    def file(self) -> BinaryIO:
        """The bytes as a seekable file (blocking reads: use it off the event loop; a remote
        backend may fetch the whole blob first)."""
        ...

    def current_identity(self) -> FileIdentity:
        """The identity of the bytes now (blocking): differs from info.identity if the file
        was written in place since it was opened (disk only; blobs elsewhere are immutable)."""
        ...

    def chunks(self, start: int = 0, end: int | None = None) -> AsyncGenerator[bytes, None]:
        """Bytes start..end (end exclusive; None: to the end, past the end: clamped)."""
        ...

    def close(self) -> None:
        """Release it (blocking but quick)."""
        ...

    def quick_to_close(self) -> bool:
        """Whether close() takes microseconds, so that the event loop may call it: not when
        it may wait (the last descriptor of a file removed meanwhile frees its blocks)."""
        ...


class BlobStore(Protocol):
    """Immutable blobs by key: published whole or not at all, evicted least recently used."""

    @property
    def disk(self) -> DiskSpace:
        """The local disk that spools and work directories are on."""
        ...

    @property
    def used_bytes(self) -> int:
        """Bytes the store holds (the latest view; see reread_usage)."""
        ...

    @property
    def file_count(self) -> int:
        """Blobs the store holds (the latest view)."""
        ...

    def spool_path(self) -> Path:
        """A fresh local file name for a fill to write to before publishing it (not created;
        left-overs of a crash are swept at the next start)."""
        ...

    def work_dir(self) -> Path:
        """A fresh, empty local work directory; the caller removes it."""
        ...

    def fill_notice(self, name: str) -> Path | None:
        """Where the fill of name posts its notice for the other processes of this host
        (proxy.store.fill_notices), in a directory directly inside the temp area that holds
        its spool; None where followers could not tell the published blob is the spool they followed
        (its publish does not keep the spool's identity)."""
        ...

    async def publish(self, key: str, spool: Path) -> BlobInfo:
        """Make the finished spool the blob at key, atomically (replacing any older one);
        the spool is consumed. Keeps the store within its size limit afterwards."""
        ...

    async def put(self, key: str, chunks: AsyncIterable[bytes]) -> BlobInfo:
        """Store a stream as the blob at key, atomically: a put that fails or is cancelled
        leaves nothing visible."""
        ...

    async def stat(self, key: str) -> BlobInfo | None:
        """The blob at key, without opening it; None if there is none."""
        ...

    async def open(self, key: str, use: bool = True) -> OpenBlob | None:
        """Open the blob at key to read it, recorded as a use (unless use is False: a check
        of every blob is no use); None if there is none."""
        ...

    async def delete(self, key: str, identity: FileIdentity | None = None) -> bool:
        """Delete the blob at key, only if it still has identity (None: whatever is there);
        returns whether a blob went."""
        ...

    async def drop_damaged(self, key: str, identity: FileIdentity | None,
                           expected: str | None) -> Dropped:
        """Drop the blob at key, whose bytes were read and found damaged, if it is still
        the one with identity (None: whatever is there). A store that keeps local copies of
        shared blobs drops this replica's copies, and deletes the shared blob only once its
        own bytes, read again, do not have the sha256 expected (None: the one its record
        vouches for). Says what went."""
        ...

    async def open_shared(self, key: str) -> OpenBlob | None:
        """The blob as the store that every replica shares holds it, never a local copy of
        it (a check of the shared bytes themselves); None if there is none."""
        ...

    def watch_damage(self, listener: DamageListener) -> None:
        """listener is told of damage this store finds and mends by itself (a local copy
        dropped and fetched again)."""
        ...

    async def list(self, prefix: str) -> list[BlobInfo]:
        """Every blob whose key starts with prefix, in key order."""
        ...

    async def last_uses(self, prefix: str) -> dict[str, float]:
        """When each blob under prefix was last opened (epoch seconds), as far as the store
        records uses (coarsely: disk every minute, S3 every hour); a blob not in it counts
        from its mtime. May name blobs that are gone (prune clears those)."""
        ...

    def fill_lock(self, name: str, what: str,
                  ready: Ready | None = None) -> AbstractAsyncContextManager[bool]:
        """An exclusive lock on one fill (by name), shared by every process and replica that
        uses the store: one fill of an artifact at a time. Running out of local room while
        it is held (the lock, a spool, the published blob) raises InsufficientStorage for
        `what` (package, module). It yields whether it is held: a caller waiting for another
        holder asks `ready` now and then, and once it answers True (the artifact was
        published) the lock is entered without being held, to serve what was published.
        Failing to coordinate (a store that does not answer) raises Unavailable (503)."""
        ...

    def reread_usage(self) -> None:
        """Refresh used_bytes and file_count from what every user of the store recorded
        (blocking, briefly)."""
        ...

    def health_problem(self) -> str | None:
        """Why this replica cannot take writes now (blocking), or None: it is not ready."""
        ...

    def store_problem(self) -> str | None:
        """Why a store that every replica shares cannot be reached now, or None. Not a
        reason to be unready: what this replica holds is still served (degraded)."""
        ...

    async def direct_url(self, key: str) -> str | None:
        """A URL clients may fetch the blob at themselves, when the operator asked for that
        (cache.s3.serve = "redirect"); None: the proxy sends it."""
        ...


class MetadataIndex(Protocol):
    """Small JSON-able documents by key: verified facts, version lists, leases."""

    async def get(self, key: str) -> dict[str, Any] | None:
        """The document at key, or None."""
        ...

    async def set(self, key: str, value: dict[str, Any]) -> None:
        """Store (replace) the document at key."""
        ...

    async def create(self, key: str, value: dict[str, Any]) -> bool:
        """Store the document only if key holds none, atomically (leases); returns whether
        this call created it."""
        ...

    async def delete(self, key: str) -> None:
        """Remove the document at key, if any."""
        ...

    # Compare-and-set (leases). A version is an opaque token that changes whenever the
    # document at key does: an ETag (a hash of the body, so writes that must be told apart,
    # as a lease's renewals, carry a fresh token in the body), a generation, a counter.

    async def get_versioned(self, key: str) -> tuple[dict[str, Any], str] | None:
        """The document at key and its version, or None."""
        ...

    async def replace(self, key: str, value: dict[str, Any],
                      expected_version: str) -> str | None:
        """Store value at key only if the document there still has expected_version,
        atomically (S3: If-Match); returns the new version, or None if the key is gone or was
        written since (S3: 412 and 409 both mean that)."""
        ...

    async def delete_if(self, key: str, expected_version: str) -> bool:
        """Remove the document at key only if it still has expected_version, atomically;
        returns whether this call removed it."""
        ...

    async def keys(self, prefix: str) -> list[str]:
        """Every key that starts with prefix, in order."""
        ...


@dataclass(frozen=True)
class Storage:
    """The two halves a backend provides, as the services receive them."""

    blobs: BlobStore
    index: MetadataIndex


# How the app opens its storage: cache settings, metrics, and the stack that closes it.
StorageOpener = Callable[[CacheConfig, Metrics, AsyncExitStack], Awaitable[Storage]]


def export_usage(blobs: BlobStore, max_size: int | None, metrics: Metrics) -> None:
    """Report the store's size, blob count and limit as metrics."""
    metrics.cache_bytes.set_function(lambda: blobs.used_bytes)
    metrics.cache_files.set_function(lambda: blobs.file_count)
    metrics.cache_max_bytes.set(max_size or 0)
