"""Fill notices (proxy.store.fill_notices): what a process waiting for another's fill may
follow, and what it must not: a notice of a process that is gone or that this process
cannot see, one naming a file outside the store's temp area, one a later fill replaced; and
a followed spool's last byte, which goes out only once the very file followed is
published."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest

from proxy.core.errors import UpstreamError
from proxy.core.spool import FIRST_READER_WAIT, GrowingFile
from proxy.store import fill_notices
from proxy.store import spool as store_spool
from proxy.store.archives import ArchiveStore
from proxy.store.disk import DiskBlobStore
from proxy.store.file_identity import FileIdentity, identity_of
from proxy.store.fill_notices import OtherFill, PostedNotice, read_notice
from proxy.store.protocol import BlobInfo
from proxy.store.spool import SpoolStart
from tests.support.held_work import HeldCalls

NAME = "registry.terraform.io/hashicorp/null/3.2.1/linux_amd64"
BODY = b"0123456789"


def _gone_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def _posted(blobs: DiskBlobStore, data: bytes = b"abc",
            size: int | None = len(BODY)) -> tuple[GrowingFile[BlobInfo], PostedNotice]:
    spool: GrowingFile[BlobInfo] = GrowingFile(blobs.spool_path(), size)
    spool.temp.write_bytes(data)
    notice = PostedNotice.of(blobs, NAME)
    assert notice is not None
    notice.post(spool)
    return spool, notice


def _begun(blobs: DiskBlobStore) -> tuple[GrowingFile[BlobInfo], PostedNotice]:
    """A spool whose file exists, and its notice begun (posted on a thread, in time)."""
    spool: GrowingFile[BlobInfo] = GrowingFile(blobs.spool_path(), len(BODY))
    spool.temp.write_bytes(b"abc")
    notice = PostedNotice.of(blobs, NAME)
    assert notice is not None
    notice.begin(spool)
    return spool, notice


def _rewrite(blobs: DiskBlobStore, **changes: object) -> Path:
    path = blobs.fill_notice(NAME)
    assert path is not None
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return path


async def _received(other: OtherFill) -> bytearray:
    got = bytearray()
    async for chunk in other.spool.chunks():
        got += chunk
    return got


async def test_a_posted_notice_is_followed_until_withdrawn(tmp_path: Path) -> None:
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    spool, notice = _posted(blobs)
    other = await OtherFill.find(blobs, NAME)
    assert other is not None and other.spool.temp == spool.temp
    assert other.spool.size == len(BODY)
    other.close()
    notice.withdraw()
    assert await OtherFill.find(blobs, NAME) is None


async def test_the_last_byte_goes_out_once_the_file_followed_is_published(
        tmp_path: Path) -> None:
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    spool, notice = _posted(blobs, BODY)  # every byte on disk, not verified yet
    other = await OtherFill.find(blobs, NAME)
    assert other is not None
    verified: list[BlobInfo] = []

    async def published() -> BlobInfo | None:
        return verified[0] if verified else None

    following = asyncio.ensure_future(other.follow(published, 30))
    reading = asyncio.ensure_future(_received(other))
    await asyncio.sleep(0.2)
    assert not reading.done() and other.spool.written == len(BODY)  # held back
    identity = identity_of(os.stat(spool.temp))
    verified.append(BlobInfo("k", identity.size, 0.0, identity))
    assert await asyncio.wait_for(reading, 5) == BODY
    assert (await following).identity == identity
    notice.withdraw()


async def test_a_fill_that_ended_with_another_file_published_cuts_its_followers_short(
        tmp_path: Path) -> None:
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    _spool, notice = _posted(blobs, BODY)
    other = await OtherFill.find(blobs, NAME)
    assert other is not None
    elsewhere = FileIdentity(0, 1, len(BODY), 0)  # published, but not the file followed

    async def published() -> BlobInfo | None:
        return BlobInfo("k", len(BODY), 0.0, elsewhere)

    reading = asyncio.ensure_future(_received(other))
    following = asyncio.ensure_future(other.follow(published, 30))
    await asyncio.sleep(0.1)
    notice.withdraw()  # the fill ended
    with pytest.raises(UpstreamError):
        await asyncio.wait_for(following, 5)
    with pytest.raises(UpstreamError):
        await asyncio.wait_for(reading, 5)


async def test_a_spool_that_stops_growing_fails_its_followers(tmp_path: Path) -> None:
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    _spool, notice = _posted(blobs)
    other = await OtherFill.find(blobs, NAME)
    assert other is not None

    async def published() -> BlobInfo | None:
        return None

    with pytest.raises(UpstreamError, match="stalled"):
        await asyncio.wait_for(other.follow(published, 0.2), 5)
    notice.withdraw()


async def test_the_notice_of_a_process_that_is_gone_is_not_followed_and_is_swept(
        tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    blobs = DiskBlobStore(store)
    _posted(blobs)
    path = _rewrite(blobs, pid=_gone_pid())
    assert await OtherFill.find(blobs, NAME) is None
    store.sweep_temp()
    assert not path.exists()


async def test_a_notice_from_another_pid_namespace_is_neither_followed_nor_swept(
        tmp_path: Path) -> None:
    """Another container on the same volume: its pid 1 is not ours."""
    store = ArchiveStore(tmp_path)
    blobs = DiskBlobStore(store)
    _posted(blobs)
    path = _rewrite(blobs, pid=1, namespace="another-boot:4026531836")
    assert await OtherFill.find(blobs, NAME) is None
    store.sweep_temp()
    assert path.exists()


async def test_a_notice_naming_a_file_outside_the_temp_area_is_not_followed(
        tmp_path: Path) -> None:
    blobs = DiskBlobStore(ArchiveStore(tmp_path / "cache"))
    _posted(blobs)
    outside = tmp_path / "secret"
    outside.write_bytes(b"not a spool")
    _rewrite(blobs, temp=str(outside), size=11)
    assert await OtherFill.find(blobs, NAME) is None


@pytest.mark.parametrize("changes", [{"pid": 0}, {"pid": -1}, {"pid": True},
                                     {"pid": 1 << 40}, {"temp": "a\0b"}, {"size": -5}])
async def test_a_malformed_notice_is_not_one(tmp_path: Path, changes: dict[str, object]) -> None:
    store = ArchiveStore(tmp_path)
    blobs = DiskBlobStore(store)
    _posted(blobs)
    path = _rewrite(blobs, **changes)
    assert read_notice(path) is None
    assert await OtherFill.find(blobs, NAME) is None
    store.sweep_temp()  # not a notice: removed, and the sweep goes on
    assert not path.exists()


async def test_withdrawing_a_notice_leaves_a_later_fills_notice_alone(tmp_path: Path) -> None:
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    _first, earlier = _posted(blobs)
    later, _notice = _posted(blobs)
    earlier.withdraw()
    path = blobs.fill_notice(NAME)
    assert path is not None
    found = read_notice(path)
    assert found is not None and found.temp == str(later.temp)


async def test_a_post_that_runs_after_its_fill_ended_leaves_a_later_fills_notice_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The post runs on a thread; a fill that failed before it ran has released its lock,
    # and the next fill of the package may have posted its own notice meanwhile.
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    spool: GrowingFile[BlobInfo] = GrowingFile(blobs.spool_path(), len(BODY))
    spool.temp.write_bytes(b"abc")
    notice = PostedNotice.of(blobs, NAME)
    assert notice is not None
    late = HeldCalls(fill_notices._replace_with,
                     holds=lambda path, body, wanted: str(spool.temp).encode() in body)
    monkeypatch.setattr(fill_notices, "_replace_with", late)
    notice.begin(spool)
    await late.settled(1, quiet=0.05)  # its post under way, held
    notice.end()  # the fill ended first
    later, _later_notice = _posted(blobs)  # the next fill took the lock and posted
    late.release()
    await notice.posted()
    await asyncio.sleep(0.1)  # a withdrawal, had it been posted
    path = blobs.fill_notice(NAME)
    assert path is not None
    found = read_notice(path)
    assert found is not None and found.temp == str(later.temp)
    assert not list(path.parent.glob(f".{path.name}.*"))  # nothing left aside


async def test_a_notice_is_posted_once_its_spool_file_is_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A spool is handed out while its file is still being made: a follower in another
    # process that found the notice before the file would follow nothing.
    made = HeldCalls(store_spool._make_spool_file)
    monkeypatch.setattr(store_spool, "_make_spool_file", made)
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    spool = await SpoolStart(blobs).spool(len(BODY))
    notice = PostedNotice.of(blobs, NAME)
    assert notice is not None
    notice.begin(spool)
    await made.settled(1, quiet=0.05)
    await asyncio.sleep(0.05)  # a post that did not wait would be there by now
    path = blobs.fill_notice(NAME)
    assert path is not None and not path.exists()
    made.release()
    await notice.posted()
    found = read_notice(path)
    assert found is not None and found.temp == str(spool.temp)
    other = await OtherFill.find(blobs, NAME)
    assert other is not None
    other.close()
    assert spool.made is not None
    os.close(await spool.made)
    notice.end()


async def test_a_fill_that_ends_once_its_notice_is_posted_withdraws_it_at_once(
        tmp_path: Path) -> None:
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    _spool, notice = _begun(blobs)
    await notice.posted()
    other = await OtherFill.find(blobs, NAME)
    assert other is not None
    other.close()
    notice.end()  # under the lock: gone before it returns
    path = blobs.fill_notice(NAME)
    assert path is not None and not path.exists()


async def test_a_begun_notice_is_posted_once_its_first_reader_asked_for_bytes(
        tmp_path: Path) -> None:
    """Its thread's GIL hand-overs held the first reader's headers up: the notice waits for
    that reader (or FIRST_READER_WAIT without one)."""
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    spool, notice = _begun(blobs)
    await asyncio.sleep(FIRST_READER_WAIT / 5)
    assert await OtherFill.find(blobs, NAME) is None  # no reader yet: not posted
    reader = spool.chunks()
    reading = asyncio.ensure_future(reader.__anext__())
    await asyncio.wait_for(notice.posted(), 5)
    other = await OtherFill.find(blobs, NAME)
    assert other is not None and other.spool.temp == spool.temp
    other.close()
    reading.cancel()
    await asyncio.gather(reading, return_exceptions=True)
    await reader.aclose()
    notice.end()
