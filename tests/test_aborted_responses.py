"""A failure after the response headers went out resets the connection and is counted: the
client never sees a clean end of bad bytes, nor an error answer glued into the body. The
proxy runs as `serve` runs it (TLS, handlers not cancelled when clients hang up); a raw
client sees every byte and how the connection ended."""

from __future__ import annotations

import asyncio
import errno
import io
import logging
import os
import pathlib
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

import aiofiles.os
import aiohttp
import pytest
import trustme
from aiohttp import web
from aiohttp.test_utils import TestClient, make_mocked_request

from proxy.app import create_app
from proxy.config import Config, load_config
from proxy.core.errors import IntegrityError
from proxy.core.metrics import Metrics
from proxy.store.archives import ArchiveStore
from proxy.web.access_log import request_line_fields
from proxy.web.responses import abort_after_headers
from tests.support.fake_registry import FakeRegistry
from tests.support.metrics import declared, sample
from tests.support.raw_http import RawAnswer, Served, raw_get, served

BASE = "/mirror/registry.terraform.io/hashicorp/null"
ZIP = "terraform-provider-null_3.2.1_linux_amd64.zip"
MODULE_ARCHIVE = "/modules/registry.terraform.io/acme/tarball/aws/1.0.0/tarball-aws-1.0.0.tar.gz"
ABORTED = "tfproxy_aborted_responses_total"
Start = Callable[..., AbstractAsyncContextManager[Served]]


@pytest.fixture
def start(write_config: Callable[..., Path], upstream_ca: trustme.CA) -> Start:
    """Serve the app built from the fake-upstream config (TF_REGISTRY_PROXY_* overrides as
    keyword arguments)."""

    def start(**env: str) -> AbstractAsyncContextManager[Served]:
        environ = {f"TF_REGISTRY_PROXY_{k.upper()}": v for k, v in env.items()}
        return served(create_app(load_config(write_config(), environ=environ)), upstream_ca)

    return start


def package(registry: FakeRegistry) -> bytes:
    return registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]


def assert_cut_short(answer: RawAnswer, whole: bytes) -> None:
    """Headers announced the whole file; fewer bytes came, and then a reset: no second
    status line, no JSON error in the body."""
    assert answer.status == 200
    assert answer.content_length == len(whole)
    assert len(answer.body) < len(whole), answer.body[-120:]
    assert b"HTTP/1.1" not in answer.body
    assert answer.ended == "reset"


def fail_reads_after(monkeypatch: pytest.MonkeyPatch, cache: Path, good: int) -> None:
    """Reading a cached file fails with EIO once its first `good` bytes went out, whether it
    is sent by sendfile (plain TCP) or read and written (TLS: by positioned reads of its
    descriptor, or through a file object)."""
    real_sendfile, real_open = os.sendfile, pathlib.Path.open
    real_pread, real_preadv = os.pread, os.preadv

    def cached(fd: int) -> bool:
        return os.readlink(f"/proc/self/fd/{fd}").startswith(str(cache))

    def sendfile(out_fd: int, in_fd: int, offset: int, count: int) -> int:
        if not cached(in_fd):
            return real_sendfile(out_fd, in_fd, offset, count)
        if offset >= good:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_sendfile(out_fd, in_fd, offset, min(count, good - offset))

    def pread(fd: int, count: int, offset: int) -> bytes:
        if not cached(fd):
            return real_pread(fd, count, offset)
        if offset >= good:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_pread(fd, min(count, good - offset), offset)

    def preadv(fd: int, buffers: list[Any], offset: int, flags: int = 0) -> int:
        if not cached(fd):
            return real_preadv(fd, buffers, offset, flags)
        if offset >= good:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_preadv(fd, [memoryview(buffers[0])[:good - offset]], offset, flags)

    class FailingFile(io.FileIO):
        def readinto(self, buffer: Any) -> int:
            offset = self.tell()
            if offset >= good:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return super().readinto(memoryview(buffer)[:good - offset])

    def open_(path: pathlib.Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        # Files may be sent by the name of a descriptor already open (/proc/self/fd/N).
        if mode == "rb" and pathlib.Path(os.path.realpath(path)).is_relative_to(cache):
            return FailingFile(path, "rb")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(os, "sendfile", sendfile)
    monkeypatch.setattr(os, "pread", pread)
    monkeypatch.setattr(os, "preadv", preadv)
    monkeypatch.setattr(pathlib.Path, "open", open_)


@pytest.mark.parametrize("failing", ["rename into place", "eviction"])
async def test_streamed_fill_that_fails_to_publish_cuts_every_client(
        start: Start, registry: FakeRegistry, proxy_config: Config,
        monkeypatch: pytest.MonkeyPatch, failing: str) -> None:
    if failing == "rename into place":
        async def replace(_src: object, _dst: object) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(aiofiles.os, "replace", replace)
        settings = {}
    else:
        async def evict(_self: ArchiveStore, keep: Path | None = None) -> int:
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(ArchiveStore, "evict", evict)
        settings = {"cache_max_size": "100"}
    whole = package(registry)
    async with start(**settings) as proxy:
        assert '"linux_amd64"' in await proxy.text(f"{BASE}/3.2.1.json")
        registry.faults.add("slowzip")  # both clients join the fill while it runs
        answers = await asyncio.gather(*(proxy.raw_get(f"{BASE}/{ZIP}") for _ in range(2)))
        for answer in answers:
            assert_cut_short(answer, whole)
            assert whole.startswith(answer.body)  # the last byte was held back: no more
        text = await proxy.text("/metrics")
        assert sample(text, ABORTED, route="mirror", reason="io") == 2
        if failing == "rename into place":
            assert not list(proxy_config.cache.dir.rglob("*.zip"))

        monkeypatch.undo()
        registry.faults.clear()
        registry.requests.clear()
        answer = await proxy.raw_get(f"{BASE}/{ZIP}")
        assert (answer.status, answer.body) == (200, whole)
        # Nothing the failed fill left is trusted: the package is fetched and checked again.
        assert len(registry.archive_requests()) == 1


async def test_download_failing_verification_cuts_clients_and_is_counted(
        start: Start, registry: FakeRegistry) -> None:
    async with start() as proxy:
        assert '"linux_amd64"' in await proxy.text(f"{BASE}/3.2.1.json")
        registry.faults.update({"slowzip", "corrupt"})
        assert_cut_short(await proxy.raw_get(f"{BASE}/{ZIP}"), package(registry))
        text = await proxy.text("/metrics")
        assert sample(text, ABORTED, route="mirror", reason="integrity") == 1


async def test_body_of_unknown_length_is_cut_by_a_reset_not_a_close(
        start: Start, registry: FakeRegistry) -> None:
    # Upstream does not say the size, and an HTTP/1.0 client cannot take chunks: the body
    # ends where the connection ends, so a clean close would pass for a whole file.
    async with start() as proxy:
        assert '"linux_amd64"' in await proxy.text(f"{BASE}/3.2.1.json")
        registry.faults.update({"slowzip", "corrupt", "nolength"})
        answer = await proxy.raw_get(f"{BASE}/{ZIP}", version="1.0")
        assert answer.status == 200
        assert "content-length" not in answer.headers
        assert 0 < len(answer.body) < len(package(registry))
        assert answer.ended == "reset"


@pytest.mark.parametrize(("path", "route"), [(f"{BASE}/{ZIP}", "mirror"),
                                             (MODULE_ARCHIVE, "module")])
async def test_read_error_in_a_cached_file_cuts_the_connection(
        start: Start, proxy_config: Config, monkeypatch: pytest.MonkeyPatch,
        path: str, route: str) -> None:
    async with start() as proxy:
        first = await proxy.raw_get(path)
        assert first.status == 200 and len(first.body) == first.content_length > 100
        fail_reads_after(monkeypatch, proxy_config.cache.dir, 100)
        answer = await proxy.raw_get(path)
        assert_cut_short(answer, first.body)
        assert answer.body == first.body[:100]
        monkeypatch.undo()
        assert sample(await proxy.text("/metrics"), ABORTED, route=route, reason="io") == 1


async def test_read_error_by_sendfile_cuts_the_connection(
        client: TestClient, proxy_config: Config,  # type: ignore[type-arg]
        monkeypatch: pytest.MonkeyPatch) -> None:
    # Plain TCP: the file goes out by sendfile(2), which is where the read fails.
    whole = await (await client.get(f"{BASE}/{ZIP}")).read()
    fail_reads_after(monkeypatch, proxy_config.cache.dir, 100)
    assert client.host and client.port
    answer = await asyncio.to_thread(raw_get, client.host, client.port, f"{BASE}/{ZIP}")
    assert_cut_short(answer, whole)
    assert answer.body == whole[:100]
    text = await (await client.get("/metrics")).text()
    assert sample(text, ABORTED, route="mirror", reason="io") == 1


async def test_http_clients_see_a_broken_body(
        start: Start, registry: FakeRegistry, proxy_config: Config,
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with start() as proxy, aiohttp.ClientSession() as session:
        url = proxy.url(f"{BASE}/{ZIP}")
        async with session.get(url, ssl=proxy.client_tls) as response:
            assert await response.read() == package(registry)
        fail_reads_after(monkeypatch, proxy_config.cache.dir, 100)
        async with session.get(url, ssl=proxy.client_tls) as response:
            assert response.status == 200
            with pytest.raises(aiohttp.ClientPayloadError):
                await response.read()


@pytest.mark.parametrize("failing", ["package lookup", "module publish"])
async def test_failure_before_headers_is_still_a_json_error(
        start: Start, proxy_config: Config, monkeypatch: pytest.MonkeyPatch,
        failing: str) -> None:
    async def broken(*_args: object) -> None:
        # An I/O error (a full disk is a 507 of its own: see test_disk_full.py).
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    async with start() as proxy:
        if failing == "package lookup":
            path, route = f"{BASE}/{ZIP}", "mirror"
            assert (await proxy.raw_get(path)).status == 200
            monkeypatch.setattr(ArchiveStore, "identity", broken)  # the hit's stat
        else:
            path, route = MODULE_ARCHIVE, "module"
            monkeypatch.setattr(aiofiles.os, "replace", broken)
        answer = await proxy.raw_get(path)
        assert answer.status == 500
        assert answer.body == b'{"errors": ["internal error"]}'
        assert answer.ended == "idle"  # a complete answer: the connection stays usable
        monkeypatch.undo()
        text = await proxy.text("/metrics")
    assert declared(text, ABORTED), text  # none counted, not a metric gone missing
    for reason in ("integrity", "upstream", "io", "internal"):
        assert sample(text, ABORTED, route=route, reason=reason) == 0  # there, not counted
    assert not list(proxy_config.cache.dir.rglob("*.tar.gz"))


async def test_client_hanging_up_is_neither_an_error_nor_an_abort(
        start: Start, registry: FakeRegistry, proxy_config: Config,
        caplog: pytest.LogCaptureFixture) -> None:
    async with start() as proxy, aiohttp.ClientSession() as session:
        assert '"linux_amd64"' in await proxy.text(f"{BASE}/3.2.1.json")
        registry.faults.add("slowzip")
        leaving = await session.get(proxy.url(f"{BASE}/{ZIP}"), ssl=proxy.client_tls)
        await leaving.content.readexactly(32)
        leaving.close()
        for _ in range(200):  # the fill goes on and publishes; writes to the gone client fail
            if list(proxy_config.cache.dir.rglob(ZIP)):
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("the fill did not finish")
        text = await proxy.text("/metrics")
    assert declared(text, ABORTED), text  # none counted, not a metric gone missing
    for reason in ("integrity", "upstream", "io", "internal"):
        assert sample(text, ABORTED, route="mirror", reason=reason) == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_the_access_line_of_a_cut_off_download_says_so() -> None:
    # The status line said 200 before the failure: the access log must not read as a success.
    request = make_mocked_request("GET", f"{BASE}/{ZIP}")
    response = web.StreamResponse()
    response.content_length = 1000
    abort_after_headers(request, IntegrityError("checksum", "does not match"),
                        Metrics().aborted_responses, "mirror")
    fields = request_line_fields(request, response, 0.01)
    assert fields["aborted"] == "integrity"
    assert fields["bytes"] != 1000  # not the announced size: it was not all sent
