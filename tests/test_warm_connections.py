"""Connections to upstream opened ahead of an announced download: the next request to that
origin goes out on it; nothing is opened offline, through an outbound proxy, where the egress
policy refuses the host, or beside a connection just used; workers tell each other over
their channels, each warming an origin at most once per WARM_EVERY."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import trustme
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import generate_latest

from proxy.config import Config, load_config
from proxy.core import siblings
from proxy.core.activity import Activity
from proxy.core.errors import UpstreamError
from proxy.core.metrics import Metrics
from proxy.upstream.egress import EgressPolicy
from proxy.upstream.http import UpstreamHTTP, close_session, make_session, origin_of
from proxy.upstream.warm_connections import CONNECT, ConnectionWarmer
from tests.support.metrics import sample

LOOPBACK = 'allowed_networks = ["127.0.0.0/8", "::1/128"]'


@pytest.fixture
async def upstream(aiohttp_server: Callable[..., Awaitable[TestServer]],
                   upstream_ca: trustme.CA) -> TestServer:
    """An HTTPS origin that answers "ok" to every GET (certificate from the upstream CA)."""
    async def ok(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/{tail:.*}", ok)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    upstream_ca.issue_cert("127.0.0.1").configure_cert(context)
    return await aiohttp_server(app, ssl=context)


def exposition(metrics: Metrics) -> str:
    return generate_latest(metrics.registry).decode()


def origin(server: TestServer) -> str:
    return f"https://127.0.0.1:{server.port}"


def open_connections(server: TestServer) -> int:
    assert server.runner is not None and server.runner.server is not None
    return len(server.runner.server.connections)


async def settled(server: TestServer, count: int) -> None:
    """Wait until server holds count connections (a TLS handshake ends on its side later)."""
    for _poll in range(500):
        if open_connections(server) == count:
            return
        await asyncio.sleep(0.01)
    assert open_connections(server) == count


@pytest.fixture
def config(write_config: Callable[..., Path]) -> Callable[..., Config]:
    def make(upstream_extra: str = LOOPBACK) -> Config:
        return load_config(write_config(upstream_extra=upstream_extra), environ={})
    return make


@pytest.fixture
async def upstream_http(config: Callable[..., Config]
                        ) -> AsyncIterator[Callable[..., UpstreamHTTP]]:
    sessions = []

    def make(upstream_extra: str = LOOPBACK) -> UpstreamHTTP:
        settings = config(upstream_extra).upstream
        egress = EgressPolicy.from_config(settings, [])
        session = make_session(settings, egress)
        sessions.append(session)
        return UpstreamHTTP(session, settings, Metrics(), egress, Activity())

    yield make
    for session in sessions:
        await close_session(session)


async def test_a_warmed_connection_carries_the_next_request_to_its_origin(
        upstream: TestServer, upstream_http: Callable[..., UpstreamHTTP]) -> None:
    http = upstream_http()
    assert await http.warm_connection(origin(upstream))
    await settled(upstream, 1)
    assert await http.get_bytes(f"{origin(upstream)}/files/x.zip", "upstream") == b"ok"
    assert open_connections(upstream) == 1  # the warmed one: no second was made


async def test_nothing_is_warmed_offline_through_a_proxy_or_beside_a_connection_just_used(
        upstream: TestServer, upstream_http: Callable[..., UpstreamHTTP],
        monkeypatch: pytest.MonkeyPatch) -> None:
    offline = upstream_http(f'mode = "offline"\n{LOOPBACK}')
    assert not await offline.warm_connection(origin(upstream))
    used = upstream_http()
    assert await used.get_bytes(f"{origin(upstream)}/v1/x", "upstream") == b"ok"
    assert not await used.warm_connection(origin(upstream))
    await settled(upstream, 1)  # the request's own
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    assert not await upstream_http().warm_connection(origin(upstream))
    await asyncio.sleep(0.1)
    assert open_connections(upstream) == 1


async def test_the_egress_policy_refuses_a_warming_as_it_refuses_a_request(
        upstream: TestServer, upstream_http: Callable[..., UpstreamHTTP]) -> None:
    with pytest.raises(UpstreamError):  # loopback is not a public address
        await upstream_http("").warm_connection(origin(upstream))
    await asyncio.sleep(0.1)
    assert open_connections(upstream) == 0


def test_an_origin_is_scheme_host_and_port_of_an_https_url_and_nothing_else() -> None:
    assert origin_of("https://Releases.Example:443/a/b.zip?token=x") == "https://releases.example"
    assert origin_of("https://example.org:8443/x") == "https://example.org:8443"
    assert origin_of("https://[::1]:8443/x") == "https://[::1]:8443"
    for refused in ("http://example.org/x", "https://user:pw@example.org/x", "https:///x",
                    "https://[::1/x", "example.org", "https://a\ud800b.example/x.zip",
                    "https://bücher.example/x.zip"):
        assert origin_of(refused) is None, refused


async def test_workers_tell_each_other_and_each_warms_an_origin_once_in_a_while(
        upstream: TestServer, upstream_http: Callable[..., UpstreamHTTP]) -> None:
    channels = siblings.make(2)
    metrics = [Metrics(), Metrics()]
    first = ConnectionWarmer(upstream_http(), siblings.Siblings(
        channels.inboxes[0], (channels.outboxes[1],)), metrics[0].connections_warmed)
    second = ConnectionWarmer(upstream_http(), siblings.Siblings(
        channels.inboxes[1], (channels.outboxes[0],)), metrics[1].connections_warmed)
    first.listen()
    second.listen()
    try:
        first.expect(origin(upstream))
        await settled(upstream, 2)  # one here, one in the sibling
        first.expect(origin(upstream))  # within WARM_EVERY: neither warms again
        await asyncio.sleep(0.2)
        assert open_connections(upstream) == 2
        for each in metrics:
            assert sample(exposition(each), "tfproxy_upstream_connections_warmed_total",
                          outcome="opened") == 1
        # What a sibling says is input: only a bare https origin is warmed.
        talker = siblings.Siblings(None, (channels.outboxes[1],))
        for said in (f"https://u:p@127.0.0.1:{upstream.port}", f"http://127.0.0.1:{upstream.port}",
                     f"{origin(upstream)}/path", "x" * 600):
            talker.tell(CONNECT, said)
        talker.tell("unknown", origin(upstream))
        await asyncio.sleep(0.2)
        assert sample(exposition(metrics[1]), "tfproxy_upstream_connections_warmed_total",
                      outcome="opened") == 1
        assert sample(exposition(metrics[1]), "tfproxy_upstream_connections_warmed_total",
                      outcome="failed") == 0
    finally:
        await first.close()
        await second.close()


async def test_a_hint_that_cannot_be_sent_fails_nothing(
        upstream_http: Callable[..., UpstreamHTTP]) -> None:
    """A download document is upstream's input: whatever its URL holds, the request that
    fetched it goes on (a lone surrogate once raised out of the hint's encoding)."""
    channels = siblings.make(2)
    warmer = ConnectionWarmer(upstream_http(), siblings.Siblings(
        channels.inboxes[0], (channels.outboxes[1],)), Metrics().connections_warmed)
    try:
        warmer.expect("https://a\ud800b.example")
        siblings.Siblings(None, (channels.outboxes[1],)).tell(CONNECT, "https://a\ud800b.x")
        channels.inboxes[1].setblocking(False)
        with pytest.raises(BlockingIOError):
            channels.inboxes[1].recv(600)  # nothing was sent
    finally:
        await warmer.close()
        channels.inboxes[1].close()
