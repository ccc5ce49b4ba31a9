"""The package store: partial files never visible, corrupt files never published."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

import pytest

import proxy
import proxy.verification.stored_hashes
from proxy.core.errors import IntegrityError
from proxy.core.executors import quick_started, serving
from proxy.store.archives import ArchiveStore, FillLock
from proxy.store.disk import DiskBlobStore
from proxy.store.file_identity import identity_of
from proxy.store.spool import SpoolStart, store_package
from proxy.store.usage import UsageLedger
from proxy.verification.hashes import h1_of_zip
from proxy.verification.stored_hashes import (
    DamagedFile,
    h1_of_stored,
    h1_of_written,
    verify_stored,
)
from tests.support.fake_registry import build_zip
from tests.support.held_work import HeldCalls

ZIP = build_zip({"terraform-provider-x_v1.0.0": (random.Random(1).randbytes(20_000), 0o755)})
def leftovers(cache: Path) -> list[Path]:
    """Temp files of unfinished fills anywhere under the cache's tmp directory."""
    return [p for p in (cache / "tmp").rglob("*") if p.is_file() and not p.name.endswith(".lock")]


PARTS = ["archives", "registry.terraform.io", "hashicorp", "x", "1.0.0", "p.zip"]
KEY = "/".join(PARTS)


async def chunks(data: bytes, fail_after: int | None = None) -> AsyncIterator[bytes]:
    for offset in range(0, len(data), 1000):
        if fail_after is not None and offset >= fail_after:
            raise ConnectionResetError("upstream went away")
        yield data[offset:offset + 1000]


async def test_store_publishes_verified_file(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    blobs = DiskBlobStore(store)
    stored = await store_package(blobs, KEY, chunks(ZIP), hashlib.sha256(ZIP).hexdigest())
    assert blobs.path_of(stored.info.key).read_bytes() == ZIP
    assert stored.info.size == len(ZIP) and stored.sha256 == hashlib.sha256(ZIP).hexdigest()
    assert await blobs.stat(KEY) == stored.info
    assert leftovers(tmp_path) == []


async def test_a_look_at_the_store_needs_no_thread(tmp_path: Path) -> None:
    """A hit's and a miss's first look at a stored file (a stat) runs on the event loop: it
    answers while every quick thread is busy (a hop there and back took 0.2-1.2 ms before
    each package's first byte)."""
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    stored = await store_package(blobs, KEY, chunks(ZIP), hashlib.sha256(ZIP).hexdigest())
    async with serving(quick_threads=1):
        busy = HeldCalls(lambda: None)
        taken = quick_started(busy)
        await busy.settled(1, quiet=0.01)
        try:
            async with asyncio.timeout(2):
                assert await blobs.stat(KEY) == stored.info
                assert await blobs.stat(KEY.replace("p.zip", "q.zip")) is None
        finally:
            busy.release()
            await taken


@pytest.mark.parametrize(("data", "fail_after", "error"), [
    (ZIP, None, IntegrityError),              # wrong checksum (expected is of other bytes)
    (b"not a zip at all", None, IntegrityError),
    (ZIP, 2000, ConnectionResetError),         # upstream dies mid-stream
])
async def test_failed_store_publishes_nothing(tmp_path: Path, data: bytes,
                                              fail_after: int | None,
                                              error: type[Exception]) -> None:
    store = ArchiveStore(tmp_path)
    expected = hashlib.sha256(data if data != ZIP or fail_after else b"other").hexdigest()
    with pytest.raises(error):
        await store_package(DiskBlobStore(store), KEY, chunks(data, fail_after), expected)
    assert await DiskBlobStore(store).stat(KEY) is None
    assert leftovers(tmp_path) == []


def test_sweep_removes_what_dead_processes_left_and_spares_live_ones(tmp_path: Path) -> None:
    live = ArchiveStore(tmp_path)          # another process's store, still running
    (live.tmp / "busy.part").write_bytes(b"in progress")
    dead = tmp_path / "tmp" / "p999999-dead"
    dead.mkdir()
    (dead / ".owner.lock").write_bytes(b"")  # nobody holds it any more
    (dead / "half.part").write_bytes(b"half")
    (tmp_path / "tmp" / "old-format.part").write_bytes(b"half")
    young = tmp_path / "tmp" / ".new-just-starting"  # another process setting up
    young.mkdir()
    mine = ArchiveStore(tmp_path)
    assert mine.sweep_temp() == 2
    assert (live.tmp / "busy.part").exists()
    assert not dead.exists()
    assert young.exists()
    live.close()
    assert not live.tmp.exists()  # a clean shutdown removes its own files...
    assert mine.sweep_temp() == 0  # ...so the sweep finds nothing more to remove


def test_sweep_passes_over_a_starting_worker_renaming_its_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers start at the same moment: one sweeps while another renames its pending
    directory into place (seen in CI: the sweeping worker could not start)."""
    mine = ArchiveStore(tmp_path)
    pending = tmp_path / "tmp" / ".new-starting"
    pending.mkdir()
    held = open(pending / ".owner.lock", "wb")  # held for the whole test
    fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    is_dir = Path.is_dir

    def renamed_after_listing(path: Path) -> bool:
        answer = is_dir(path)
        if path == pending:
            pending.rename(tmp_path / "tmp" / "p1-starting")
        return answer

    monkeypatch.setattr(Path, "is_dir", renamed_after_listing)
    assert mine.sweep_temp() == 0
    assert (tmp_path / "tmp" / "p1-starting").is_dir()
    held.close()


def test_close_removes_its_temp_directory_even_if_a_cut_fill_writes_meanwhile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fill cut at shutdown may create a spool file while close() removes the tree: the
    directory must still be gone afterwards (seen as a leftover after SIGTERM)."""
    store = ArchiveStore(tmp_path)
    real_rmtree = shutil.rmtree
    raced = []

    def rmtree_with_a_late_writer(path: Any, ignore_errors: bool = False) -> None:
        real_rmtree(path, ignore_errors=ignore_errors)
        if not raced:  # the late write lands between the files' removal and the rmdir
            raced.append(path)
            Path(path).mkdir(exist_ok=True)
            (Path(path) / "late.part").write_bytes(b"late")

    monkeypatch.setattr(shutil, "rmtree", rmtree_with_a_late_writer)
    store.close()
    assert raced == [store.tmp]
    assert not store.tmp.exists()


def test_sweep_removes_a_killed_process_files_only_once_it_is_dead(tmp_path: Path) -> None:
    """The lock that marks a temp directory live is held by another process, not this one."""
    other = subprocess.Popen(
        [sys.executable, "-c", "import sys\n"
         "from pathlib import Path\n"
         "from proxy.store.archives import ArchiveStore\n"
         "store = ArchiveStore(Path(sys.argv[1]))\n"
         "(store.tmp / 'busy.part').write_bytes(b'in progress')\n"
         "print(store.tmp, flush=True)\n"
         "sys.stdin.read()\n", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(Path(proxy.__file__).resolve().parents[1])})
    try:
        assert other.stdout is not None
        theirs = Path(other.stdout.readline().strip())
        mine = ArchiveStore(tmp_path)
        assert (theirs / "busy.part").exists()
        assert mine.sweep_temp() == 0
        assert (theirs / "busy.part").exists()
    finally:
        other.kill()  # no clean shutdown: its directory stays behind, unlocked
        other.wait()
    assert (theirs / "busy.part").exists()
    assert mine.sweep_temp() == 1
    assert not theirs.exists()


@pytest.mark.parametrize("parts", [["..", "x"], ["a/b"], [""], ["ok", "."], ["a\\b"], []])
def test_unsafe_paths_are_refused(tmp_path: Path, parts: list[str]) -> None:
    with pytest.raises(ValueError):
        ArchiveStore(tmp_path).path_for(parts)


async def test_eviction_is_lru_and_spares_files_in_use(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path, max_size=2500)
    paths = []
    for index in range(3):
        temp = store.temp_file()
        temp.write_bytes(b"x" * 1000)
        os.utime(temp, (1000 + index, 1000 + index))  # oldest first
        paths.append(await store.publish(temp, ["archives", "h", "n", "t", "1.0.0",
                                                f"f{index}.zip"]))
        os.utime(paths[-1], (1000 + index, 1000 + index))
    # The third publish went over 2500: the oldest file went, down to the low-water mark.
    assert [p.exists() for p in paths] == [False, True, True]
    assert store.used_bytes == 2000

    store.max_size = 1500
    sending = store.open_to_send(paths[1])  # stays although it is the oldest
    assert sending is not None
    with sending:
        assert await store.evict() == 1
    assert [p.exists() for p in paths] == [False, True, False]
    assert store.measure() == 1000


async def test_a_use_moves_a_file_up_the_lru_and_leaves_its_mtime_alone(
        tmp_path: Path) -> None:
    """The access time is the LRU clock; the mtime keeps saying when the bytes were written
    (a hit compares it with the one recorded when the file was verified)."""
    store = ArchiveStore(tmp_path, max_size=3500)
    paths = []
    for index in range(3):
        temp = store.temp_file()
        temp.write_bytes(b"x" * 1000)
        paths.append(await store.publish(temp, ["archives", "h", "n", "t", "1.0.0",
                                                f"f{index}.zip"]))
        os.utime(paths[-1], (1000 + index, 1000 + index))  # f0 the least recently used
    store._touched.clear()  # as if the last use were long ago
    store.touch(paths[0])
    for _ in range(500):
        if paths[0].stat().st_atime > 1000:
            break
        await asyncio.sleep(0.01)
    assert paths[0].stat().st_mtime == 1000
    store.max_size = 2500
    assert await store.evict() == 1
    assert [p.exists() for p in paths] == [True, False, True]  # f1 is now the oldest


async def test_size_limit_counts_what_every_store_on_the_directory_wrote(
        tmp_path: Path) -> None:
    # Two stores on one directory, as two processes sharing a cache have.
    first, second = ArchiveStore(tmp_path, max_size=2500), ArchiveStore(tmp_path, max_size=2500)
    for index, store in enumerate((first, second, first, second)):
        temp = store.temp_file()
        temp.write_bytes(b"x" * 1000)
        await store.publish(temp, ["archives", "h", "n", "t", "1.0.0", f"f{index}.zip"])
    on_disk = [p.stat().st_size for p in (tmp_path / "archives").rglob("*.zip")]
    assert sum(on_disk) <= 2500
    for store in (first, second):  # each reports the directory, not its own writes
        store.reread_usage()
        assert (store.used_bytes, store.file_count) == (sum(on_disk), len(on_disk))


async def test_lock_files_stay_a_bounded_set_however_many_artifacts_are_filled(
        tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    for index in range(3000):
        async with FillLock(store.lock_path(f"registry.terraform.io/acme/p{index}/1.0.0/"
                                            "linux_amd64")):
            pass
    assert len(list((tmp_path / "tmp" / "locks").iterdir())) <= 1024


async def test_artifacts_sharing_a_fill_lock_fill_one_after_the_other(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    first_key = "registry.terraform.io/acme/a/1.0.0/linux_amd64"
    shared = store.lock_path(first_key)
    second_key = next(key for key in (f"module/acme/m{index}/aws/1.0.0" for index in range(10**5))
                      if store.lock_path(key) == shared)
    order: list[str] = []

    async def fill(key: str, hold: float) -> None:
        async with FillLock(store.lock_path(key)):
            order.append(f"{key} in")
            await asyncio.sleep(hold)
            order.append(f"{key} out")

    first = asyncio.create_task(fill(first_key, 0.1))
    await asyncio.sleep(0.02)
    await asyncio.wait_for(asyncio.gather(fill(second_key, 0), first), 5)
    assert order == [f"{first_key} in", f"{first_key} out", f"{second_key} in",
                     f"{second_key} out"]


async def test_files_left_uncounted_are_counted_by_the_next_periodic_scan(
        tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path, max_size=10_000)
    store.measure()
    # Renamed into place by a process that died before recording it.
    uncounted = tmp_path / "archives" / "h" / "n" / "t" / "1.0.0" / "lost.zip"
    uncounted.parent.mkdir(parents=True)
    uncounted.write_bytes(b"x" * 3000)
    temp = store.temp_file()
    temp.write_bytes(b"x" * 1000)
    await store.publish(temp, ["archives", "h", "n", "t", "1.0.0", "a.zip"])
    assert store.used_bytes == 1000  # recorded incrementally: the lost file is not seen yet
    with UsageLedger(tmp_path / "tmp" / "locks" / "usage.lock").locked() as ledger:
        recorded = ledger.read()
        assert recorded is not None
        ledger.write(replace(recorded, scanned=time.time() - 3600))  # an hour since a scan
    temp = store.temp_file()
    temp.write_bytes(b"x" * 1000)
    await store.publish(temp, ["archives", "h", "n", "t", "1.0.0", "b.zip"])
    assert (store.used_bytes, store.file_count) == (5000, 3)


def test_per_artifact_lock_files_of_earlier_versions_are_swept(tmp_path: Path) -> None:
    locks = tmp_path / "tmp" / "locks"
    locks.mkdir(parents=True)
    old = [locks / (hashlib.sha256(str(i).encode()).hexdigest()[:32] + ".lock")
           for i in range(50)]
    for lock in old:
        lock.touch()
    store = ArchiveStore(tmp_path)
    stripe = store.lock_path("registry.terraform.io/acme/a/1.0.0/linux_amd64")
    stripe.touch()
    store.measure()  # writes the shared usage record
    store.sweep_temp()
    assert sorted(locks.iterdir()) == sorted([stripe, locks / "usage.lock"])


async def test_growing_file_readers_follow_and_learn_the_outcome(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    blobs = DiskBlobStore(store)
    data = ZIP
    growing = await SpoolStart(blobs).spool(len(data))
    gate = asyncio.Event()

    async def slow_chunks() -> AsyncIterator[bytes]:
        yield data[:3000]
        await gate.wait()
        yield data[3000:]

    fill = asyncio.create_task(store_package(blobs, KEY, slow_chunks(),
                                             hashlib.sha256(data).hexdigest(), growing))
    reader = growing.chunks()
    first = await reader.__anext__()
    assert data.startswith(first) and len(first) < 3000  # the last byte is held back
    gate.set()
    rest = b"".join([chunk async for chunk in reader])
    assert bytes(first) + rest == data
    await fill
    assert growing.final is not None and blobs.path_of(growing.final.key).read_bytes() == data

    bad = await SpoolStart(blobs).spool(len(data))
    failing = asyncio.create_task(store_package(blobs, KEY, chunks(data), "0" * 64, bad))
    with pytest.raises(IntegrityError):
        async for _chunk in bad.chunks():
            pass
    with pytest.raises(IntegrityError):
        await failing


async def test_h1_of_stored_hashes_only_the_signed_bytes(tmp_path: Path) -> None:
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    signed = hashlib.sha256(ZIP).hexdigest()
    await store_package(blobs, KEY, chunks(ZIP), signed)
    path = blobs.path_of(KEY)
    assert await h1_of_stored(blobs, KEY, signed) == h1_of_zip(path)

    # Still a zip, same size, other bytes: refused, naming the file that was read.
    path.write_bytes(ZIP.replace(b"provider-x", b"provider-y"))
    with pytest.raises(DamagedFile) as damage:
        await h1_of_stored(blobs, KEY, signed)
    assert damage.value.kind == "stored" and signed in damage.value.message
    info = path.stat()
    assert damage.value.identity == identity_of(info)

    path.unlink()  # evicted meanwhile: nothing to hash, nothing to drop
    assert await h1_of_stored(blobs, KEY, signed) is None


async def test_the_h1_of_a_file_just_written_does_not_hash_its_bytes_twice(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fill hashed the bytes as it wrote them: while the stored file is that very file, its
    # h1 pass reads it once (the dirhash), not twice (sha256 of the zip again, then the
    # dirhash): a third of the work after every fill.
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    signed = hashlib.sha256(ZIP).hexdigest()
    stored = await store_package(blobs, KEY, chunks(ZIP), signed)
    path = blobs.path_of(KEY)
    hashed: list[int] = []
    real = proxy.verification.stored_hashes.sha256_of_file

    def counted(handle: BinaryIO) -> str:
        hashed.append(1)
        return real(handle)

    monkeypatch.setattr(proxy.verification.stored_hashes, "sha256_of_file", counted)
    assert await h1_of_written(blobs, KEY, signed, stored.info.identity) == h1_of_zip(path)
    assert hashed == []

    # Replaced since (another identity): its bytes are checked against the signed sha256.
    path.write_bytes(ZIP.replace(b"provider-x", b"provider-y"))
    with pytest.raises(DamagedFile, match=f"not the checksum {signed}"):
        await h1_of_written(blobs, KEY, signed, stored.info.identity)
    assert hashed == [1]


async def test_verify_stored_vouches_only_for_the_file_whose_bytes_it_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    signed = hashlib.sha256(ZIP).hexdigest()
    stored = await store_package(blobs, KEY, chunks(ZIP), signed)
    path = blobs.path_of(KEY)
    assert stored.info.identity == identity_of(path.stat())  # publishing kept it
    assert await verify_stored(blobs, KEY, signed) == stored.info.identity

    # Written to while it was read: what was hashed may not be what is there now.
    real = proxy.verification.stored_hashes.sha256_of_file

    def hash_then_write(handle: BinaryIO) -> str:
        digest = real(handle)
        with open(path, "ab") as writer:
            writer.write(b"x")
        return digest

    monkeypatch.setattr(proxy.verification.stored_hashes, "sha256_of_file", hash_then_write)
    with pytest.raises(DamagedFile, match="changed while it was checked"):
        await verify_stored(blobs, KEY, signed)
    monkeypatch.undo()
    with pytest.raises(DamagedFile, match=f"not the checksum {signed}"):
        await verify_stored(blobs, KEY, signed)
    path.unlink()
    assert await verify_stored(blobs, KEY, signed) is None


async def test_signed_zip_that_cannot_be_hashed_is_kept_without_h1(tmp_path: Path) -> None:
    # Upstream signed these very bytes: fetching them again would not help.
    middle = len(ZIP) // 2
    broken = ZIP[:middle] + bytes([ZIP[middle] ^ 0xFF]) + ZIP[middle + 1:]
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    await blobs.put(KEY, chunks(broken))
    assert await h1_of_stored(blobs, KEY, hashlib.sha256(broken).hexdigest()) is None
    assert blobs.path_of(KEY).read_bytes() == broken


async def test_discard_spares_a_file_that_replaced_the_damaged_one(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    await store_package(DiskBlobStore(store), KEY, chunks(ZIP), hashlib.sha256(ZIP).hexdigest())
    first = store.path_for(PARTS)
    read = identity_of(first.stat())
    fresh = store.temp_file()
    fresh.write_bytes(ZIP)
    await store.publish(fresh, PARTS)  # a fill replaced it after it was read
    assert not await store.discard(first, read)
    assert first.exists() and store.used_bytes == len(ZIP)
    now = first.stat()
    assert await store.discard(first, identity_of(now))
    assert not first.exists()
    assert (store.used_bytes, store.file_count) == (0, 0)


async def test_short_writes_are_completed_not_skipped(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # write(2) may take only part of a buffer (a disk filling up, a signal): the rest must
    # follow, or the file misses bytes its sha256 (computed over what upstream sent) vouched for.
    real_write = os.write
    short = []

    def write(fd: int, data: Any) -> int:
        if not os.readlink(f"/proc/self/fd/{fd}").endswith(".part"):
            return real_write(fd, data)
        short.append(fd)
        return real_write(fd, memoryview(data)[:7])

    monkeypatch.setattr(os, "write", write)
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    growing = await SpoolStart(blobs).spool(len(ZIP))
    fill = asyncio.create_task(store_package(blobs, KEY, chunks(ZIP),
                                             hashlib.sha256(ZIP).hexdigest(), growing))
    followed = b"".join([chunk async for chunk in growing.chunks()])
    stored = await fill
    assert short  # the spool was written through the short writes
    assert followed == ZIP
    assert blobs.path_of(stored.info.key).read_bytes() == ZIP
