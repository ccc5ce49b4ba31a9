"""Fill notices (proxy.store.fill_notices): what a process waiting for another's fill may
follow, and what it must not: a notice of a process that is gone, one naming a file outside
the store's temp area, one a later fill replaced."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from proxy.core.spool import GrowingFile
from proxy.store.archives import ArchiveStore
from proxy.store.disk import DiskBlobStore
from proxy.store.fill_notices import OtherFill, PostedNotice, read_notice
from proxy.store.protocol import BlobInfo

NAME = "registry.terraform.io/hashicorp/null/3.2.1/linux_amd64"


def _gone_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


async def _posted(blobs: DiskBlobStore) -> tuple[GrowingFile[BlobInfo], PostedNotice]:
    spool: GrowingFile[BlobInfo] = GrowingFile(blobs.spool_path(), 10)
    spool.temp.write_bytes(b"abc")
    notice = PostedNotice.of(blobs, NAME)
    assert notice is not None
    notice.post(spool)
    return spool, notice


async def test_a_posted_notice_is_followed_until_withdrawn(tmp_path: Path) -> None:
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    spool, notice = await _posted(blobs)
    other = await OtherFill.find(blobs, NAME)
    assert other is not None and other.spool.temp == spool.temp and other.spool.size == 10
    other.close()
    notice.withdraw()
    assert await OtherFill.find(blobs, NAME) is None


async def test_the_notice_of_a_process_that_is_gone_is_not_followed_and_is_swept(
        tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    blobs = DiskBlobStore(store)
    spool, _notice = await _posted(blobs)
    path = blobs.fill_notice(NAME)
    assert path is not None
    path.write_text(json.dumps({"temp": str(spool.temp), "size": 10, "pid": _gone_pid()}))
    assert await OtherFill.find(blobs, NAME) is None
    store.sweep_temp()
    assert not path.exists()


async def test_a_notice_naming_a_file_outside_the_temp_area_is_not_followed(
        tmp_path: Path) -> None:
    blobs = DiskBlobStore(ArchiveStore(tmp_path / "cache"))
    _spool, _notice = await _posted(blobs)
    path = blobs.fill_notice(NAME)
    assert path is not None
    outside = tmp_path / "secret"
    outside.write_bytes(b"not a spool")
    path.write_text(json.dumps({"temp": str(outside), "size": 11, "pid": 1}))
    assert await OtherFill.find(blobs, NAME) is None


async def test_withdrawing_a_notice_leaves_a_later_fills_notice_alone(tmp_path: Path) -> None:
    blobs = DiskBlobStore(ArchiveStore(tmp_path))
    _first, earlier = await _posted(blobs)
    later, _notice = await _posted(blobs)
    earlier.withdraw()
    path = blobs.fill_notice(NAME)
    assert path is not None
    found = read_notice(path)
    assert found is not None and found.temp == str(later.temp)
