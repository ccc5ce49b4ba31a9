"""`warm` records the h1 of every package it fills, however slow the h1 pass, and a stored
zip is never closed under the thread that reads it."""

from __future__ import annotations

import asyncio
import hashlib
import io
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, BinaryIO

import pytest

import proxy.verification.stored_hashes
from proxy.airgap.sources import Requirement
from proxy.airgap.warm import warm_cache
from proxy.config import load_config
from proxy.core.models import Platform, ProviderAddress
from proxy.store import layout
from proxy.store.disk import DiskBlobStore
from proxy.store.index import MetadataCache
from proxy.verification.hashes import h1_of_zip
from proxy.verification.stored_hashes import h1_of_stored
from tests.support.fake_registry import FakeRegistry, build_zip

PLATFORMS = ["linux_amd64", "darwin_arm64", "windows_amd64"]
NULL = ProviderAddress("registry.terraform.io", "hashicorp", "null")


class SlowedH1:
    """Every h1 pass over a stored zip made to take a while (a big provider on a busy disk):
    long enough for the client to get the whole zip first."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
        self.seconds = seconds
        self.running = 0
        self.lock = threading.Lock()
        monkeypatch.setattr(proxy.verification.stored_hashes, "h1_of_zip", self.h1)

    def h1(self, source: Path | BinaryIO) -> str:
        with self.lock:
            self.running += 1
        try:
            time.sleep(self.seconds)
            return h1_of_zip(source)
        finally:
            with self.lock:
                self.running -= 1

    async def ended(self) -> bool:
        """Whether every pass that started has ended (whatever became of its caller: one
        cut loose by a shutdown logs when it ends), waiting a while for them."""
        for _ in range(200):
            if not self.running:
                return True
            await asyncio.sleep(0.05)
        return False


async def recorded(cache: Path, platform: str) -> dict[str, Any] | None:
    index = MetadataCache(cache / "index")
    try:
        return await index.get(layout.package_record(NULL, "3.2.1",
                                                     Platform.from_key(platform)))
    finally:
        index.close()


async def test_warm_records_every_platforms_h1(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry,
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    passes = SlowedH1(monkeypatch, 0.5)
    cache = tmp_path / "cache"
    config = load_config(write_config(cache_dir=cache), environ={})
    caplog.set_level(logging.INFO)
    results = await warm_cache(config, [Requirement(NULL, "3.2.1")], PLATFORMS,
                               out=io.StringIO())
    assert [r.ok for r in results] == [True]
    assert await passes.ended()
    problems = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert problems == []  # no "h1 cannot be computed: seek of closed file"
    for platform in PLATFORMS:
        record = await recorded(cache, platform)
        assert record is not None, platform
        zip_path = next(cache.rglob(f"terraform-provider-null_3.2.1_{platform}.zip"))
        assert record["h1"] == h1_of_zip(zip_path), platform


async def test_an_h1_pass_whose_caller_leaves_reads_the_zip_to_the_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """The caller of an h1 pass is cancelled (a shutdown) while the pass reads the zip in
    its thread: the zip stays open until the pass is done with it, then it is closed."""
    data = build_zip({"terraform-provider-x_v1.0.0": (b"binary" * 1000, 0o755)})
    key = layout.provider_archive(NULL, "3.2.1", Platform.from_key("linux_amd64"))
    store = DiskBlobStore.at(tmp_path / "cache")
    reading, go_on = threading.Event(), threading.Event()
    try:
        async def chunks() -> AsyncIterator[bytes]:
            yield data
        await store.put(key, chunks())
        outcome: list[object] = []

        def h1_when_told(source: Path | BinaryIO) -> str:
            reading.set()
            go_on.wait(10)
            try:
                outcome.append(h1_of_zip(source))
            except Exception as exc:
                outcome.append(exc)
                raise
            return str(outcome[-1])
        monkeypatch.setattr(proxy.verification.stored_hashes, "h1_of_zip", h1_when_told)
        opened: list[BinaryIO] = []
        open_to_send = store.files.open_to_send
        monkeypatch.setattr(store.files, "open_to_send",
                            lambda path: (opened.append(h := open_to_send(path)), h)[1])

        caller = asyncio.ensure_future(
            h1_of_stored(store, key, hashlib.sha256(data).hexdigest()))
        assert await asyncio.to_thread(reading.wait, 10)
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        assert not opened[0].closed  # the pass still reads it
        go_on.set()
        for _ in range(100):
            if opened[0].closed:
                break
            await asyncio.sleep(0.05)
        assert outcome == [h1_of_zip(io.BytesIO(data))]
        assert opened[0].closed  # released once the pass ended
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    finally:
        go_on.set()
        store.close()
