"""Stopping is bounded: SIGTERM stops accepting at once and cuts slow responses after the
grace period (exit 0, no temp files left); workers never outlive their parent."""

from __future__ import annotations

import asyncio
import http.client
import os
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import trustme
from aiohttp import web

from proxy.config import ServerConfig
from proxy.core.metrics import Metrics
from proxy.web.shutdown import CUT_TIMEOUT, stop_serving
from proxy.web.tls_server import HandshakeFailures, TlsSite, open_connections
from tests.support.fake_registry import FakeRegistry
from tests.support.proxy_process import ProxyProcess, free_port, worker_pids

GRACE = 2.0
SLOW = ("hashicorp", "slowpoke", "1.0.0")


def slow_release(registry: FakeRegistry) -> int:
    """A package of about 20 KB: with the "slowzip" fault it trickles in for about 30 s.
    Returns its size."""
    if SLOW not in registry.releases:
        registry.add_release(*SLOW, platforms=("linux_amd64",), padding=8 << 20)
    return len(registry.releases[SLOW].zips["linux_amd64"])


def alive(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except FileNotFoundError:
        return False


def accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


class SlowDownload(threading.Thread):
    """Downloads the slow package, recording how much arrived and when the body ended."""

    def __init__(self, proxy: ProxyProcess, size: int) -> None:
        super().__init__(daemon=True)
        self.proxy = proxy
        self.size = size
        self.received = 0
        self.complete = False
        self.ended: float | None = None

    def run(self) -> None:
        context = ssl.create_default_context(cafile=str(self.proxy.ca_file))
        url = (f"{self.proxy.url}mirror/registry.terraform.io/hashicorp/slowpoke/"
               "terraform-provider-slowpoke_1.0.0_linux_amd64.zip")
        try:
            with urllib.request.urlopen(url, context=context, timeout=60) as response:
                while chunk := response.read1(4096):
                    self.received += len(chunk)
                self.complete = self.received == self.size
        except (OSError, http.client.HTTPException):
            pass  # cut by the proxy's shutdown
        finally:
            self.ended = time.monotonic()


def slow_download_under_way(proxy: ProxyProcess, registry: FakeRegistry,
                            size: int) -> SlowDownload:
    """A client downloading a package that upstream sends slowly, once its first bytes came."""
    registry.faults.add("slowzip")
    download = SlowDownload(proxy, size)
    download.start()
    deadline = time.monotonic() + 20
    while download.received == 0:
        assert time.monotonic() < deadline and download.ended is None, "no download"
        time.sleep(0.05)
    return download


@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_stops_accepting_at_once_and_cuts_slow_downloads_after_the_grace_period(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry,
        workers: int) -> None:
    size = slow_release(registry)
    port, cache = free_port(), tmp_path / "cache"
    proxy = ProxyProcess(write_config(cache_dir=cache, port=port), cache, port,
                         tmp_path / "proxy.log",
                         env={"TF_REGISTRY_PROXY_SERVER_SHUTDOWN_TIMEOUT": str(GRACE),
                              "TF_REGISTRY_PROXY_SERVER_WORKERS": str(workers)})
    with proxy:
        assert proxy.process is not None
        download = slow_download_under_way(proxy, registry, size)
        assert list((cache / "tmp").rglob("*.part"))  # a fill is under way

        signalled = time.monotonic()
        proxy.process.send_signal(signal.SIGTERM)
        while accepts(port):
            assert time.monotonic() - signalled < 1.5, "still accepting after SIGTERM"
            time.sleep(0.05)
        try:
            code = proxy.process.wait(timeout=GRACE + 5)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running {GRACE + 5} s after SIGTERM with a slow download")
        download.join(timeout=5)

    assert code == 0, proxy.log.read_text()[-3000:]
    # The download had its grace period, then was cut: not served as if complete.
    assert download.ended is not None and download.ended - signalled >= GRACE - 0.5
    assert not download.complete
    # The cancelled fill left nothing: no temp file, no per-process temp directory.
    leftovers = [p for p in (cache / "tmp").iterdir() if p.name != "locks"]
    assert leftovers == []
    assert not list((cache / "archives").rglob("*.zip"))
    assert "cutting 1 connection(s)" in proxy.log.read_text()


def test_a_second_sigterm_cuts_at_once(tmp_path: Path, write_config: Callable[..., Path],
                                       registry: FakeRegistry) -> None:
    size = slow_release(registry)
    port, cache = free_port(), tmp_path / "cache"
    proxy = ProxyProcess(write_config(cache_dir=cache, port=port), cache, port,
                         tmp_path / "proxy.log")  # the default grace period: 30 s
    with proxy:
        assert proxy.process is not None
        download = slow_download_under_way(proxy, registry, size)
        proxy.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert proxy.process.poll() is None  # waiting for the download
        proxy.process.send_signal(signal.SIGTERM)
        assert proxy.process.wait(timeout=5) == 0
    assert not download.complete
    assert [p for p in (cache / "tmp").iterdir() if p.name != "locks"] == []


def test_workers_die_with_their_parent(tmp_path: Path, write_config: Callable[..., Path],
                                       registry: FakeRegistry) -> None:
    """SIGKILL gives the parent no chance to stop its workers: they notice and stop, so a
    supervisor's restart can listen on the port again. Also when a worker forked later
    hangs (stopped here): it holds a copy of the earlier worker's end of the pipe that
    tells a worker its parent is gone."""
    port, cache = free_port(), tmp_path / "cache"
    config = write_config(cache_dir=cache, port=port)
    proxy = ProxyProcess(config, cache, port, tmp_path / "proxy.log",
                         env={"TF_REGISTRY_PROXY_SERVER_WORKERS": "2"})
    with proxy:
        assert proxy.process is not None
        first, last = sorted(worker_pids(proxy.process.pid), key=_started_at)
        os.kill(last, signal.SIGSTOP)
        try:
            proxy.process.kill()
            proxy.process.wait()
            _gone_within([first], 10, "a worker outlived its parent's SIGKILL")
        finally:
            os.kill(last, signal.SIGCONT)
        _gone_within([last], 10, "the stopped worker did not stop once resumed")
    # One process without SO_REUSEPORT: it can listen only if no orphan still does.
    with ProxyProcess(config, cache, port, tmp_path / "restarted.log") as restarted:
        assert restarted.cli("healthcheck").returncode == 0


def _started_at(pid: int) -> tuple[int, int]:
    """When a process started (clock ticks since boot), then its pid: the order of forks."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return int(fields[19]), pid


def _gone_within(pids: list[int], seconds: float, failure: str) -> None:
    deadline = time.monotonic() + seconds
    while any(alive(pid) for pid in pids):
        if time.monotonic() > deadline:
            for pid in pids:  # not left behind by the test either
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
            pytest.fail(failure)
        time.sleep(0.1)


async def test_a_client_that_stops_reading_is_cut_after_the_grace_period(
        upstream_ca: trustme.CA) -> None:
    """The case that kept a proxy alive for two minutes: the response fills every buffer on
    the way and the handler waits for the client to read on."""
    async def endless(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        while True:
            await response.write(b"x" * (1 << 16))

    app = web.Application()
    app.router.add_get("/", endless)
    runner = web.AppRunner(app)  # its own shutdown_timeout: 60 s
    await runner.setup()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    upstream_ca.issue_cert("127.0.0.1").configure_cert(server_context)
    port = free_port()
    metrics = Metrics()
    await TlsSite(runner, "127.0.0.1", port, server_context,
                  HandshakeFailures(metrics.tls_handshake_failures, ""),
                  open_connections(ServerConfig(), metrics)).start()
    client_context = ssl.create_default_context()
    upstream_ca.configure_trust(client_context)
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_context)
    writer.write(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert (await reader.readline()).startswith(b"HTTP/1.1 200")
    await asyncio.sleep(0.5)  # the client reads no more: every buffer on the way fills up
    assert runner.server is not None and runner.server.connections

    loop = asyncio.get_running_loop()
    started = loop.time()
    await stop_serving(runner, 1.0, asyncio.Event())
    assert 0.9 <= loop.time() - started < 1.0 + 2 * CUT_TIMEOUT + 0.5
    assert runner.server is None  # cleaned up
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)
    writer.close()


def test_idle_keep_alive_clients_do_not_hold_up_a_stop(
        tmp_path: Path, write_config: Callable[..., Path]) -> None:
    """A client that keeps its TLS connection open after its answer and never answers the
    close_notify (Go's HTTP client, Terraform's, between requests) has nothing under way:
    SIGTERM stops the proxy at once, not after the grace period."""
    port, cache = free_port(), tmp_path / "cache"
    proxy = ProxyProcess(write_config(cache_dir=cache, port=port), cache, port,
                         tmp_path / "proxy.log",
                         env={"TF_REGISTRY_PROXY_SERVER_SHUTDOWN_TIMEOUT": "20"})
    with proxy:
        assert proxy.process is not None
        context = ssl.create_default_context(cafile=str(proxy.ca_file))
        raw = socket.create_connection(("127.0.0.1", port))
        idle = context.wrap_socket(raw, server_hostname="127.0.0.1")
        idle.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert idle.recv(4096).startswith(b"HTTP/1.1 200")
        signalled = time.monotonic()
        proxy.process.send_signal(signal.SIGTERM)
        code = proxy.process.wait(timeout=30)
        stopped = time.monotonic() - signalled
        idle.close()
    assert code == 0
    assert stopped < 5, f"the stop waited {stopped:.1f} s for an idle connection"
