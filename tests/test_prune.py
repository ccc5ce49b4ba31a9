"""Bounding the store by use: last-use marks on S3 (at most one an hour per blob), the prune
command on S3 and on disk (unused blobs go with their records, then are fetched again on
demand; used ones stay hits), its dry run and its arguments."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import os
import time
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.cli import main
from proxy.config import Config, load_config
from proxy.core.executors import serving
from proxy.core.metrics import Metrics
from proxy.store import layout
from proxy.store.disk import open_disk_storage
from proxy.store.protocol import Storage
from proxy.store.prune import PruneRules, prune
from proxy.store.s3 import open_s3_storage
from tests.support.fake_registry import FakeRegistry
from tests.support.metrics import sample
from tests.support.mirror_paths import BASE, archive_path
from tests.support.seaweedfs import S3Server
from tests.support.stores import s3_cache_config, use_s3_credentials

DAY = 86400.0
USED, UNUSED = "linux_amd64", "darwin_arm64"
_KEY = "archives/registry.terraform.io/hashicorp/null/3.2.1/terraform-provider-null_3.2.1_{}.zip"


class Clock:
    """A wall clock the test moves."""

    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


async def _marks_written(client: TestClient, count: int) -> float | None:
    """tfproxy_store_operations_total for mark writes, once it reaches count (or after 5 s)."""
    for _ in range(100):
        found = sample(await (await client.get("/metrics")).text(),
                       "tfproxy_store_operations_total", backend="s3", operation="mark",
                       outcome="ok")
        if found is not None and found >= count:
            return found
        await asyncio.sleep(0.05)
    return found


async def _h1_recorded(storage: Storage, key: str) -> None:
    """Wait until the fill of the package at key recorded its h1 (it reads the blob once
    more after publishing it)."""
    record = layout.record_of_blob(key)
    assert record is not None
    for _ in range(100):
        found = await storage.index.get(record)
        if found is not None and found.get("h1"):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"no h1 recorded for {key}")


async def _get_ok(client: TestClient, platform: str, registry: FakeRegistry) -> None:
    answer = await client.get(archive_path(platform))
    assert answer.status == 200
    assert await answer.read() == registry.releases[("hashicorp", "null", "3.2.1")].zips[platform]


async def test_a_hit_on_s3_writes_at_most_one_last_use_mark_an_hour(
        aiohttp_client, proxy_config: Config, registry: FakeRegistry,  # type: ignore[no-untyped-def]
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_s3_credentials(s3_server, monkeypatch)
    clock = Clock()
    config = dataclasses.replace(proxy_config, cache=s3_cache_config(
        s3_server, s3_server.new_bucket(), tmp_path / "cache"))
    client: TestClient = await aiohttp_client(create_app(
        config, open_storage=functools.partial(open_s3_storage, clock=clock)))
    await _get_ok(client, USED, registry)  # the fill: its write time is its use
    clock.now += 60
    await _get_ok(client, USED, registry)
    clock.now += 3600
    for _ in range(3):
        await _get_ok(client, USED, registry)
    assert await _marks_written(client, 1) == 1
    clock.now += 1800
    await _get_ok(client, USED, registry)
    await asyncio.sleep(0.3)
    assert await _marks_written(client, 1) == 1  # within the hour: no second PUT
    clock.now += 1800
    await _get_ok(client, USED, registry)
    assert await _marks_written(client, 2) == 2


async def test_prune_on_s3_removes_only_the_unused_package_which_is_then_fetched_again(
        aiohttp_client, proxy_config: Config, registry: FakeRegistry,  # type: ignore[no-untyped-def]
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    use_s3_credentials(s3_server, monkeypatch)
    clock = Clock()
    cache = s3_cache_config(s3_server, s3_server.new_bucket(), tmp_path / "replica")
    client: TestClient = await aiohttp_client(create_app(
        dataclasses.replace(proxy_config, cache=cache),
        open_storage=functools.partial(open_s3_storage, clock=clock)))
    assert (await client.get(f"{BASE}/3.2.1.json")).status == 200
    async with serving(), AsyncExitStack() as opened:  # what the command does, elsewhere
        storage = await open_s3_storage(dataclasses.replace(cache, dir=tmp_path / "cron"),
                                        Metrics(), opened)
        for platform in (USED, UNUSED):
            await _get_ok(client, platform, registry)
            await _h1_recorded(storage, _KEY.format(platform))  # the fill's last read
        clock.now += 2 * DAY  # two days later, only one of them is asked for again
        await _get_ok(client, USED, registry)
        assert await _marks_written(client, 1) == 1

        dry = await prune(storage, DAY, clock.now + 60, dry_run=True)
        assert (dry.blobs, dry.records, dry.kept) == (1, 1, 1)
        assert await storage.blobs.stat(_KEY.format(UNUSED)) is not None  # dry: all there
        done = await prune(storage, DAY, clock.now + 60)
        assert (done.blobs, done.records, done.kept) == (1, 1, 1)
        assert done.freed == len(registry.releases[("hashicorp", "null", "3.2.1")]
                                 .zips[UNUSED])
        assert await storage.blobs.stat(_KEY.format(UNUSED)) is None
        assert await storage.blobs.stat(_KEY.format(USED)) is not None
        unused_record = layout.record_of_blob(_KEY.format(UNUSED))
        assert unused_record is not None and await storage.index.get(unused_record) is None
        assert await storage.blobs.last_uses(_KEY.format(UNUSED)) == {}  # its mark went too

    registry.requests.clear()
    await _get_ok(client, USED, registry)
    assert registry.archive_requests() == []  # still a hit
    await _get_ok(client, UNUSED, registry)
    assert registry.archive_requests()  # fetched again from upstream


async def test_prune_on_disk_uses_access_times_and_keeps_what_was_used(
        aiohttp_client, proxy_config: Config, registry: FakeRegistry,  # type: ignore[no-untyped-def]
        tmp_path: Path) -> None:
    client: TestClient = await aiohttp_client(create_app(proxy_config))
    async with serving(), AsyncExitStack() as opened:
        storage = await open_disk_storage(proxy_config.cache, Metrics(), opened)
        for platform in (USED, UNUSED):
            await _get_ok(client, platform, registry)
            # Read once more by the fill (a read sets the access time, with relatime too,
            # when it is older than the modification time): done before it is backdated.
            await _h1_recorded(storage, _KEY.format(platform))
        old = time.time() - 3 * DAY
        os.utime(proxy_config.cache.dir / _KEY.format(UNUSED), (old, old))
        done = await prune(storage, DAY, time.time())
        assert (done.blobs, done.records, done.kept) == (1, 1, 1)
    assert not (proxy_config.cache.dir / _KEY.format(UNUSED)).exists()

    registry.requests.clear()
    await _get_ok(client, USED, registry)
    assert registry.archive_requests() == []
    await _get_ok(client, UNUSED, registry)
    assert registry.archive_requests()


async def test_prune_removes_packages_without_a_record_and_records_without_an_archive(
        tmp_path: Path, proxy_config: Config) -> None:
    async with serving(), AsyncExitStack() as opened:
        storage = await open_disk_storage(proxy_config.cache, Metrics(), opened)

        unvouched = _KEY.format(UNUSED)
        fresh = _KEY.format(USED)
        for key in (unvouched, fresh):
            await storage.blobs.put(key, _chunks(b"zip bytes"))
        hour_ago = time.time() - 2 * 3600
        os.utime(proxy_config.cache.dir / unvouched, (time.time(), hour_ago))
        gone = "module-archive/registry.terraform.io/acme/net/aws/1.0.0"
        await storage.index.set(gone, {"sha256": "00", "size": 1, "stored_as": None})
        await storage.index.set("leases/old", {"expires_at": time.time() - 7200})
        await storage.index.set("leases/live", {"expires_at": time.time() + 30})
        done = await prune(storage, 30 * DAY, time.time())
        # The fresh one may be a fill between its blob and its record: it stays.
        assert (done.orphaned_blobs, done.orphaned_records, done.leases) == (1, 1, 1)
        assert await storage.blobs.stat(unvouched) is None
        assert await storage.blobs.stat(fresh) is not None
        assert await storage.index.get(gone) is None
        assert await storage.index.keys("leases/") == ["leases/live"]


async def test_a_modules_oci_zip_goes_with_its_archive_and_without_one(
        tmp_path: Path, proxy_config: Config) -> None:
    async with serving(), AsyncExitStack() as opened:
        storage = await open_disk_storage(proxy_config.cache, Metrics(), opened)
        old = time.time() - 3 * DAY
        kept, pruned, alone = (layout.parse_module_archive(
            f"modules/registry.terraform.io/acme/{name}/aws/1.0.0.tar.gz")
            for name in ("kept", "pruned", "alone"))
        assert kept and pruned and alone
        for module in (kept, pruned):
            await storage.blobs.put(layout.module_archive(*module), _chunks(b"tar"))
            await storage.index.set(layout.module_archive_record(*module),
                                    {"sha256": "00", "size": 3, "stored_as": None})
        for module in (kept, pruned, alone):
            await storage.blobs.put(layout.module_zip(*module), _chunks(b"zip"))
            await storage.index.set(layout.module_zip_record(*module), {"sha256": "00"})
            os.utime(proxy_config.cache.dir / layout.module_zip(*module), (old, old))
        os.utime(proxy_config.cache.dir / layout.module_archive(*pruned), (old, old))
        gone_zip = layout.parse_module_archive(
            "modules/registry.terraform.io/acme/gone/aws/1.0.0.tar.gz")
        assert gone_zip
        await storage.index.set(layout.module_zip_record(*gone_zip), {"sha256": "00"})
        done = await prune(storage, DAY, time.time())
        # Two zips (one with its archive, one whose archive is gone), each with its record.
        assert done.reasons["module zip"] == 2 and done.orphaned_blobs == 0
        assert done.orphaned_records == 1 and done.kept == 1
        for module, stays in ((kept, True), (pruned, False), (alone, False)):
            assert (await storage.blobs.stat(layout.module_zip(*module)) is not None) == stays
            assert (await storage.index.get(layout.module_zip_record(*module)) is not None) \
                == stays, module
        assert await storage.index.get(layout.module_zip_record(*gone_zip)) is None


async def test_a_modules_oci_zip_counts_with_its_archive_against_a_size(
        tmp_path: Path, proxy_config: Config) -> None:
    async with serving(), AsyncExitStack() as opened:
        storage = await open_disk_storage(proxy_config.cache, Metrics(), opened)
        older, newer = (layout.parse_module_archive(
            f"modules/registry.terraform.io/acme/{name}/aws/1.0.0.tar.gz")
            for name in ("older", "newer"))
        assert older and newer
        for age, module in ((3 * DAY, older), (DAY, newer)):
            await storage.blobs.put(layout.module_archive(*module), _chunks(b"t" * 100))
            await storage.index.set(layout.module_archive_record(*module),
                                    {"sha256": "00", "size": 100, "stored_as": None})
            await storage.blobs.put(layout.module_zip(*module), _chunks(b"z" * 1000))
            for key in (layout.module_archive(*module), layout.module_zip(*module)):
                then = time.time() - age
                os.utime(proxy_config.cache.dir / key, (then, then))
        # 2 x 1100 bytes held; 1500 allowed: the older module and its zip go.
        done = await prune(storage, None, time.time(),
                           rules=PruneRules(to_size=1500))
        assert done.reasons == {"least recently used": 1, "module zip": 1}
        assert done.freed == 1100 and done.kept == 1
        assert await storage.blobs.stat(layout.module_zip(*newer)) is not None


async def _chunks(data: bytes):  # type: ignore[no-untyped-def]
    yield data


def test_prune_command_dry_run_prints_what_would_go_and_removes_nothing(
        write_config: Callable[..., Path], registry: FakeRegistry, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    path = write_config()
    config = load_config(path, environ={})
    stored = config.cache.dir / _KEY.format(UNUSED)
    stored.parent.mkdir(parents=True)
    stored.write_bytes(b"a package without its record")
    old = time.time() - 40 * DAY
    os.utime(stored, (old, old))
    assert main(["prune", "--config", str(path), "--unused-for", "30d", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"would remove {_KEY.format(UNUSED)}" in out
    assert out.splitlines()[-1].startswith("prune: would remove 1 unused blobs")
    assert stored.exists()
    assert main(["prune", "--config", str(path), "--unused-for", "30d"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("prune: removed 1 unused blobs")
    assert not stored.exists()


@pytest.mark.parametrize(("value", "message"), [("30", "not a duration"),
                                                ("1y", "not a duration"),
                                                ("10m", "shorter than an hour")])
def test_prune_command_refuses_a_bad_duration_with_exit_2(
        value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["prune", "--unused-for", value])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
