"""The egress policy holds on every path: HTTPS hops, git's own connections (redirects,
submodules) and targets named through an outbound HTTPS_PROXY."""

from __future__ import annotations

import asyncio
import base64
import io
import ipaddress
import logging
import tarfile
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from aiohttp.test_utils import TestClient
from yarl import URL

from proxy.config import ConfigError, load_config
from proxy.core.errors import UpstreamError
from proxy.upstream.egress import EgressPolicy, GuardedResolver, outbound_proxy
from proxy.upstream.egress_gate import EgressGate
from tests.support.connect_proxy import ConnectProxy, use_https_proxy
from tests.support.fake_dns import fake_dns
from tests.support.fake_registry import EXTRA_NAMES, FakeRegistry

Make = Callable[..., Awaitable[TestClient]]
MODULES = "/modules/registry.terraform.io/acme"
PROVIDER = "/mirror/registry.terraform.io/hashicorp/null"
ZIP = "terraform-provider-null_3.2.1_linux_amd64.zip"
LOOPBACK = 'allowed_networks = ["127.0.0.0/8", "::1/128"]'


async def module_archive(client: TestClient, module: str) -> tuple[int, str, bytes]:
    """Ask for a module's download and then its archive: (status, error, archive bytes)."""
    response = await client.get(f"{MODULES}/{module}/download")
    if response.status != 200:
        return response.status, (await response.json())["errors"][0], b""
    location = (await response.json())["location"]
    archive = await client.get(urlsplit(location).path)
    if archive.status != 200:  # the download is answered from the version list alone
        return archive.status, (await archive.json())["errors"][0], b""
    return archive.status, "", await archive.read()


def members(data: bytes) -> set[str]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return set(tar.getnames())


@pytest.fixture
async def tunnel(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[ConnectProxy]:
    """A real CONNECT proxy as HTTPS_PROXY, whose own DNS sends the test's names to the fake
    upstream; this machine's DNS (the policy's lookups) knows only what a test tells it."""
    proxy = await ConnectProxy(routes={name: "127.0.0.1" for name in EXTRA_NAMES}).start()
    use_https_proxy(monkeypatch, proxy)
    fake_dns(monkeypatch)
    try:
        yield proxy
    finally:
        await proxy.stop()


def connects_to(tunnel: ConnectProxy, host: str) -> bool:
    return any(target.rpartition(":")[0].strip("[]") == host for target in tunnel.targets)


# --- git: every hop ----------------------------------------------------------------------

async def test_git_redirect_to_a_private_host_is_refused(
        make: Make, registry: FakeRegistry) -> None:
    client = await make()
    status, error, _ = await module_archive(client, "moved/aws/1.2.0")
    assert status == 502
    assert "refusing to connect to localhost" in error
    assert registry.paths() == ["/v1/modules/acme/moved/aws/versions",
                                "/v1/modules/acme/moved/aws/1.2.0/download",
                                "/to-localhost/git/net.git/info/refs"]  # nothing after it

    # The same redirect, followed when the operator opened loopback: the refusal above was
    # the policy, not a broken redirect.
    client = await make(upstream_extra=LOOPBACK)
    status, error, data = await module_archive(client, "moved/aws/1.2.0")
    assert (status, error) == (200, "")
    assert {"main.tf", "shared/main.tf"} <= members(data)
    assert "/git/net.git/info/refs" in registry.paths()


async def test_git_submodule_on_a_private_host_is_refused(
        make: Make, registry: FakeRegistry) -> None:
    client = await make()
    status, error, _ = await module_archive(client, "sneaky/aws/1.0.0")
    assert status == 502
    assert "refusing to connect to localhost" in error
    assert "/git/sneaky.git/info/refs" in registry.paths()
    assert not any(p.startswith("/git/shared.git/") for p in registry.paths())


async def test_relative_submodule_resolves_against_the_superproject(
        make: Make, registry: FakeRegistry) -> None:
    client = await make()
    status, error, data = await module_archive(client, "relative/aws/1.0.0")
    assert (status, error) == (200, "")
    assert "shared/main.tf" in members(data)
    assert any(p.startswith("/git/shared.git/") for p in registry.paths())


async def test_operator_git_config_cannot_rewrite_module_hosts(
        make: Make, registry: FakeRegistry, monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    # Were any of these read, every clone would go to localhost, which the gate refuses.
    rewrite = f'[url "https://localhost:{registry.port}/"]\n\tinsteadOf = {registry.url}/\n'
    for directory in (tmp_path / "home", tmp_path / "xdg" / "git"):
        directory.mkdir(parents=True)
    (tmp_path / "home" / ".gitconfig").write_text(rewrite)
    (tmp_path / "xdg" / "git" / "config").write_text(rewrite)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(tmp_path / "home" / ".gitconfig"))
    monkeypatch.setenv("GIT_CONFIG_PARAMETERS",
                       f"'url.https://localhost:{registry.port}/.insteadof'='{registry.url}/'")
    client = await make()
    status, error, data = await module_archive(client, "net/aws/1.2.0")
    assert (status, error) == (200, "")
    assert "shared/main.tf" in members(data)


async def test_module_tarball_redirect_to_a_private_host_is_refused(
        make: Make, registry: FakeRegistry) -> None:
    client = await make()
    status, error, _ = await module_archive(client, "movedtarball/aws/1.0.0")
    assert status == 502
    assert "refusing to connect to localhost" in error
    assert not any(p.startswith("/archives/") for p in registry.paths())

    client = await make(upstream_extra=LOOPBACK)
    status, error, data = await module_archive(client, "movedtarball/aws/1.0.0")
    assert (status, error) == (200, "")
    assert members(data) == {"main.tf"}
    assert "/archives/tarball-1.0.0.tgz" in registry.paths()


# --- through an outbound HTTPS_PROXY ---------------------------------------------------

@pytest.mark.parametrize(("host", "dns", "extra"), [
    ("localhost", {}, ""),
    ("0x7f.1", {}, ""),  # 127.0.0.1 in disguise: the outbound proxy would accept it
    ("169.254.169.254", {}, ""),
    ("files.corp.example", {}, 'internal_zones = ["corp.example"]'),
    ("sneaky.example.com", {"sneaky.example.com": ["10.1.2.3"]}, ""),
])
async def test_targets_named_through_https_proxy_are_checked_before_the_tunnel(
        make: Make, registry: FakeRegistry, tunnel: ConnectProxy,
        monkeypatch: pytest.MonkeyPatch, host: str, dns: dict[str, list[str]],
        extra: str) -> None:
    fake_dns(monkeypatch, dns)
    # The fill asks for a fresh download document (not the one VERSION.json just fetched,
    # which names the allowed host): the one that now names the refused host.
    monkeypatch.setattr("proxy.verification.packages.RECENT_DOWNLOAD_SECONDS", -1.0)
    client = await make(upstream_extra=extra)
    assert (await client.get(f"{PROVIDER}/3.2.1.json")).status == 200
    registry.download_host = host
    response = await client.get(f"{PROVIDER}/{ZIP}")
    assert response.status == 502
    assert f"refusing to connect to {host}" in (await response.json())["errors"][0]
    assert tunnel.targets  # the registry itself was reached through the tunnel
    assert not connects_to(tunnel, host)
    assert registry.archive_requests() == []


@pytest.mark.parametrize(("host", "dns", "extra"), [
    ("releases.example.com", {}, ""),  # unknown here: the outbound proxy resolves it
    ("files.corp.example", {"files.corp.example": ["10.9.9.9"]},
     'internal_zones = ["corp.example"]\nallowed_networks = ["10.0.0.0/8"]'),
])
async def test_allowed_targets_go_through_https_proxy(
        make: Make, registry: FakeRegistry, tunnel: ConnectProxy,
        monkeypatch: pytest.MonkeyPatch, host: str, dns: dict[str, list[str]],
        extra: str) -> None:
    fake_dns(monkeypatch, dns)
    client = await make(upstream_extra=extra)
    registry.download_host = host
    response = await client.get(f"{PROVIDER}/{ZIP}")
    assert response.status == 200, await response.text()
    assert await response.read() == registry.releases[
        ("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    assert f"{host}:{registry.port}" in tunnel.targets


async def test_git_goes_through_https_proxy_and_its_redirects_are_checked(
        make: Make, registry: FakeRegistry, tunnel: ConnectProxy) -> None:
    client = await make()
    status, error, data = await module_archive(client, "public/aws/1.2.0")
    assert (status, error) == (200, "")
    assert {"main.tf", "shared/main.tf"} <= members(data)
    assert f"git.example.com:{registry.port}" in tunnel.targets  # the source
    assert f"127.0.0.1:{registry.port}" in tunnel.targets  # its submodule

    tunnel.targets.clear()
    registry.requests.clear()
    status, error, _ = await module_archive(client, "moved/aws/1.2.0")
    assert status == 502
    assert "refusing to connect to localhost" in error
    assert not connects_to(tunnel, "localhost")
    assert not any(p.startswith("/git/") for p in registry.paths())


# --- the rule itself ---------------------------------------------------------------------

PROXIED_REFUSED = ["localhost", "LOCALHOST.", "a.localhost", "printer.local", "db.internal",
                   "nas.home.arpa", "box.localdomain", "git.corp.example", "127.1", "0x7f.1",
                   "2130706433", "[::1]", "[::ffff:127.0.0.1]", "169.254.169.254",
                   "10.0.0.1", "rebind.example.com", "mixed.example.com",
                   # Names only a search domain completes, and never-public TLDs:
                   "metadata", "METADATA.", "kubernetes.default.svc", "git.corp", "nas.lan"]
DNS = {"rebind.example.com": ["10.0.0.1"], "mixed.example.com": ["93.184.215.14", "10.0.0.1"],
       "public.example.com": ["93.184.215.14"], "git.corp.example": ["10.2.3.4"],
       "instance-data": ["169.254.169.254"]}


def policy(networks: tuple[str, ...] = ()) -> EgressPolicy:
    return EgressPolicy(["registry.terraform.io"], [ipaddress.ip_network(n) for n in networks],
                        internal_zones=["corp.example"], proxy_hosts=["squid.corp.example"])


@pytest.mark.parametrize("host", PROXIED_REFUSED)
async def test_rule_refuses_through_a_proxy(monkeypatch: pytest.MonkeyPatch,
                                            host: str) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://squid.corp.example:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    fake_dns(monkeypatch, DNS)
    with pytest.raises(UpstreamError, match="refusing to connect to"):
        await policy().check_target(f"https://{host}/x")


@pytest.mark.parametrize(("host", "networks"), [
    ("registry.terraform.io", ()),  # configured: trusted as it is
    ("releases.example.com", ()),  # does not resolve here: the outbound proxy resolves it
    ("public.example.com", ()),
    ("93.184.215.14", ()),
    ("git.corp.example", ("10.0.0.0/8",)),  # an internal zone, opened by allowed_networks
    ("10.0.0.1", ("10.0.0.0/8",)),
    ("instance-data", ("169.254.169.254/32",)),  # one label, opened by allowed_networks
    ("under_score.example.com", ()),  # not a host name by the letter, but a DNS name
    ("b\u00fccher.example", ()),  # IDNA
])
async def test_rule_allows_through_a_proxy(monkeypatch: pytest.MonkeyPatch, host: str,
                                           networks: tuple[str, ...]) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://squid.corp.example:3128")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    fake_dns(monkeypatch, DNS)
    await policy(networks).check_target(f"https://{host}/x")


def test_the_outbound_proxy_is_chosen_once_per_host_and_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """urllib reads the whole environment to choose (about 70 us, twice per upstream
    request): the choice is kept per host, and made again when the settings change."""
    read = []
    getproxies = urllib.request.getproxies

    def counted() -> dict[str, str]:
        read.append(1)
        return getproxies()

    monkeypatch.setattr(urllib.request, "getproxies", counted)
    for name in ("https_proxy", "no_proxy", "NO_PROXY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTPS_PROXY", "http://user:secret@squid.corp.example:3128")
    url = f"https://{uuid.uuid4().hex}.example.com/v1/providers/x"  # met by no other test
    chosen = [outbound_proxy(url) for _ in range(3)]
    assert len(read) == 1
    assert chosen[0] is not None and chosen[0][0] == URL("http://squid.corp.example:3128")
    credentials = chosen[0][1]
    assert credentials is not None and (credentials.login, credentials.password) == \
        ("user", "secret")
    assert chosen == [chosen[0]] * 3
    monkeypatch.setenv("HTTPS_PROXY", "http://other.corp.example:8080")
    moved = outbound_proxy(url)
    assert moved is not None and moved[0] == URL("http://other.corp.example:8080")
    monkeypatch.setenv("NO_PROXY", ".example.com")
    assert outbound_proxy(url) is None
    assert len(read) == 2  # NO_PROXY decided it before the proxies were read


async def test_rule_without_a_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    fake_dns(monkeypatch, DNS)
    rule = policy()
    # Names in internal zones and address literals are refused before any connection...
    for host in ("localhost", "git.corp.example", "127.1", "[::1]", "metadata"):
        with pytest.raises(UpstreamError, match="refusing to connect to"):
            await rule.check_target(f"https://{host}/")
    # ... as is the outbound proxy's own name when named as a target ...
    with pytest.raises(UpstreamError, match=r"refusing to connect to squid\.corp\.example"):
        await rule.check_target("https://squid.corp.example:3128/")
    # ... other names are left to the resolver, which connects only to allowed addresses.
    await rule.check_target("https://rebind.example.com/")
    assert await rule.connectable("mixed.example.com", 443) == [
        ipaddress.ip_address("93.184.215.14")]
    with pytest.raises(UpstreamError, match=r"refusing to connect to rebind\.example\.com"):
        await rule.connectable("rebind.example.com", 443)


def test_internal_zones_are_normalized_and_invalid_ones_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[upstream]\ninternal_zones = ["corp.example.com", ".Lab.Example"]\n')
    assert load_config(path, environ={}).upstream.internal_zones == (
        "corp.example.com", "lab.example")
    path.write_text('[upstream]\ninternal_zones = ["corp example", "x.example:8443"]\n')
    with pytest.raises(ConfigError) as caught:
        load_config(path, environ={})
    assert len(caught.value.problems) == 2
    assert all(p.startswith("upstream.internal_zones") for p in caught.value.problems)


# --- the gate git goes through -------------------------------------------------------------

async def connect(port: int, target: str, credentials: str | None,
                  encoding: str = "utf-8") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    lines = [f"CONNECT {target} HTTP/1.1", f"Host: {target}"]
    if credentials is not None:
        lines.append("Proxy-Authorization: Basic "
                     + base64.b64encode(credentials.encode()).decode())
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode(encoding))
    status = await reader.readline()
    writer.close()
    return status


async def test_gate_serves_only_its_clones_and_only_allowed_targets(
        monkeypatch: pytest.MonkeyPatch, registry: FakeRegistry) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    fake_dns(monkeypatch)
    gate = EgressGate(EgressPolicy([f"127.0.0.1:{registry.port}"], []), connect_timeout=5)
    try:
        async with gate.session() as session:
            user_token = session.proxy_url.removeprefix("http://").rpartition("@")[0]
            port = int(session.proxy_url.rpartition(":")[2])
            target = f"127.0.0.1:{registry.port}"
            assert (await connect(port, target, None)).startswith(b"HTTP/1.1 407")
            assert (await connect(port, target, user_token + "x")).startswith(b"HTTP/1.1 407")
            assert (await connect(port, target, user_token)).startswith(b"HTTP/1.1 200")
            denied = await connect(port, f"localhost:{registry.port}", user_token)
            assert denied.startswith(b"HTTP/1.1 403")
            assert session.refusals and "refusing to connect to localhost" in session.refusals[0]
        # Credentials end with the clone.
        assert (await connect(port, target, user_token)).startswith(b"HTTP/1.1 407")
    finally:
        await gate.close()


# --- host names upstream answers give must be DNS names -------------------------------------

LONG_LABEL = "a" * 64 + ".example.com"
INVALID_NAMES = [LONG_LABEL, "a..example.com", ".".join(["b" * 60] * 5), "sp ace.example.com",
                 "per%41cent.example.com"]


def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(name, raising=False)


def failures_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Tracebacks and errors logged: a refusal is a warning, a crash is not."""
    return [r.getMessage()[:200] for r in caplog.records
            if r.exc_info or r.levelno >= logging.ERROR]


@pytest.mark.parametrize("host", [LONG_LABEL, "a..example.com"])
@pytest.mark.parametrize("through_proxy", [False, True])
async def test_an_invalid_host_name_from_upstream_is_a_clear_502(
        make: Make, registry: FakeRegistry, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, host: str, through_proxy: bool) -> None:
    tunnel = await ConnectProxy().start()
    if through_proxy:
        use_https_proxy(monkeypatch, tunnel)
    else:
        no_proxy_env(monkeypatch)
    fake_dns(monkeypatch)
    name = f"badhost{len(host)}{'p' if through_proxy else ''}"
    registry.add_module("acme", f"{name}http", "aws", "1.0.0", f"https://{host}/m.tar.gz")
    registry.add_module("acme", f"{name}git", "aws", "1.0.0", f"git::https://{host}/m.git?ref=v1")
    try:
        client = await make()
        for module in (f"{name}http", f"{name}git"):
            status, error, _ = await module_archive(client, f"{module}/aws/1.0.0")
            assert status == 502, module
            assert f"refusing to connect to '{host}': it is not a valid host name" in error
        registry.download_host = host  # a provider package's download URL
        response = await client.get(f"{PROVIDER}/{ZIP}")
        assert response.status == 502
        assert "it is not a valid host name" in (await response.json())["errors"][0]
        assert not connects_to(tunnel, host)
        assert failures_logged(caplog) == []
    finally:
        await tunnel.stop()


@pytest.mark.parametrize("host", INVALID_NAMES)
@pytest.mark.parametrize("through_proxy", [False, True])
async def test_rule_refuses_invalid_host_names_before_resolving_them(
        monkeypatch: pytest.MonkeyPatch, host: str, through_proxy: bool) -> None:
    no_proxy_env(monkeypatch)
    if through_proxy:
        monkeypatch.setenv("HTTPS_PROXY", "http://squid.corp.example:3128")
    fake_dns(monkeypatch, {host: ["93.184.215.14"]})  # were it looked up, it would pass
    rule = policy()
    with pytest.raises(UpstreamError, match="it is not a valid host name"):
        await rule.check_target(f"https://{host}/x")
    with pytest.raises(UpstreamError, match="it is not a valid host name"):
        await rule.connectable(host, 443)
    with pytest.raises(OSError, match="it is not a valid host name"):
        await GuardedResolver(rule).resolve(host, 443)


async def test_gate_refuses_a_connect_to_an_invalid_name(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    no_proxy_env(monkeypatch)
    fake_dns(monkeypatch)
    gate = EgressGate(EgressPolicy(["registry.terraform.io"], []), connect_timeout=5)
    try:
        async with gate.session() as session:
            user_token = session.proxy_url.removeprefix("http://").rpartition("@")[0]
            port = int(session.proxy_url.rpartition(":")[2])
            for host in (LONG_LABEL, "b\u00fc" + "x" * 70 + ".example"):
                status = await connect(port, f"{host}:443", user_token)
                assert status.startswith(b"HTTP/1.1 403"), host
            # A request head is read as latin-1, where byte 0xb9 is "¹": a digit to
            # str.isdigit, not to int().
            status = await connect(port, "registry.terraform.io:\u00b9", user_token, "latin-1")
            assert status.startswith(b"HTTP/1.1 400")
            assert len(session.refusals) == 2
            assert "it is not a valid host name" in session.refusals[0]
            assert session.refusals[1].startswith("refusing the invalid URL")
        assert failures_logged(caplog) == []
    finally:
        await gate.close()


# --- trusted hosts are trusted on their own port -------------------------------------------

async def test_trusted_hosts_are_trusted_on_their_configured_port_only(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    no_proxy_env(monkeypatch)
    fake_dns(monkeypatch, {"registry.example.net": ["10.1.2.3"],
                           "mirror.example.net": ["10.1.2.4"],
                           "files.example.net": ["10.1.2.5"],
                           "other.example.net": ["10.1.2.6"]})
    path = tmp_path / "c.toml"
    path.write_text('[upstream]\nallowed_hosts = ["registry.example.net:8443"]\n'
                    '[upstream.hosts."mirror.example.net:7443".services]\n'
                    '"providers.v1" = "https://files.example.net:9443/v1/providers/"\n'
                    '[upstream.hosts."other.example.net".services]\n'
                    '"modules.v1" = "https://files.example.net/v1/modules/"\n')
    rule = EgressPolicy.from_config(load_config(path, environ={}).upstream)
    trusted = [("registry.example.net", 8443, "10.1.2.3"),
               ("mirror.example.net", 7443, "10.1.2.4"),
               ("files.example.net", 9443, "10.1.2.5"), ("files.example.net", 443, "10.1.2.5"),
               ("other.example.net", 443, "10.1.2.6")]
    for host, port, address in trusted:
        await rule.check_target(f"https://{host}:{port}/x")
        assert await rule.connectable(host, port) == [ipaddress.ip_address(address)]
    other_ports = [("registry.example.net", 22), ("registry.example.net", 443),
                   ("mirror.example.net", 443), ("files.example.net", 6379),
                   ("other.example.net", 8443)]
    for host, port in other_ports:
        with pytest.raises(UpstreamError, match=f"refusing to connect to {host}"):
            await rule.connectable(host, port)
    # Through an outbound proxy the target is judged before the tunnel, the same way.
    monkeypatch.setenv("HTTPS_PROXY", "http://squid.example.net:3128")
    for host, port, _address in trusted:
        await rule.check_target(f"https://{host}:{port}/x")
    for host, port in other_ports:
        with pytest.raises(UpstreamError, match=f"refusing to connect to {host}"):
            await rule.check_target(f"https://{host}:{port}/x")
    # Other ports are any other target: allowed_networks opens them.
    path.write_text(path.read_text().replace(
        "[upstream]\n", '[upstream]\nallowed_networks = ["10.0.0.0/8"]\n'))
    opened = EgressPolicy.from_config(load_config(path, environ={}).upstream)
    await opened.check_target("https://registry.example.net:22/x")
    assert await opened.connectable("registry.example.net", 22) == [
        ipaddress.ip_address("10.1.2.3")]


async def test_resolver_trusts_a_host_on_its_configured_port_only() -> None:
    resolver = GuardedResolver(EgressPolicy(["localhost:8443"], []))
    assert await resolver.resolve("localhost", 8443)
    with pytest.raises(OSError, match="refusing to connect to localhost"):
        await resolver.resolve("localhost", 6379)


@pytest.fixture
async def listener() -> AsyncIterator[tuple[int, list[str]]]:
    """A port on 127.0.0.1 that records each connection made to it."""
    seen: list[str] = []

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append("connected")
        writer.close()

    server = await asyncio.start_server(record, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1], seen
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("location", ["https://127.0.0.1:{port}/m.tar.gz",
                                      "git::https://127.0.0.1:{port}/m.git?ref=v1"])
async def test_another_port_of_the_registry_host_is_refused(
        make: Make, registry: FakeRegistry, monkeypatch: pytest.MonkeyPatch,
        listener: tuple[int, list[str]], location: str) -> None:
    # The registry's configured URL is https://127.0.0.1:<its port>/: trusted there only.
    no_proxy_env(monkeypatch)
    port, seen = listener
    name = "otherport" + ("git" if location.startswith("git::") else "http")
    registry.add_module("acme", name, "aws", "1.0.0", location.format(port=port))
    client = await make()
    status, error, _ = await module_archive(client, f"{name}/aws/1.0.0")
    assert status == 502
    assert "refusing to connect to 127.0.0.1: not a public address" in error
    assert seen == []
