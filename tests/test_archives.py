"""The package store: partial files never visible, corrupt files never published."""

from __future__ import annotations

import hashlib
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from proxy.archives import ArchiveStore
from proxy.errors import IntegrityError
from tests.support.fake_registry import build_zip

ZIP = build_zip({"terraform-provider-x_v1.0.0": (random.Random(1).randbytes(20_000), 0o755)})
PARTS = ["archives", "registry.terraform.io", "hashicorp", "x", "1.0.0", "p.zip"]


async def chunks(data: bytes, fail_after: int | None = None) -> AsyncIterator[bytes]:
    for offset in range(0, len(data), 1000):
        if fail_after is not None and offset >= fail_after:
            raise ConnectionResetError("upstream went away")
        yield data[offset:offset + 1000]


async def test_store_publishes_verified_file(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    stored = await store.store(PARTS, chunks(ZIP), hashlib.sha256(ZIP).hexdigest())
    assert stored.path.read_bytes() == ZIP
    assert stored.h1.startswith("h1:") and stored.size == len(ZIP)
    assert await store.lookup(PARTS) == stored.path
    assert list(store.tmp.iterdir()) == []


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
        await store.store(PARTS, chunks(data, fail_after), expected)
    assert await store.lookup(PARTS) is None
    assert list(store.tmp.iterdir()) == []


def test_sweep_removes_leftovers(tmp_path: Path) -> None:
    store = ArchiveStore(tmp_path)
    (store.tmp / "abc.part").write_bytes(b"half")
    assert store.sweep_temp() == 1
    assert list(store.tmp.iterdir()) == []


@pytest.mark.parametrize("parts", [["..", "x"], ["a/b"], [""], ["ok", "."], ["a\\b"], []])
def test_unsafe_paths_are_refused(tmp_path: Path, parts: list[str]) -> None:
    with pytest.raises(ValueError):
        ArchiveStore(tmp_path).path_for(parts)
