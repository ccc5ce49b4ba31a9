"""Clients that connect and then stall (no TLS handshake, no request, half a request, idle
after a request) are cut after the configured timeouts, and a process serves at most
server.max_connections at once: the rest wait in the listen backlog, they are not refused."""

from __future__ import annotations

import concurrent.futures
import logging
import resource
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from proxy.config import ConfigError, ServerConfig, load_config
from proxy.core.metrics import Metrics
from proxy.web.connections import raise_descriptor_limit
from proxy.web.tls_server import ConnectionReports
from tests.support.fake_registry import FakeRegistry
from tests.support.metrics import sample
from tests.support.proxy_process import ProxyProcess, free_port
from tests.support.stalled_clients import (
    connect,
    connect_tls,
    ending,
    read_response,
    request_head,
    tls_context,
)

# Small bounds, so stalled clients are cut within seconds; the idle one differs from the
# head one so the metric shows which deadline cut which connection.
TIMEOUTS = {"TF_REGISTRY_PROXY_SERVER_TLS_HANDSHAKE_TIMEOUT": "1",
            "TF_REGISTRY_PROXY_SERVER_REQUEST_HEAD_TIMEOUT": "1.5",
            "TF_REGISTRY_PROXY_SERVER_KEEPALIVE_TIMEOUT": "3"}
MARGIN = 4.0  # seconds past the longest bound before a connection left open fails the test
EACH = 3  # stalled connections of each kind, opened together
HEALTHY = b'{"status":"ok"}'


@pytest.fixture
def start_proxy(tmp_path: Path, write_config: Callable[..., Path],
                registry: FakeRegistry) -> Iterator[Callable[[dict[str, str]], ProxyProcess]]:
    with ExitStack() as stack:
        def start(env: dict[str, str]) -> ProxyProcess:
            port, cache = free_port(), tmp_path / "cache"
            return stack.enter_context(ProxyProcess(write_config(cache_dir=cache, port=port),
                                                    cache, port, tmp_path / "proxy.log",
                                                    env=env))
        yield start


def scrape(proxy: ProxyProcess) -> str:
    """/metrics over a fresh connection (a normal client, served normally)."""
    with connect_tls(proxy.port, tls_context(proxy.ca_file)) as sock:
        sock.sendall(request_head("/metrics", proxy.port))
        head, body = read_response(sock)
    assert head.startswith(b"HTTP/1.1 200 "), head
    return body.decode()


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_stalled_connections_are_cut(start_proxy: Callable[[dict[str, str]], ProxyProcess],
                                     event_loop: str) -> None:
    proxy = start_proxy({**TIMEOUTS, "TF_REGISTRY_PROXY_SERVER_EVENT_LOOP": event_loop})
    port, context = proxy.port, tls_context(proxy.ca_file)
    with ExitStack() as stack:
        stalled: dict[str, list[socket.socket]] = {kind: [] for kind in (
            "no handshake", "no request", "half a head", "idle after a request",
            "half a head after a request")}
        for _ in range(EACH):
            stalled["no handshake"].append(stack.enter_context(connect(port)))
            silent = stack.enter_context(connect_tls(port, context))
            stalled["no request"].append(silent)
            half = stack.enter_context(connect_tls(port, context))
            half.sendall(request_head("/healthz", port)[:30])
            stalled["half a head"].append(half)
            for kind, then in (("idle after a request", b""),
                               ("half a head after a request", b"GET /healthz HTTP/1.1\r\n")):
                used = stack.enter_context(connect_tls(port, context))
                used.sendall(request_head("/healthz", port))
                assert read_response(used)[1] == HEALTHY
                used.sendall(then)
                stalled[kind].append(used)
        # Meanwhile a real client that writes its head in pieces (the blank line that ends
        # it split too) and reuses its connection after a pause is served, never cut.
        with connect_tls(port, context) as normal:
            for piece in (b"GET /healthz HTTP/1.1\r\n", b"Host: localhost\r\n\r",
                          b"\n"):
                normal.sendall(piece)
                time.sleep(0.3)
            assert read_response(normal)[1] == HEALTHY
            time.sleep(1)
            normal.sendall(request_head("/healthz", port))
            assert read_response(normal)[1] == HEALTHY
        deadline = time.monotonic() + 3 + MARGIN
        endings = {kind: [ending(sock, deadline) for sock in socks]
                   for kind, socks in stalled.items()}
        # Closed (FIN or RST), without an answer: none was left open.
        assert all(how in ("eof", "reset") and not data for found in endings.values()
                   for how, data in found), endings
        # Every place is free again (only the scrape's is in use) while these clients still
        # hold their ends: the idle ones were closed the ordinary way (a TLS close), which
        # they never answer, and that wait is bounded too (by tls_handshake_timeout).
        deadline = time.monotonic() + 4
        while sample(text := scrape(proxy), "tfproxy_open_connections") != 1.0:
            assert time.monotonic() < deadline, text
            time.sleep(0.2)
    # Each deadline counted its own.
    assert sample(text, "tfproxy_connections_cut_total", reason="handshake_timeout") == EACH
    assert sample(text, "tfproxy_connections_cut_total", reason="head_timeout") == 3 * EACH
    lines = [line for line in proxy.log.read_text().splitlines() if "closed the connection"
             in line]
    assert len(lines) == 1, lines  # the rest counted, not logged: cut within seconds
    assert " INFO proxy.web.tls_server: closed the connection from 127.0.0.1:" in lines[0]
    assert "Traceback" not in proxy.log.read_text()


def test_connections_beyond_the_limit_wait_for_a_place(
        start_proxy: Callable[[dict[str, str]], ProxyProcess]) -> None:
    proxy = start_proxy({"TF_REGISTRY_PROXY_SERVER_MAX_CONNECTIONS": "5"})
    context = tls_context(proxy.ca_file)
    with ExitStack() as stack, concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = [stack.enter_context(connect_tls(proxy.port, context)) for _ in range(5)]
        sixth = pool.submit(scrape, proxy)
        # It connects (the kernel queues it), but nothing takes it while five are open.
        done, _ = concurrent.futures.wait([sixth], timeout=3)
        assert not done, "a sixth connection was served while five were open"
        held.pop().close()
        text = sixth.result(timeout=10)
    assert sample(text, "tfproxy_open_connections") == 5.0  # four held, and this one
    assert sample(text, "tfproxy_max_connections") == 5.0
    waits = sample(text, "tfproxy_connection_limit_waits_total")
    assert waits is not None and waits >= 1, text
    assert "5 client connections are open (server.max_connections): new ones wait in the " \
           "listen backlog until one closes" in proxy.log.read_text()


def test_settings_defaults_and_validation(tmp_path: Path) -> None:
    server = load_config(environ={}).server
    assert (server.tls_handshake_timeout, server.request_head_timeout,
            server.keepalive_timeout, server.max_connections) == (10.0, 20.0, 75.0, 1000)
    assert server == ServerConfig(state_dir=server.state_dir)
    path = tmp_path / "bad.toml"
    path.write_text('[server]\ntls_handshake_timeout = 0\nrequest_head_timeout = "soon"\n'
                    'keepalive_timeout = -1\nmax_connections = 0\n')
    with pytest.raises(ConfigError) as error:
        load_config(path, environ={})
    assert sorted(error.value.problems) == [
        "server.keepalive_timeout: expected a positive number, got -1",
        "server.max_connections: expected a whole number of at least 1, got 0",
        "server.request_head_timeout: expected a number of seconds, got 'soon'",
        "server.tls_handshake_timeout: expected a positive number, got 0",
    ]


def test_cut_connections_are_logged_at_most_once_per_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    now = [100.0]
    reports = ConnectionReports(metrics.connections_cut, interval=10, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="proxy.web.tls_server"):
        reports.cut(("10.0.0.7", 50000), "head_timeout")
        for _ in range(3):
            now[0] += 3
            reports.cut(("10.0.0.8", 50001), "handshake_timeout")
        now[0] += 2
        reports.cut(("::1", 50002, 0, 0), "head_timeout")
        reports.full(1000)
    assert [record.getMessage() for record in caplog.records] == [
        "closed the connection from 10.0.0.7:50000: no complete request head within "
        "server.request_head_timeout",
        "closed the connection from [::1]:50002: no complete request head within "
        "server.request_head_timeout (3 more slow connections closed since the last line)",
        "1000 client connections are open (server.max_connections): new ones wait in the "
        "listen backlog until one closes",
    ]
    text = metrics.render().decode()
    assert sample(text, "tfproxy_connections_cut_total", reason="head_timeout") == 2.0
    assert sample(text, "tfproxy_connections_cut_total", reason="handshake_timeout") == 3.0


def test_the_open_file_limit_is_raised_for_max_connections() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1300:
        pytest.skip(f"the hard limit on open files here is {hard}")
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))
        assert raise_descriptor_limit(1256) == 1256
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == 1256
        assert raise_descriptor_limit(600) == 1256  # never lowered
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
