"""A fill and the clients that follow it in this process: they get each byte as it arrives,
from memory while it is recent and from the spool file once they fall behind (which they
keep from eviction), never a whole body of a download that fails verification; the fill
hashes off the event loop, and a stalled follower does not make it hold the download in
memory."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import io
import os
import random
import threading
import tracemalloc
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from proxy.core.errors import InsufficientStorage, IntegrityError
from proxy.core.spool import FIRST_READER_WAIT, WINDOW, GrowingFile
from proxy.store import spool as store_spool
from proxy.store.archives import ArchiveStore
from proxy.store.disk import DiskBlobStore
from proxy.store.protocol import BlobInfo
from proxy.store.spool import SpoolStart, store_package
from tests.support.held_work import HeldCalls

KEY = "archives/registry.terraform.io/hashicorp/x/1.0.0/p.zip"


def package(size: int) -> bytes:
    """About size bytes of stored (incompressible) zip: what a fill verifies."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("terraform-provider-x_v1.0.0", random.Random(size).randbytes(size))
    return buffer.getvalue()


async def pieces(data: bytes, size: int = 64 << 10) -> AsyncIterator[bytes]:
    for offset in range(0, len(data), size):
        yield data[offset:offset + size]
        await asyncio.sleep(0)


def spool_fd(fd: int) -> bool:
    return os.readlink(f"/proc/self/fd/{fd}").endswith(".part")


def file_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The offsets of every read of a file from now on (page cache or not)."""
    reads: list[int] = []
    real_preadv, real_pread = os.preadv, os.pread

    def preadv(fd: int, buffers: list[Any], offset: int, flags: int = 0) -> int:
        reads.append(offset)
        return real_preadv(fd, buffers, offset, flags)

    def pread(fd: int, size: int, offset: int) -> bytes:
        reads.append(offset)
        return real_pread(fd, size, offset)

    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(os, "pread", pread)
    return reads


async def held_at_the_end(data: bytes, all_there: asyncio.Event,
                          gate: asyncio.Event) -> AsyncIterator[bytes]:
    """A download whose bytes all come, then wait for gate before it ends (all there, not
    yet verified)."""
    async for chunk in pieces(data, 16 << 10):
        yield chunk
    all_there.set()
    await gate.wait()


async def test_followers_get_bytes_before_they_reach_the_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The disk takes nothing until released: a follower still gets every byte but the
    # last (held back until the download verified) from memory. (The fill goes on while
    # its first MiB is written until 2 MiB more wait for the disk: this is less.)
    data = package(5 << 19)
    held = HeldCalls(os.write, holds=lambda fd, _data: spool_fd(fd))
    monkeypatch.setattr(os, "write", held)
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    spool = await SpoolStart(blobs).spool(len(data))
    fill = asyncio.create_task(store_package(blobs, KEY, pieces(data),
                                             hashlib.sha256(data).hexdigest(), spool))
    chunks = spool.chunks()
    followed = bytearray()
    try:
        async with asyncio.timeout(20):
            while len(followed) < len(data) - 1:
                followed += await chunks.__anext__()
        assert spool.temp.stat().st_size == 0  # none of it was on disk
    finally:
        held.release()
    followed += b"".join([bytes(chunk) async for chunk in chunks])
    stored = await fill
    assert held.started >= 1  # the spool was written through the held calls
    assert bytes(followed) == data
    assert blobs.path_of(stored.info.key).read_bytes() == data


async def test_a_follower_gets_the_first_chunk_before_the_fill_reads_on(
        tmp_path: Path) -> None:
    """Bytes already buffered are read without giving way to other tasks: the first chunk
    reaches a waiting follower (a client's first byte) before the fill reads the next."""
    data = package(1 << 20)
    read = 0

    async def buffered() -> AsyncIterator[bytes]:  # never suspends between chunks
        nonlocal read
        for offset in range(0, len(data), 16 << 10):
            read += 1
            yield data[offset:offset + (16 << 10)]

    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    spool = await SpoolStart(blobs).spool(len(data))
    chunks = spool.chunks()

    async def follow() -> tuple[bytes, int]:
        chunk = await chunks.__anext__()
        return bytes(chunk), read  # what the fill had read when the follower got it

    first = asyncio.create_task(follow())
    await asyncio.sleep(0)  # the follower waits for bytes
    fill = asyncio.create_task(store_package(blobs, KEY, buffered(),
                                             hashlib.sha256(data).hexdigest(), spool))
    got, read_by_then = await first
    assert got and data.startswith(got)
    assert read_by_then == 1
    followed = bytearray(got)
    followed += b"".join([bytes(chunk) async for chunk in chunks])
    await fill
    assert bytes(followed) == data


async def test_a_fill_reads_the_download_once_a_follower_asked_for_bytes(
        tmp_path: Path) -> None:
    """The follower's headers go out first (it asks for bytes once they are): until then the
    fill reads nothing of the download, whose buffered bytes it would go through without
    giving way. Without a follower it reads after FIRST_READER_WAIT."""
    data = package(1 << 20)
    pulled: list[float] = []

    async def download() -> AsyncIterator[bytes]:
        pulled.append(asyncio.get_running_loop().time())
        async for chunk in pieces(data):
            yield chunk

    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    sha256 = hashlib.sha256(data).hexdigest()
    spool = await SpoolStart(blobs).spool(len(data))
    fill = asyncio.create_task(store_package(blobs, KEY, download(), sha256, spool))
    for _turn in range(50):  # the turns a handler takes to send its headers, and more
        await asyncio.sleep(0)
    assert not pulled
    chunks = spool.chunks()
    followed = bytearray(await chunks.__anext__())
    assert pulled
    followed += b"".join([bytes(chunk) async for chunk in chunks])
    await fill
    assert bytes(followed) == data

    pulled.clear()
    alone = await SpoolStart(blobs).spool(len(data))
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(store_package(blobs, KEY + ".2", download(), sha256, alone), 10)
    assert FIRST_READER_WAIT * 0.9 <= pulled[0] - started < FIRST_READER_WAIT + 1


async def test_a_fill_cancelled_while_it_waits_for_its_first_reader_leaves_nothing(
        tmp_path: Path) -> None:
    """A shutdown during the wait: the spool's file is closed and removed, and a reader
    that comes then is told the fill failed (it never hangs on bytes that will not come)."""
    data = package(1 << 16)
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    spool = await SpoolStart(blobs).spool(len(data))
    fill = asyncio.create_task(store_package(blobs, KEY, pieces(data),
                                             hashlib.sha256(data).hexdigest(), spool))
    await asyncio.sleep(FIRST_READER_WAIT / 5)  # waiting for a reader
    fill.cancel()
    with pytest.raises(asyncio.CancelledError):
        await fill
    for _ in range(500):
        if not spool.temp.exists():
            break
        await asyncio.sleep(0.01)
    assert not spool.temp.exists()
    try:
        await asyncio.wait_for(spool.chunks().__anext__(), 5)
    except TimeoutError:
        raise AssertionError("a reader waits for bytes that will not come") from None
    except BaseException:  # the fill's end (its cancellation), as every reader learns it
        pass
    else:
        raise AssertionError("a reader got bytes of a cancelled fill")


async def test_a_fill_waits_for_its_first_reader_once() -> None:
    spool: GrowingFile[BlobInfo] = GrowingFile(Path("/nonexistent"), None)
    started = asyncio.get_running_loop().time()
    await spool.first_reader(0.05)
    await spool.first_reader(0.05)  # the notice's wait, after the download's: not again
    assert asyncio.get_running_loop().time() - started < 0.09


async def test_a_spool_is_handed_out_before_its_file_is_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Making a file can wait on the file system's journal (milliseconds): a cold package's
    headers (its spool handed out) and first bytes do not wait for it. The fill writes the
    file, and a follower that falls behind memory reads it, once it is made."""
    data = package(6 << 20)  # more than the fill lets wait for the disk
    made = HeldCalls(store_spool._make_spool_file)
    monkeypatch.setattr(store_spool, "_make_spool_file", made)
    reads = file_reads(monkeypatch)
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    all_there, gate = asyncio.Event(), asyncio.Event()

    try:
        async with asyncio.timeout(5):
            spool = await SpoolStart(blobs).spool(len(data))
            spool._window = 64 << 10  # most of it on disk only, not in memory
            fill = asyncio.create_task(store_package(
                blobs, KEY, held_at_the_end(data, all_there, gate),
                hashlib.sha256(data).hexdigest(), spool))
            chunks = spool.chunks()  # its file opened for it once made
            first = bytes(await chunks.__anext__())  # from memory
        assert first and data.startswith(first)
        assert not spool.temp.exists() and made.started == 1
    finally:
        made.release()
    await all_there.wait()
    followed = bytearray(first)
    async with asyncio.timeout(20):  # a reader that missed the file would wait for the end
        while len(followed) < len(data) - 1:  # behind what memory holds: from the file
            followed += await chunks.__anext__()
    assert reads and min(reads) == len(first)
    gate.set()
    followed += b"".join([bytes(chunk) async for chunk in chunks])
    stored = await fill
    assert bytes(followed) == data
    assert blobs.path_of(stored.info.key).read_bytes() == data
    assert not list((tmp_path / "tmp").rglob("*.part"))


async def test_a_spool_reads_the_free_space_on_the_event_loop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # One statvfs in a local cache directory takes microseconds; on a thread, its hop waited
    # milliseconds for a core in about a tenth of traced cold misses, before their headers.
    readers: list[str] = []
    real = store_spool.free_bytes

    def free_bytes(directory: Path) -> int:
        readers.append(threading.current_thread().name)
        return real(directory)

    monkeypatch.setattr(store_spool, "free_bytes", free_bytes)
    with pytest.raises(InsufficientStorage):  # read, and found too small for this package
        async with SpoolStart(DiskBlobStore(ArchiveStore(tmp_path))) as start:
            await start.spool(1 << 60)
    assert readers == [threading.current_thread().name]
    assert not list((tmp_path / "tmp").rglob("*.part"))


async def test_a_spool_whose_file_could_not_be_made_is_refused_before_the_headers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Made meanwhile, but not waited for: a failure known by the time upstream answered (no
    # inode left, no permission) is still an error answer, not a body cut short.
    tried: list[Path] = []

    def no_inode_left(temp: Path) -> int:
        tried.append(temp)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store_spool, "_make_spool_file", no_inode_left)
    start = SpoolStart(DiskBlobStore(ArchiveStore(tmp_path)))
    for _ in range(500):
        if tried:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # upstream's answer takes longer than that failure
    with pytest.raises(OSError, match="No space left"):
        await start.spool(10)


async def test_a_spool_refused_before_its_file_is_made_leaves_no_file_once_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A package that cannot fit is a 507 before its headers: by the time that answer goes
    # out its spool file is gone, though it was still being made when it was refused.
    made = HeldCalls(store_spool._make_spool_file)
    monkeypatch.setattr(store_spool, "_make_spool_file", made)
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    made_at_the_end: list[int] = []

    async def refused() -> None:
        with pytest.raises(InsufficientStorage):
            async with SpoolStart(blobs) as start:
                await start.spool(1 << 60)
        made_at_the_end.append(made.finished)

    refusal = asyncio.create_task(refused())
    await made.settled(1, quiet=0.05)
    await asyncio.sleep(0.05)  # the refusal is under way meanwhile
    made.release()
    await refusal
    assert made_at_the_end == [1]
    assert not list((tmp_path / "tmp").rglob("*.part"))


async def test_a_fill_that_fails_before_its_spool_file_is_made_leaves_no_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The file is made after the fill failed and removed what there was: it goes then.
    made = HeldCalls(store_spool._make_spool_file)
    monkeypatch.setattr(store_spool, "_make_spool_file", made)
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    spool = await SpoolStart(blobs).spool(10)

    async def broken() -> AsyncIterator[bytes]:
        raise ConnectionResetError("upstream went away")
        yield b""  # an async generator

    with pytest.raises(ConnectionResetError):
        await store_package(blobs, KEY, broken(), "0" * 64, spool)
    made.release()
    for _ in range(500):
        if made.finished and not spool.temp.exists():
            break
        await asyncio.sleep(0.01)
    assert made.finished == 1 and not spool.temp.exists()


async def test_a_follower_behind_what_memory_holds_reads_the_spool_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # More than the fill lets wait for the disk: most of it is on disk at the end.
    data = package(6 << 20)
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    temp = blobs.spool_path()
    temp.touch()
    spool: GrowingFile[BlobInfo] = GrowingFile(temp, len(data), window=128 << 10)
    reads = file_reads(monkeypatch)
    gate, all_there = asyncio.Event(), asyncio.Event()

    fill = asyncio.create_task(store_package(blobs, KEY, held_at_the_end(data, all_there, gate),
                                             hashlib.sha256(data).hexdigest(), spool))
    chunks = spool.chunks()
    first = bytes(await chunks.__anext__())  # from memory, as the download starts
    await all_there.wait()
    assert spool.received == len(data) and not reads
    behind = bytearray(first)
    while len(behind) < len(data) - 1:  # the rest, most of it from the file
        behind += await chunks.__anext__()
    assert reads and min(reads) == len(first)
    gate.set()
    behind += b"".join([bytes(chunk) async for chunk in chunks])
    await fill
    assert bytes(behind) == data


async def test_a_failed_download_cuts_every_follower_before_its_last_byte(
        tmp_path: Path) -> None:
    # One follower keeps up (from memory), one fell far behind (from the file): neither
    # ever holds the whole body of a download that did not verify.
    data = package(1 << 20)
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    temp = blobs.spool_path()
    temp.touch()
    spool: GrowingFile[BlobInfo] = GrowingFile(temp, len(data), window=64 << 10)
    fill = asyncio.create_task(store_package(blobs, KEY, pieces(data, 8 << 10), "0" * 64,
                                             spool))
    keeping_up, lagging = bytearray(), bytearray()

    async def follow(into: bytearray, stall: asyncio.Event | None) -> None:
        async for chunk in spool.chunks():
            into += chunk
            if stall is not None:
                await stall.wait()

    stall = asyncio.Event()
    followers = [asyncio.create_task(follow(keeping_up, None)),
                 asyncio.create_task(follow(lagging, stall))]
    with pytest.raises(IntegrityError):
        await fill
    stall.set()
    for follower in followers:
        with pytest.raises(IntegrityError):
            await follower
    assert len(keeping_up) == len(data) - 1 and data.startswith(keeping_up)
    assert len(lagging) < len(data) and data.startswith(lagging)
    assert not temp.exists()


async def test_a_stalled_follower_does_not_make_the_fill_hold_the_download(
        tmp_path: Path) -> None:
    data = package(64 << 20)
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    spool = await SpoolStart(blobs).spool(len(data))
    chunks = spool.chunks()
    tracemalloc.start()
    try:
        fill = asyncio.create_task(store_package(blobs, KEY, pieces(data, 256 << 10),
                                                 hashlib.sha256(data).hexdigest(), spool))
        first = await chunks.__anext__()  # then it reads nothing until the fill ended
        await fill
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # What memory holds for followers (the window, and what waits for the disk, a few MiB):
    # far from all of it.
    assert peak < WINDOW + (20 << 20), peak
    rest = b"".join([bytes(chunk) async for chunk in chunks])
    assert bytes(first) + rest == data


async def test_the_fill_hashes_off_the_event_loop(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Hashing a package is CPU work over all of it: on the loop it would hold up every
    # client of the process, chunk after chunk.
    hashed_on: set[int] = set()
    real = hashlib.sha256

    class Recorded:
        def __init__(self, *args: Any) -> None:
            self._digest = real(*args)

        def update(self, data: Any) -> None:
            hashed_on.add(threading.get_ident())
            self._digest.update(data)

        def hexdigest(self) -> str:
            return self._digest.hexdigest()

    data = package(3 << 20)
    expected = real(data).hexdigest()
    monkeypatch.setattr(hashlib, "sha256", Recorded)
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    stored = await store_package(blobs, KEY, pieces(data), expected)
    assert stored.sha256 == expected
    assert hashed_on and threading.get_ident() not in hashed_on


async def test_a_follower_that_needs_the_file_once_it_was_published_reads_what_it_became(
        tmp_path: Path) -> None:
    # Its first bytes came from memory; the rest left memory, and the spool was renamed
    # into place before this follower opened it.
    whole = bytes(range(20))

    async def published(final: bytes) -> AsyncIterator[bytes]:
        yield final[:7]
        yield final[7:]

    spool: GrowingFile[bytes] = GrowingFile(tmp_path / "gone.part", len(whole),
                                            published=published, window=10)
    chunks = spool.chunks()
    spool.arrived(whole[:10])
    first = bytes(await chunks.__anext__())
    assert first == whole[:9]  # the last byte so far is held back
    spool.arrived(whole[10:])
    spool.advance(20)
    spool.complete(whole)
    rest = b"".join([bytes(chunk) async for chunk in chunks])
    assert first + rest == whole


async def test_a_follower_keeps_the_spool_from_eviction(tmp_path: Path) -> None:
    # Eviction skips a file that someone has open with a shared lock: the spool, once
    # published, is that file, and a follower may still need to read it.
    data = package(1 << 20)
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    spool = await SpoolStart(blobs).spool(len(data))
    assert spool.made is not None
    os.close(await spool.made)  # made meanwhile; its fill, which would write it, is not run here
    chunks = spool.chunks()
    spool.arrived(data[:1000])
    assert bytes(await chunks.__anext__()) == data[:999]  # from memory

    def evictable() -> bool:
        # Read from /proc/locks, not probed with an exclusive flock: a probe that holds the
        # lock the instant the follower marks the file makes the follower skip its mark (as
        # it skips it for a file being evicted that instant), and the test waits in vain.
        inode = os.stat(spool.temp).st_ino
        with open("/proc/locks") as locks:
            return not any(line.split()[1:4] == ["FLOCK", "ADVISORY", "READ"]
                           and line.split()[5].endswith(f":{inode}") for line in locks)

    for _ in range(1000):  # the follower opens the file meanwhile (slow pool: a loaded CI)
        if not evictable():
            break
        await asyncio.sleep(0.01)
    assert not evictable()
    await chunks.aclose()
    for _ in range(1000):  # and lets it go when it leaves
        if evictable():
            break
        await asyncio.sleep(0.01)
    assert evictable()


async def test_a_slow_downloads_bytes_reach_the_spool_file_while_it_runs(
        tmp_path: Path) -> None:
    # Followers in other processes (workers, replicas) follow the spool file, not this
    # process's memory: a trickling upstream must not keep its bytes off disk until a whole
    # batch (1 MiB) has come.
    data = package(4096)
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    spool = await SpoolStart(blobs).spool(len(data))
    gate = asyncio.Event()

    async def trickle() -> AsyncIterator[bytes]:
        for offset in range(0, 480, 32):
            yield data[offset:offset + 32]
            await asyncio.sleep(0.02)
        await gate.wait()  # upstream stalls: the download is far from done
        yield data[480:]

    fill = asyncio.create_task(store_package(blobs, KEY, trickle(),
                                             hashlib.sha256(data).hexdigest(), spool))
    try:
        on_disk = 0
        for _ in range(250):  # the file is polled: nothing signals a write to it
            on_disk = spool.temp.stat().st_size if spool.temp.exists() else 0
            if on_disk:
                break
            await asyncio.sleep(0.02)
        assert on_disk > 0 and not fill.done()
    finally:
        gate.set()
    stored = await fill
    assert blobs.path_of(stored.info.key).read_bytes() == data


async def test_a_fill_flushes_its_bytes_to_the_disk_while_it_downloads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The fsync before publishing holds up the last byte of every follower: flushed all at
    # once at the end, a 100 MiB package made each of them wait ~45 ms more.
    flushed_at: list[int] = []
    real = os.fdatasync

    def fdatasync(fd: int) -> None:
        if spool_fd(fd):
            flushed_at.append(os.fstat(fd).st_size)
        real(fd)

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    data = package(40 << 20)
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    stored = await store_package(blobs, KEY, pieces(data, 1 << 20),
                                 hashlib.sha256(data).hexdigest())
    assert blobs.path_of(stored.info.key).read_bytes() == data
    assert len(flushed_at) >= 2, flushed_at  # along the way, not only at the end
    assert flushed_at[0] < len(data) // 2, flushed_at


async def test_a_flush_that_fails_fails_the_fill(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # A disk that fails a flush lost bytes the hash vouches for: nothing is published.
    def fdatasync(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", fdatasync)
    data = package(40 << 20)
    store = ArchiveStore(tmp_path)
    blobs = DiskBlobStore(store)
    spool = await SpoolStart(blobs).spool(len(data))
    with pytest.raises(OSError, match="Input/output error"):
        await store_package(blobs, KEY, pieces(data, 1 << 20),
                            hashlib.sha256(data).hexdigest(), spool)
    assert spool.error is not None
    assert not blobs.path_of(KEY).exists()
    assert [p for p in store.tmp.rglob("*.part")] == []
