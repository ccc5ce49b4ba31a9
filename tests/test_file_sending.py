"""Cached files sent over TLS: read in chunks from the page cache on the loop (on a thread
where the file system cannot say whether a read would wait), never handing a transport a
buffer that is then overwritten; ranges, HEAD and 416 answered as before."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import trustme

from proxy.app import create_app
from proxy.config import load_config
from proxy.core.file_reads import ChunkReader
from tests.support.fake_registry import FakeRegistry
from tests.support.raw_http import served

BASE = "/mirror/registry.terraform.io/hashicorp/chunky"
ZIP = "terraform-provider-chunky_1.0.0_linux_amd64.zip"
CHUNK = 64 << 10  # what responses.py reads at a time


@pytest.fixture
def content(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(3 * CHUNK + 1234)
    path = tmp_path / "file"
    path.write_bytes(data)
    return path, data


async def test_a_chunk_still_held_is_never_overwritten(content: tuple[Path, bytes]) -> None:
    # A transport may keep a chunk it could not send at once: the reader must not reuse
    # that buffer for the next read.
    path, data = content
    fd = os.open(path, os.O_RDONLY)
    try:
        reader = ChunkReader(fd, CHUNK)
        held = [await reader.read(offset, CHUNK) for offset in range(0, len(data), CHUNK)]
        assert [bytes(chunk) for chunk in held] == \
            [data[offset:offset + CHUNK] for offset in range(0, len(data), CHUNK)]
        del held  # sent: the buffers are free again
        again = [bytes(await reader.read(offset, CHUNK)) for offset in (CHUNK, 0)]
        assert again == [data[CHUNK:2 * CHUNK], data[:CHUNK]]
        assert await reader.read(len(data), CHUNK) == b""  # the end of the file
    finally:
        os.close(fd)


async def test_without_nowait_reads_every_chunk_is_read_on_a_thread(
        content: tuple[Path, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    # tmpfs, for one, refuses RWF_NOWAIT: the reader then stops asking for it.
    path, data = content
    refused = []

    def preadv(fd: int, buffers: list[Any], offset: int, flags: int = 0) -> int:
        refused.append(offset)
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "preadv", preadv)
    fd = os.open(path, os.O_RDONLY)
    try:
        reader = ChunkReader(fd, CHUNK)
        read = [bytes(await reader.read(offset, CHUNK))
                for offset in range(0, len(data), CHUNK)]
    finally:
        os.close(fd)
    assert b"".join(read) == data
    assert refused == [0]


async def test_ranges_of_a_file_larger_than_a_chunk_over_tls(
        registry: FakeRegistry, write_config: Callable[..., Path],
        upstream_ca: trustme.CA) -> None:
    if ("hashicorp", "chunky", "1.0.0") not in registry.releases:
        registry.add_large_release("hashicorp", "chunky", "1.0.0", 3 * CHUNK + 4321)
    whole = registry.releases[("hashicorp", "chunky", "1.0.0")].zips["linux_amd64"]
    size = len(whole)
    config = load_config(write_config(), environ={})
    async with served(create_app(config), upstream_ca) as proxy, \
            aiohttp.ClientSession() as session:
        url = proxy.url(f"{BASE}/{ZIP}")

        async def get(range_: str | None, method: str = "GET") -> tuple[int, Any, bytes]:
            headers = {"Range": range_} if range_ else {}
            async with session.request(method, url, headers=headers,
                                       ssl=proxy.client_tls) as response:
                return response.status, response.headers, await response.read()

        assert '"linux_amd64"' in await proxy.text(f"{BASE}/1.0.0.json")
        assert (await get(None))[::2] == (200, whole)  # the fill
        assert (await get(None))[::2] == (200, whole)  # from the cache
        for wanted, start, end in [("bytes=0-0", 0, 1),
                                   (f"bytes={CHUNK - 5}-{CHUNK + 5}", CHUNK - 5, CHUNK + 6),
                                   ("bytes=100000-", 100000, size),
                                   ("bytes=-1000", size - 1000, size),
                                   (f"bytes={2 * CHUNK}-{size + 99}", 2 * CHUNK, size)]:
            status, headers, body = await get(wanted)
            assert (status, body) == (206, whole[start:end]), wanted
            assert headers["Content-Range"] == f"bytes {start}-{end - 1}/{size}"
        status, headers, body = await get(None, "HEAD")
        assert (status, headers["Content-Length"], body) == (200, str(size), b"")
        status, headers, body = await get(f"bytes={size}-")
        assert status == 416 and headers["Content-Range"] == f"bytes */{size}"
        assert body == f'{{"errors": ["range not satisfiable: the file has {size} bytes"]}}'\
            .encode()
