"""Offline mode, eviction, an index that disagrees with the files on disk, and stored files
damaged after they were verified."""

from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import random
import shutil
import sys
import threading
import time
import zipfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, BinaryIO

import pytest
from aiohttp.test_utils import TestClient

import proxy.store.archives
import proxy.verification.stored_hashes
import proxy.verification.stored_packages
from proxy.config import load_config
from proxy.protocols.module_registry import ModuleRegistry
from proxy.protocols.network_mirror import ProviderMirror
from proxy.store.archives import ArchiveStore
from proxy.store.index import MetadataCache
from proxy.store.protocol import BlobInfo
from proxy.verification.packages import VerifiedPackages
from proxy.web.routes import CONFIG_KEY
from tests.support.fake_registry import FakeRegistry
from tests.support.held_work import HeldCalls
from tests.support.metrics import sample
from tests.support.mirror_paths import BASE, ZIP, zip_h1

Make = Callable[..., Awaitable[TestClient]]
MODULE = "/modules/registry.terraform.io/acme/tarball/aws"


def zip_name(platform: str, version: str = "3.2.1") -> str:
    return f"terraform-provider-null_{version}_{platform}.zip"


async def test_offline_mode_serves_the_cache_and_never_contacts_upstream(
        make: Make, registry: FakeRegistry) -> None:
    online = await make()
    assert (await (await online.get(f"{BASE}/{ZIP}")).read())
    location = (await (await online.get(f"{MODULE}/1.0.0/download")).json())["location"]
    archive = location.split(":", 2)[2].split("/", 1)[1].join(["/", ""])
    assert (await online.get(archive)).status == 200  # the archive request fills the cache
    await online.close()

    registry.requests.clear()
    offline = await make(upstream_mode="offline", upstream_versions_ttl="0.001")
    await asyncio.sleep(0.01)  # every cached list is past its TTL: still no refresh
    for path in (f"{BASE}/index.json", f"{BASE}/3.2.1.json", f"{BASE}/{ZIP}",
                 f"{MODULE}/versions", f"{MODULE}/1.0.0/download", archive):
        response = await offline.get(path)
        assert response.status == 200, (path, await response.text())
    # Only what is held: 3.1.0 is not, nor are the other platforms of 3.2.1.
    assert await (await offline.get(f"{BASE}/index.json")).json() == {"versions": {"3.2.1": {}}}
    document = await (await offline.get(f"{BASE}/3.2.1.json")).json()
    assert list(document["archives"]) == ["linux_amd64"]
    for path in (f"{BASE}/3.1.0.json", f"{BASE}/{zip_name('darwin_arm64')}",
                 "/mirror/registry.terraform.io/hashicorp/random/index.json",
                 "/modules/registry.terraform.io/acme/net/aws/versions",
                 "/modules/registry.terraform.io/acme/net/aws/1.2.0/download",
                 "/mirror/registry.opentofu.org/hashicorp/null/index.json"):
        response = await offline.get(path)
        assert response.status == 404, path
        assert "offline" in (await response.json())["errors"][0]
    await asyncio.sleep(0.05)
    assert registry.requests == []


async def test_eviction_keeps_the_cache_under_its_limit(make: Make,
                                                        registry: FakeRegistry) -> None:
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    one = len(release.zips["linux_amd64"])
    client = await make(cache_max_size=str(int(one * 2.5)))
    for platform in ("linux_amd64", "darwin_arm64", "windows_amd64"):
        response = await client.get(f"{BASE}/{zip_name(platform)}")
        assert await response.read() == release.zips[platform]
        await asyncio.sleep(0.02)  # distinct access times
    text = await (await client.get("/metrics")).text()
    evictions = sample(text, "tfproxy_cache_evictions_total")
    size = sample(text, "tfproxy_cache_size_bytes")
    assert evictions is not None and evictions >= 1, text
    assert size is not None and one <= size <= one * 2.5, text  # one or two archives stay
    # The least recently used (linux) went; its verified facts stay, so VERSION.json keeps
    # its h1, and asking for it again fetches it again.
    document = await (await client.get(f"{BASE}/3.2.1.json")).json()
    assert document["archives"]["linux_amd64"]["hashes"][0].startswith("h1:")
    registry.requests.clear()
    response = await client.get(f"{BASE}/{zip_name('linux_amd64')}")
    assert await response.read() == release.zips["linux_amd64"]
    assert len(registry.archive_requests()) == 1


@pytest.mark.parametrize("kind", ["package", "module"])
async def test_file_evicted_right_after_it_was_found_is_fetched_again(
        make: Make, registry: FakeRegistry, monkeypatch: pytest.MonkeyPatch,
        kind: str) -> None:
    """Another process sharing the cache may evict a file just after this one found it:
    the client still gets the whole file, fetched again, not a bare 404."""
    client = await make()
    service: type[ProviderMirror] | type[ModuleRegistry]
    if kind == "package":
        path, service, upstream = f"{BASE}/{ZIP}", ProviderMirror, ZIP
    else:
        path, service, upstream = (f"{MODULE}/1.0.0/tarball-aws-1.0.0.tar.gz", ModuleRegistry,
                                   "tarball-1.0.0.tgz")
    whole = await (await client.get(path)).read()
    assert whole
    find = service.archive
    evicted: list[Path] = []

    async def evicted_once_found(self: Any, *args: Any) -> Any:
        found = await find(self, *args)
        if isinstance(found, BlobInfo) and not evicted:
            stored = client.server.app[CONFIG_KEY].cache.dir / found.key  # the disk backend's
            stored.unlink()
            evicted.append(stored)
        return found

    monkeypatch.setattr(service, "archive", evicted_once_found)
    registry.requests.clear()
    response = await client.get(path)
    assert response.status == 200, (response.content_type, await response.text())
    assert await response.read() == whole
    assert evicted and evicted[0].read_bytes() == whole
    assert [p for p in registry.paths() if p.endswith(upstream)] != []


async def test_a_zip_gone_while_its_fill_is_still_finishing_is_fetched_again(
        make: Make, registry: FakeRegistry, write_config: Callable[..., Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The fill's h1 pass follows the download: a request that finds the file gone meanwhile
    (evicted, dropped as damaged) gets a new fill, not the finished one's vanished file."""
    good = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    cache = Path(load_config(write_config(), environ={}).cache.dir)
    real_h1 = proxy.verification.stored_packages.h1_of_stored

    async def slow_h1(*args: Any) -> str | None:
        await asyncio.sleep(0.5)
        return await real_h1(*args)

    monkeypatch.setattr(proxy.verification.stored_packages, "h1_of_stored", slow_h1)
    client = await make()
    assert await (await client.get(f"{BASE}/{ZIP}")).read() == good
    next(cache.rglob(ZIP)).unlink()  # by another process, while the h1 pass runs
    response = await client.get(f"{BASE}/{ZIP}")
    assert response.status == 200
    assert await response.read() == good
    assert len(registry.archive_requests()) == 2


@pytest.mark.parametrize("damage", ["lose the index", "truncate the file"])
async def test_file_without_a_matching_record_is_fetched_again(
        make: Make, registry: FakeRegistry, write_config: Callable[..., Path],
        damage: str) -> None:
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    client = await make()
    assert await (await client.get(f"{BASE}/{ZIP}")).read() == release.zips["linux_amd64"]
    await client.close()
    cache = Path(load_config(write_config(), environ={}).cache.dir)
    stored = next(cache.rglob(ZIP))
    if damage == "lose the index":
        shutil.rmtree(cache / "index")
    else:
        stored.write_bytes(stored.read_bytes()[:-10])

    registry.requests.clear()
    again = await make()
    response = await again.get(f"{BASE}/{ZIP}")
    assert await response.read() == release.zips["linux_amd64"]
    assert len(registry.archive_requests()) == 1
    assert stored.read_bytes() == release.zips["linux_amd64"]



PLATFORMS = ("linux_amd64", "darwin_arm64", "windows_amd64")
LINUX_KEY = "package/registry.terraform.io/hashicorp/null/3.2.1/linux_amd64"


def renamed_member(data: bytes) -> bytes:
    """The zip damaged so that it is still a valid zip of the same size, with another h1:
    its binary's name changed in both the local and the central header."""
    name = b"terraform-provider-null_v3.2.1"
    assert data.count(name) == 2
    return data.replace(name, b"terraform-provider-nulX_v3.2.1")


async def package_record(cache: Path, key: str = LINUX_KEY) -> dict[str, Any]:
    """The verified facts recorded for a package, read straight from the index."""
    index = MetadataCache(cache / "index")
    try:
        record = await index.get(key)
    finally:
        index.close()
    assert record is not None
    return record


async def forget_h1(cache: Path, key: str = LINUX_KEY) -> None:
    """What a crash between publishing a zip and recording its h1 leaves behind."""
    record = await package_record(cache, key)
    index = MetadataCache(cache / "index")
    try:
        await index.set(key, {**record, "h1": None})
    finally:
        index.close()


async def fill_every_platform(make: Make, registry: FakeRegistry, cache: Path) -> None:
    """Fetch every platform of null 3.2.1 through a proxy (closed after), h1s recorded."""
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    client = await make()
    for platform in PLATFORMS:
        response = await client.get(f"{BASE}/{zip_name(platform)}")
        assert await response.read() == release.zips[platform]
    for platform in PLATFORMS:  # h1 is recorded after the zip is published: wait for it
        key = LINUX_KEY.replace("linux_amd64", platform)
        await eventually(lambda key=key, platform=platform: _recorded_h1_is(
            cache, zip_h1(release.zips[platform]), key), f"the h1 of {platform}")
    await client.close()


def expected_hashes(registry: FakeRegistry, platform: str) -> list[str]:
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    return [zip_h1(release.zips[platform]), f"zh:{release.sha256(platform)}"]


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    for _ in range(1000):
        if await check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.mark.parametrize("damage", ["same size, still a zip", "truncated", "garbage",
                                    "read error"])
async def test_damaged_stored_zip_is_dropped_and_never_poisons_the_version_document(
        make: Make, registry: FakeRegistry, write_config: Callable[..., Path],
        monkeypatch: pytest.MonkeyPatch, damage: str) -> None:
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    good = release.zips["linux_amd64"]
    cache = Path(load_config(write_config(), environ={}).cache.dir)
    await fill_every_platform(make, registry, cache)
    await forget_h1(cache)
    expected = {platform: expected_hashes(registry, platform) for platform in PLATFORMS}
    right_h1 = zip_h1(good)
    stored = next(cache.rglob(ZIP))
    if damage == "same size, still a zip":
        stored.write_bytes(renamed_member(good))
    elif damage == "truncated":
        stored.write_bytes(good[:len(good) // 2])
    elif damage == "garbage":
        stored.write_bytes(random.Random(7).randbytes(len(good)))
    else:
        def unreadable(*_args: object) -> bytes:
            raise OSError(errno.EIO, "Input/output error")
        monkeypatch.setattr(zipfile.ZipExtFile, "read", unreadable)

    registry.requests.clear()
    client = await make()
    response = await client.get(f"{BASE}/3.2.1.json")
    assert response.status == 200, await response.text()
    archives = (await response.json())["archives"]
    # The other platforms keep both hashes; the damaged one is listed like any platform whose
    # zip the proxy does not hold: with the signed zh: only.
    for platform in ("darwin_arm64", "windows_amd64"):
        assert archives[platform]["hashes"] == expected[platform]
    assert archives["linux_amd64"]["hashes"] == expected["linux_amd64"][1:]
    record = await package_record(cache)
    assert (record["h1"], record["size"]) == (None, None)  # no wrong h1, nothing vouched for
    assert record["shasum"] == release.sha256("linux_amd64")  # the signed facts stay
    assert not stored.exists()
    metrics = await (await client.get("/metrics")).text()
    assert sample(metrics, "tfproxy_integrity_failures_total", kind="stored") == 1
    assert registry.archive_requests() == []

    monkeypatch.undo()  # the disk reads again
    response = await client.get(f"{BASE}/{ZIP}")
    assert await response.read() == good
    assert len(registry.archive_requests()) == 1  # fetched again
    assert stored.read_bytes() == good
    await eventually(lambda: _recorded_h1_is(cache, right_h1), "the right h1")
    document = await (await client.get(f"{BASE}/3.2.1.json")).json()
    assert document["archives"]["linux_amd64"]["hashes"] == expected["linux_amd64"]


async def _recorded_h1_is(cache: Path, h1: str, key: str = LINUX_KEY) -> bool:
    return (await package_record(cache, key))["h1"] == h1


@pytest.mark.skipif(sys.platform != "linux", reason="a thread's own priority is Linux's")
async def test_a_fills_h1_pass_reads_the_zip_once_at_the_lowest_cpu_priority(
        make: Make, registry: FakeRegistry, write_config: Callable[..., Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Clients may still be downloading the package (in other processes too) when its h1 pass
    # reads it whole again: it must not take the cores from them, nor hash the zip's bytes
    # again (the fill hashed them as it wrote the file, which is still that file).
    priorities: list[int] = []
    real = proxy.verification.stored_hashes.h1_of_zip
    real_sha256 = proxy.verification.stored_hashes.sha256_of_file
    hashed: list[int] = []

    def h1_noting_priority(source: BinaryIO) -> str:
        priorities.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return real(source)

    def sha256_counted(handle: BinaryIO) -> str:
        hashed.append(1)
        return real_sha256(handle)

    monkeypatch.setattr(proxy.verification.stored_hashes, "h1_of_zip", h1_noting_priority)
    monkeypatch.setattr(proxy.verification.stored_hashes, "sha256_of_file", sha256_counted)
    good = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    cache = Path(load_config(write_config(), environ={}).cache.dir)
    client = await make()
    assert await (await client.get(f"{BASE}/{ZIP}")).read() == good
    await eventually(lambda: _recorded_h1_is(cache, zip_h1(good)), "the fill's h1")
    assert priorities == [19]
    assert hashed == []
    # The pool's threads serve nothing else: work a client waits for keeps its priority.
    document = await (await client.get(f"{BASE}/3.2.1.json")).json()
    assert document["archives"]["linux_amd64"]["hashes"][0] == zip_h1(good)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) < 19


async def test_a_document_asked_for_during_a_fills_h1_pass_waits_for_it_not_a_second_read(
        make: Make, registry: FakeRegistry, write_config: Callable[..., Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    held = HeldCalls(proxy.verification.stored_hashes.h1_of_zip)
    monkeypatch.setattr(proxy.verification.stored_hashes, "h1_of_zip", held)
    good = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    client = await make()
    try:
        assert await (await client.get(f"{BASE}/{ZIP}")).read() == good
        assert await held.settled(minimum=1) == 1  # the fill's pass, under way
        document = asyncio.ensure_future(client.get(f"{BASE}/3.2.1.json"))
        await asyncio.sleep(0.5)
        assert held.started == 1  # the document waits for it: no second read
    finally:
        held.release()
    answer = await (await document).json()
    assert answer["archives"]["linux_amd64"]["hashes"][0] == zip_h1(good)
    assert held.started == 1


async def test_a_cold_package_reads_its_facts_while_upstream_answers_its_download_document(
        make: Make, registry: FakeRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    # The first byte of a miss waits for the recorded facts (the index), which may note a
    # download document another process just fetched, and then upstream's download document:
    # the facts are read before the document is asked for, never after it came. (Not the
    # document VERSION.json just fetched: that one is taken with its facts, nothing read.)
    monkeypatch.setattr("proxy.verification.packages.RECENT_DOWNLOAD_SECONDS", -1.0)
    client = await make()
    assert (await client.get(f"{BASE}/3.2.1.json")).status == 200  # the facts, recorded
    read_after: list[float] = []
    started = 0.0
    real_get = MetadataCache.get

    async def noting_get(cache: MetadataCache, key: str) -> dict[str, Any] | None:
        if key.startswith("package/") and key.endswith("linux_amd64"):
            read_after.append(time.monotonic() - started)
        return await real_get(cache, key)

    monkeypatch.setattr(MetadataCache, "get", noting_get)
    registry.slow_paths["/v1/providers/hashicorp/null/3.2.1/download/linux"] = 1.0
    started = time.monotonic()
    response = await client.get(f"{BASE}/{ZIP}")
    assert await response.read() == \
        registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    assert read_after and read_after[-1] < 0.8, read_after  # not after the document came


async def test_damaged_stored_zip_is_left_out_offline(
        make: Make, registry: FakeRegistry, write_config: Callable[..., Path]) -> None:
    cache = Path(load_config(write_config(), environ={}).cache.dir)
    await fill_every_platform(make, registry, cache)
    await forget_h1(cache)
    stored = next(cache.rglob(ZIP))
    stored.write_bytes(renamed_member(stored.read_bytes()))

    registry.requests.clear()
    offline = await make(upstream_mode="offline")
    response = await offline.get(f"{BASE}/3.2.1.json")
    assert response.status == 200, await response.text()
    archives = (await response.json())["archives"]
    # Nothing to fetch it again from: not offered, the others are.
    assert sorted(archives) == ["darwin_arm64", "windows_amd64"]
    for platform in archives:
        assert archives[platform]["hashes"] == expected_hashes(registry, platform)
    assert (await package_record(cache))["h1"] is None
    assert not stored.exists()
    assert (await offline.get(f"{BASE}/{ZIP}")).status == 404
    assert registry.requests == []


async def test_zip_damaged_on_disk_right_after_publishing_gets_no_h1_and_is_fetched_again(
        make: Make, registry: FakeRegistry, write_config: Callable[..., Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    good = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    cache = Path(load_config(write_config(), environ={}).cache.dir)
    publish = ArchiveStore.publish

    async def publish_then_damage(store: ArchiveStore, temp: Path,
                                  parts: list[str]) -> Path:
        final = await publish(store, temp, parts)
        # Replaced, not rewritten: the client following the download keeps its good bytes.
        damaged = final.with_suffix(".damaged")
        damaged.write_bytes(renamed_member(final.read_bytes()))
        damaged.replace(final)
        return final

    monkeypatch.setattr(ArchiveStore, "publish", publish_then_damage)
    client = await make()
    assert await (await client.get(f"{BASE}/{ZIP}")).read() == good
    stored = cache.joinpath("archives", "registry.terraform.io", "hashicorp", "null", "3.2.1",
                            ZIP)

    async def settled() -> bool:  # the fill's h1 pass is over, one way or the other
        record = await package_record(cache)
        return record["h1"] is not None or (record["size"] is None and not stored.exists())

    await eventually(settled, "the fill to finish")
    record = await package_record(cache)
    assert (record["h1"], record["size"]) == (None, None)  # the wrong h1 was not recorded
    assert not stored.exists()
    document = await (await client.get(f"{BASE}/3.2.1.json")).json()
    assert document["archives"]["linux_amd64"]["hashes"] == [
        f"zh:{registry.releases[('hashicorp', 'null', '3.2.1')].sha256('linux_amd64')}"]

    monkeypatch.undo()
    assert await (await client.get(f"{BASE}/{ZIP}")).read() == good
    assert len(registry.archive_requests()) == 2
    await eventually(lambda: _recorded_h1_is(cache, zip_h1(good)), "the right h1")
    metrics = await (await client.get("/metrics")).text()
    assert sample(metrics, "tfproxy_integrity_failures_total", kind="stored") == 1


# --- stored files written over after they were verified ----------------------------------
# A hit compares the file's identity (device, inode, size, mtime) with the one recorded when
# its bytes last matched: a file written to since is read again before anyone gets it.

async def write_over(stored: Path, data: bytes) -> None:
    """Damage as a later write does it: the same inode, other bytes. (Real damage comes long
    after the file was stored; the pause puts this write past the timestamps' granularity.)"""
    await asyncio.sleep(0.05)
    _write_in_place(stored, data)


def _write_in_place(path: Path, data: bytes) -> None:
    with open(path, "r+b") as handle:
        handle.write(data)
        handle.truncate()


def count_full_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The stored files read through to check their bytes, from now on."""
    reads: list[str] = []
    real = proxy.verification.stored_hashes.sha256_of_file

    def counted(handle: BinaryIO) -> str:
        reads.append(handle.name)
        return real(handle)

    monkeypatch.setattr(proxy.verification.stored_hashes, "sha256_of_file", counted)
    return reads


@pytest.mark.parametrize("damage", ["garbage", "another zip"])
async def test_a_stored_zip_written_over_after_it_was_verified_is_never_served(
        make: Make, registry: FakeRegistry, write_config: Callable[..., Path],
        damage: str) -> None:
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    good = release.zips["linux_amd64"]
    cache = Path(load_config(write_config(), environ={}).cache.dir)
    await fill_every_platform(make, registry, cache)  # h1s recorded
    stored = next(cache.rglob(ZIP))
    await write_over(stored, random.Random(7).randbytes(len(good)) if damage == "garbage"
                     else renamed_member(good))

    registry.requests.clear()
    for attempt in range(2):  # fresh processes, as after a restart
        client = await make()
        # Requests that arrive together share one check, one drop, one count, one fetch.
        responses = await asyncio.gather(*(client.get(f"{BASE}/{ZIP}") for _ in range(3)))
        assert [r.status for r in responses] == [200] * 3
        assert [await r.read() for r in responses] == [good] * 3, attempt
        if attempt == 0:
            metrics = await (await client.get("/metrics")).text()
            assert sample(metrics, "tfproxy_integrity_failures_total", kind="stored") == 1
        await client.close()
    assert len(registry.archive_requests()) == 1  # dropped, fetched again once, kept
    assert stored.read_bytes() == good
    # The other platforms kept serving from the cache; the document lists every hash.
    client = await make()
    for platform in ("darwin_arm64", "windows_amd64"):
        response = await client.get(f"{BASE}/{zip_name(platform)}")
        assert await response.read() == release.zips[platform]
    assert len(registry.archive_requests()) == 1
    document = await (await client.get(f"{BASE}/3.2.1.json")).json()
    for platform in PLATFORMS:
        assert document["archives"][platform]["hashes"] == expected_hashes(registry, platform)
    assert (await package_record(cache))["h1"] == zip_h1(good)


async def test_a_stored_zip_written_over_is_never_served_offline(
        make: Make, registry: FakeRegistry, write_config: Callable[..., Path]) -> None:
    good = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    cache = Path(load_config(write_config(), environ={}).cache.dir)
    await fill_every_platform(make, registry, cache)
    stored = next(cache.rglob(ZIP))
    damaged = random.Random(7).randbytes(len(good))
    await write_over(stored, damaged)

    registry.requests.clear()
    offline = await make(upstream_mode="offline")
    response = await offline.get(f"{BASE}/{ZIP}")
    assert response.status == 502  # an integrity failure, with nothing else to serve
    assert "damaged" in (await response.json())["errors"][0]
    assert not stored.exists()
    document = await (await offline.get(f"{BASE}/3.2.1.json")).json()
    assert sorted(document["archives"]) == ["darwin_arm64", "windows_amd64"]
    for platform in document["archives"]:
        assert document["archives"][platform]["hashes"] == expected_hashes(registry,
                                                                           platform)
    assert registry.requests == []


async def test_a_stored_zip_whose_metadata_changed_but_not_its_bytes_is_read_once_and_kept(
        make: Make, registry: FakeRegistry, write_config: Callable[..., Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """E.g. restored from a backup, or its mtime set by a tool: checked, not fetched again;
    requests that arrive together share one read."""
    good = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    cache = Path(load_config(write_config(), environ={}).cache.dir)
    await fill_every_platform(make, registry, cache)
    stored = next(cache.rglob(ZIP))
    os.utime(stored, ns=(stored.stat().st_atime_ns, stored.stat().st_mtime_ns + 10**9))
    reads = count_full_reads(monkeypatch)

    registry.requests.clear()
    client = await make()
    responses = await asyncio.gather(*(client.get(f"{BASE}/{ZIP}") for _ in range(5)))
    assert [await r.read() for r in responses] == [good] * 5
    assert reads == [str(stored)]
    assert (await package_record(cache))["stored_as"][3] == stored.stat().st_mtime_ns
    await client.close()
    again = await make()  # another process trusts what the first one recorded
    assert await (await again.get(f"{BASE}/{ZIP}")).read() == good
    assert reads == [str(stored)]
    assert registry.archive_requests() == []


async def test_hits_on_an_unchanged_stored_zip_never_read_it_and_uses_keep_its_mtime(
        make: Make, registry: FakeRegistry, write_config: Callable[..., Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The hit stays a stat and sendfile. A use moves the file's access time (the LRU clock),
    never its mtime, which would make every other process read it again."""
    good = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    cache = Path(load_config(write_config(), environ={}).cache.dir)
    await fill_every_platform(make, registry, cache)
    stored = next(cache.rglob(ZIP))
    os.utime(stored, ns=(10**9, stored.stat().st_mtime_ns))  # long unused
    mtime = stored.stat().st_mtime_ns
    monkeypatch.setattr(proxy.store.archives, "_TOUCH_INTERVAL", 0.0)  # every hit is a use
    reads = count_full_reads(monkeypatch)
    for _process in range(3):
        client = await make()
        for _hit in range(2):
            assert await (await client.get(f"{BASE}/{ZIP}")).read() == good
        await client.close()
    await eventually(lambda: _used_since(stored, 10**9), "the use to be recorded")
    assert stored.stat().st_mtime_ns == mtime
    assert reads == []


async def _used_since(path: Path, atime_ns: int) -> bool:
    return path.stat().st_atime_ns > atime_ns


async def test_a_record_kept_before_file_identities_costs_one_read(
        make: Make, registry: FakeRegistry, write_config: Callable[..., Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    good = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    cache = Path(load_config(write_config(), environ={}).cache.dir)
    await fill_every_platform(make, registry, cache)
    record = await package_record(cache)
    index = MetadataCache(cache / "index")
    try:
        await index.set(LINUX_KEY, {k: v for k, v in record.items() if k != "stored_as"})
    finally:
        index.close()
    reads = count_full_reads(monkeypatch)
    for _process in range(2):
        client = await make()
        assert await (await client.get(f"{BASE}/{ZIP}")).read() == good
        await client.close()
    assert len(reads) == 1
    assert (await package_record(cache))["stored_as"] == record["stored_as"]


async def test_a_client_that_got_the_whole_zip_finds_it_recorded_as_stored(
        make: Make, registry: FakeRegistry, write_config: Callable[..., Path],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The record that vouches for a fresh download (its size and identity) is saved before
    the followers get its last byte: a `warm` that stops the proxy as soon as it has the file
    leaves it served from the cache and exportable, not fetched again."""
    good = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    cache = Path(load_config(write_config(), environ={}).cache.dir)
    real_save = VerifiedPackages.save

    async def slow_save(self: VerifiedPackages, *args: Any) -> None:
        await asyncio.sleep(0.2)  # a busy index
        await real_save(self, *args)

    monkeypatch.setattr(VerifiedPackages, "save", slow_save)
    client = await make()
    assert await (await client.get(f"{BASE}/{ZIP}")).read() == good
    await client.close()  # at once: what is left of the fill is cancelled
    record = await package_record(cache)
    stored = next(cache.rglob(ZIP))
    assert record["size"] == len(good)
    assert record["stored_as"][2:] == [len(good), stored.stat().st_mtime_ns]


# --- module archives ---------------------------------------------------------------------

MODULE_ARCHIVE = f"{MODULE}/1.0.0/tarball-aws-1.0.0.tar.gz"
MODULE_SOURCE = "/archives/tarball-1.0.0.tgz"
MODULE_KEY = "module-archive/registry.terraform.io/acme/tarball/aws/1.0.0"


async def fill_module(make: Make, cache: Path) -> tuple[bytes, Path]:
    """The module archive as first served, and where it is stored."""
    client = await make()
    response = await client.get(MODULE_ARCHIVE)
    assert response.status == 200, await response.text()
    served = await response.read()
    await client.close()
    return served, cache / "modules/registry.terraform.io/acme/tarball/aws/1.0.0.tar.gz"


async def module_record(cache: Path) -> dict[str, Any] | None:
    index = MetadataCache(cache / "index")
    try:
        return await index.get(MODULE_KEY)
    finally:
        index.close()


async def test_a_module_archive_written_over_is_built_again_online_and_never_served_offline(
        make: Make, registry: FakeRegistry, write_config: Callable[..., Path]) -> None:
    cache = Path(load_config(write_config(), environ={}).cache.dir)
    original, stored = await fill_module(make, cache)
    record = await module_record(cache)
    assert record is not None
    assert (record["sha256"], record["size"]) == (hashlib.sha256(original).hexdigest(),
                                                  len(original))
    await write_over(stored, random.Random(7).randbytes(len(original)))

    registry.requests.clear()
    online = await make()
    responses = await asyncio.gather(*(online.get(MODULE_ARCHIVE) for _ in range(3)))
    assert [await r.read() for r in responses] == [original] * 3  # packed again, once
    assert registry.paths().count(MODULE_SOURCE) == 1
    metrics = await (await online.get("/metrics")).text()
    assert sample(metrics, "tfproxy_integrity_failures_total", kind="stored") == 1
    assert stored.read_bytes() == original
    await online.close()

    await write_over(stored, random.Random(8).randbytes(len(original)))
    registry.requests.clear()
    offline = await make(upstream_mode="offline")
    response = await offline.get(MODULE_ARCHIVE)
    assert response.status == 502  # an integrity failure, with nothing else to serve
    assert "damaged" in (await response.json())["errors"][0]
    assert not stored.exists()
    assert registry.requests == []


async def test_a_module_archive_stored_without_a_recorded_sha256_is_adopted_only_if_intact(
        make: Make, registry: FakeRegistry, write_config: Callable[..., Path]) -> None:
    """As stored by an older version, or imported from a bundle."""
    cache = Path(load_config(write_config(), environ={}).cache.dir)
    original, stored = await fill_module(make, cache)

    async def forget_record() -> None:
        index = MetadataCache(cache / "index")
        try:
            await index.delete(MODULE_KEY)
        finally:
            index.close()

    await forget_record()
    registry.requests.clear()
    client = await make()
    assert await (await client.get(MODULE_ARCHIVE)).read() == original
    assert registry.requests == []  # intact: served from the cache, and its sha256 recorded
    record = await module_record(cache)
    assert record is not None and record["sha256"] == hashlib.sha256(original).hexdigest()
    await client.close()

    await forget_record()
    await write_over(stored, original[:len(original) // 2])  # a torn copy
    client = await make()
    assert await (await client.get(MODULE_ARCHIVE)).read() == original
    assert registry.paths().count(MODULE_SOURCE) == 1
    metrics = await (await client.get("/metrics")).text()
    assert sample(metrics, "tfproxy_integrity_failures_total", kind="stored") == 1
