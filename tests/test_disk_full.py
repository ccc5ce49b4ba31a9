"""A full disk is an answer, not a crash: a fill that runs out of space fails every client at
once (a JSON 507 before the headers, a reset connection after them), leaves nothing behind,
is counted and shows in /readyz, while what the cache holds keeps being served. The disk is
a real tmpfs filled to the brim (mounting one needs root: elsewhere these tests skip)."""

from __future__ import annotations

import asyncio
import io
import os
import subprocess
import sys
import tarfile
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import aiohttp
import pytest
import trustme

from proxy.app import create_app
from proxy.config import load_config
from tests.support.fake_registry import FakeRegistry, Release
from tests.support.git_repos import publish_repo
from tests.support.metrics import sample
from tests.support.proxy_process import ProxyProcess, free_port
from tests.support.raw_http import RawAnswer, Served, served
from tests.support.small_disk import SmallDisk, small_filesystem

NULL = "/mirror/registry.terraform.io/hashicorp/null"
BULKY = "/mirror/registry.terraform.io/hashicorp/bulky"
NET = "/modules/registry.terraform.io/acme/net/aws"
TARBALL = "/modules/registry.terraform.io/acme/tarball/aws"
DISK_FULL = "tfproxy_cache_disk_full_total"
LOOKUPS = "tfproxy_cache_lookups_total"


@pytest.fixture
def bulky(registry: FakeRegistry) -> Release:
    """A provider whose packages (256 KiB of noise) do not fit in what the tests leave."""
    key = ("hashicorp", "bulky", "1.0.0")
    if key not in registry.releases:
        registry.add_release(*key, padding=256 << 10, incompressible=True)
    return registry.releases[key]


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[SmallDisk]:
    with small_filesystem(tmp_path / "disk", 16 << 20) as mounted:
        yield mounted


@pytest.fixture
async def proxy(disk: SmallDisk, write_config: Callable[..., Path],
                upstream_ca: trustme.CA) -> AsyncIterator[Served]:
    config = load_config(write_config(cache_dir=disk.root / "cache"), environ={})
    async with served(create_app(config), upstream_ca) as running:
        yield running


async def get(proxy: Served, path: str, method: str = "GET") -> tuple[int, str, bytes]:
    async with aiohttp.ClientSession() as session, \
            session.request(method, proxy.url(path), ssl=proxy.client_tls) as response:
        return response.status, response.content_type, await response.read()


async def metric(proxy: Served, name: str, **labels: str) -> float | None:
    return sample(await proxy.text("/metrics"), name, **labels)


async def wait_for(condition: Callable[[], object], what: str, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def temp_files(disk: SmallDisk) -> list[Path]:
    return list((disk.root / "cache" / "tmp").rglob("*.part"))


async def test_disk_filling_up_mid_download_fails_every_client_at_once(
        proxy: Served, disk: SmallDisk, registry: FakeRegistry, bulky: Release) -> None:
    cached = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    assert await get(proxy, f"{NULL}/terraform-provider-null_3.2.1_linux_amd64.zip") \
        == (200, "application/zip", cached)
    assert (await get(proxy, f"{BULKY}/1.0.0.json"))[0] == 200
    package = f"{BULKY}/{bulky.filename('linux_amd64')}"
    misses = await metric(proxy, LOOKUPS, kind="archive", result="miss")
    assert misses is not None

    # Two downloads and a HEAD join one fill; upstream sends the headers and then holds the
    # body while the disk fills up.
    registry.faults.add("holdzip")
    clients = [asyncio.ensure_future(proxy.raw_get(package, idle=30)) for _ in range(2)]
    head = asyncio.ensure_future(get(proxy, package, "HEAD"))
    await wait_for(lambda: temp_files(disk), "the download to start")
    for _ in range(1000):
        if await metric(proxy, LOOKUPS, kind="archive", result="miss") == misses + 3:
            break
    else:
        pytest.fail("the three clients did not all join the fill")
    disk.fill(leave=64 << 10)
    started = time.monotonic()
    registry.faults.discard("holdzip")
    answers: list[RawAnswer] = await asyncio.gather(*clients)
    assert time.monotonic() - started < 5  # at once, not at a client's timeout
    whole = bulky.zips["linux_amd64"]
    for answer in answers:
        assert answer.status == 200 and answer.content_length == len(whole)
        assert len(answer.body) < len(whole) and whole.startswith(answer.body)
        assert answer.ended == "reset"
    status, content_type, _ = await head
    assert (status, content_type) == (507, "application/json")
    assert temp_files(disk) == []
    assert not list((disk.root / "cache" / "archives").rglob(bulky.filename("linux_amd64")))
    assert await metric(proxy, DISK_FULL, kind="package") == 1
    assert await metric(proxy, "tfproxy_aborted_responses_total", route="mirror",
                        reason="io") == 2

    # Ready no more, with the reason; what the cache holds is still served.
    status, content_type, body = await get(proxy, "/readyz")
    assert (status, content_type) == (503, "application/json")
    assert b"no space left" in body.lower(), body
    assert await get(proxy, f"{NULL}/terraform-provider-null_3.2.1_linux_amd64.zip") \
        == (200, "application/zip", cached)

    # A package that cannot fit is refused before its headers: a JSON 507, at once.
    status, content_type, body = await get(proxy, package)
    assert (status, content_type) == (507, "application/json")
    assert b"cache disk is full" in body
    assert temp_files(disk) == []

    # Space is back: ready again, and the package is fetched, verified and served.
    disk.empty()
    status, _, body = await get(proxy, "/readyz")
    assert status == 200, body
    assert await get(proxy, package) == (200, "application/zip", whole)


@pytest.mark.parametrize(("known", "path", "kind"), [
    # The source archive is downloaded, unpacked and repacked under the cache directory.
    (f"{TARBALL}/versions", f"{TARBALL}/1.0.0/tarball-aws-1.0.0.tar.gz", "module"),
    # git clones the source there (its own writes fail: the proxy learns it from git).
    (f"{NET}/versions", f"{NET}/1.2.0/net-aws-1.2.0.tar.gz", "module"),
    # A provider's version list and signed facts go to the index (SQLite) first.
    (None, f"{NULL}/3.1.0.json", "index"),
])
async def test_fill_on_a_full_disk_is_a_507_and_nothing_is_left(
        proxy: Served, disk: SmallDisk, known: str | None, path: str, kind: str) -> None:
    if known is not None:
        assert (await get(proxy, known))[0] == 200
    disk.fill()
    status, content_type, body = await get(proxy, path)
    assert (status, content_type) == (507, "application/json"), body
    assert b"cache disk is full" in body
    assert str(disk.root).encode() not in body
    assert await metric(proxy, DISK_FULL, kind=kind) == 1
    assert [p for p in (disk.root / "cache" / "tmp").rglob("*")
            if p.is_file() and p.suffix != ".lock"] == []
    assert (await get(proxy, "/readyz"))[0] == 503

    disk.empty()
    assert (await get(proxy, "/readyz"))[0] == 200
    assert (await get(proxy, path))[0] == 200


async def test_git_module_whose_files_do_not_fit_is_a_507(
        proxy: Served, disk: SmallDisk, registry: FakeRegistry, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    """The clone fits (a few kilobytes of packed history), its checkout does not: git's own
    words for that are not an errno message."""
    roomy = ("acme", "roomy", "aws", "1.0.0")
    publish_repo(registry.git_root, f"roomy-{tmp_path.name}", tmp_path / "roomy",
                 {"main.tf": b"# roomy\n", "data.txt": b"terraform " * (400 << 10)},
                 tag="v1.0.0")
    registry.add_module(*roomy, f"git::{registry.url}/git/roomy-{tmp_path.name}.git"
                                "?ref=v1.0.0")
    archive = "/modules/registry.terraform.io/acme/roomy/aws/1.0.0/roomy-aws-1.0.0.tar.gz"
    try:
        assert (await get(proxy, "/modules/registry.terraform.io/acme/roomy/aws/versions")
                )[0] == 200
        disk.fill(leave=256 << 10)
        status, content_type, body = await get(proxy, archive)
        assert (status, content_type) == (507, "application/json"), body
        assert await metric(proxy, DISK_FULL, kind="module") == 1
        assert (await get(proxy, "/readyz"))[0] == 503
        # The log names the cache directory; nothing inside it (git's temp work tree).
        assert str(disk.root / "cache" / "tmp") not in caplog.text
        disk.empty()
        status, _, body = await get(proxy, archive)
        assert status == 200, body
        with tarfile.open(fileobj=io.BytesIO(body)) as tar:
            data = tar.extractfile("data.txt")
            assert data is not None and data.read() == b"terraform " * (400 << 10)
    finally:
        del registry.modules[roomy]


async def test_no_file_left_to_create_is_a_full_disk_too(
        proxy: Served, disk: SmallDisk, registry: FakeRegistry) -> None:
    assert (await get(proxy, f"{NULL}/3.2.1.json"))[0] == 200
    disk.use_all_inodes()
    status, content_type, body = await get(
        proxy, f"{NULL}/terraform-provider-null_3.2.1_darwin_arm64.zip")
    assert (status, content_type) == (507, "application/json"), body
    assert await metric(proxy, DISK_FULL, kind="package") == 1
    disk.empty()
    zipped = registry.releases[("hashicorp", "null", "3.2.1")].zips["darwin_arm64"]
    assert await get(proxy, f"{NULL}/terraform-provider-null_3.2.1_darwin_arm64.zip") \
        == (200, "application/zip", zipped)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_full_disk_at_start_up_is_one_clear_line_and_exit_2(
        disk: SmallDisk, write_config: Callable[..., Path], tmp_path: Path,
        workers: str) -> None:
    cache = disk.root / "cache"
    port = free_port()
    config = write_config(cache_dir=cache, port=port)
    with ProxyProcess(config, cache, port, tmp_path / "first.log"):
        pass  # a cache with its index and certificate, as a proxy leaves it
    disk.fill()  # then the disk filled up while the proxy was down
    started = subprocess.run([sys.executable, "-m", "proxy", "serve", "--config", str(config)],
                             capture_output=True, text=True, timeout=60,
                             env={**os.environ, "HOME": str(tmp_path),
                                  "TF_REGISTRY_PROXY_SERVER_WORKERS": workers})
    assert started.returncode == 2, started.stderr
    assert "Traceback" not in started.stderr
    ours = [line for line in started.stderr.splitlines()
            if line.startswith("tf-registry-proxy:")]
    assert len(ours) == 1, started.stderr
    assert "cannot start" in ours[0] and f"cache.dir {cache}: 0 bytes free" in ours[0], ours
