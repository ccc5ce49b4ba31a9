"""Shared fixtures: signing keys, the fake upstream registry, proxy configurations."""

from __future__ import annotations

import io
import tarfile
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from proxy.app import create_app
from proxy.config import Config, load_config
from proxy.web.http_server import ProxyRunner
from proxy.web.routes import METRICS_KEY
from tests.support.fake_registry import FakeRegistry, build_zip
from tests.support.git_repos import publish_repo
from tests.support.gpg import GpgKey, generate_key, stop_agent
from tests.support.seaweedfs import S3Server, WeedMini


@pytest.fixture(scope="session")
def upstream_ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="session")
def upstream_ca_file(upstream_ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("upstream-ca") / "ca.pem"
    upstream_ca.cert_pem.write_to_path(str(path))
    return path


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """A real S3 server (SeaweedFS), one per session; tests take a fresh bucket of it. Fails,
    never skips, when weed is not installed."""
    weed = WeedMini()
    try:
        yield weed.start()
    finally:
        weed.stop()


@pytest.fixture(scope="session")
def signer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpgKey]:
    key = generate_key(tmp_path_factory.mktemp("gpg") / "signer", "Release Signer")
    yield key
    stop_agent(key)


@pytest.fixture(scope="session")
def impostor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpgKey]:
    key = generate_key(tmp_path_factory.mktemp("gpg") / "impostor", "Impostor")
    yield key
    stop_agent(key)


@pytest.fixture(scope="session")
def registry_server(upstream_ca: trustme.CA, signer: GpgKey, impostor: GpgKey,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeRegistry]:
    server = FakeRegistry(upstream_ca, signer, impostor)
    server.add_release("hashicorp", "null", "3.2.1")
    server.add_release("hashicorp", "null", "3.1.0")
    server.add_release("hashicorp", "random", "3.6.0")
    for product, version in (("terraform", "1.11.4"), ("terraform", "1.10.5"),
                             ("opentofu", "1.9.0"), ("opentofu", "1.8.8")):
        server.cli.add(product, version)
    server.start()
    publish_modules(server, tmp_path_factory.mktemp("module-sources"))
    yield server
    server.stop()


def tar_gz(members: dict[str, bytes | tuple[str, str]]) -> bytes:
    """A tar.gz; a (kind, target) tuple makes a "symlink" or "hardlink" member."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            if isinstance(content, tuple):
                kind, target = content
                info.type = tarfile.SYMTYPE if kind == "symlink" else tarfile.LNKTYPE
                info.linkname = target
                tar.addfile(info)
            else:
                info.size = len(content)
                info.mode = 0o644
                tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


MODULE_MAIN = (b'variable "name" {\n  default = "net"\n}\n'
               b'output "name" {\n  value = var.name\n}\n')


def publish_modules(server: FakeRegistry, work: Path) -> None:
    """Module sources of every shape a registry hands out."""
    shared = publish_repo(server.git_root, "shared", work / "shared",
                          {"main.tf": b'output "shared" {\n  value = "yes"\n}\n'})
    publish_repo(server.git_root, "net", work / "net",
                 {"main.tf": MODULE_MAIN, "modules/sub/main.tf": b"# sub\n",
                  "scripts/run.sh": b"#!/bin/sh\necho hi\n"},
                 tag="v1.2.0",
                 submodules={"shared": (f"{server.url}/git/shared.git", shared)})
    server.add_module("acme", "net", "aws", "1.2.0",
                      f"git::{server.url}/git/net.git?ref=v1.2.0")
    server.add_module("acme", "net", "aws", "1.1.0",
                      f"git::{server.url}/git/net.git?ref=no-such-tag")
    # Every hop git takes must pass the egress policy: a redirect to loopback, a submodule
    # on loopback, a relative submodule (resolved against the superproject, so allowed),
    # and a source on a public-looking name that tests route to this server.
    server.add_module("acme", "moved", "aws", "1.2.0",
                      f"git::{server.url}/to-localhost/git/net.git?ref=v1.2.0")
    publish_repo(server.git_root, "sneaky", work / "sneaky", {"main.tf": MODULE_MAIN},
                 tag="v1.0.0", submodules={
                     "shared": (f"https://localhost:{server.port}/git/shared.git", shared)})
    server.add_module("acme", "sneaky", "aws", "1.0.0",
                      f"git::{server.url}/git/sneaky.git?ref=v1.0.0")
    publish_repo(server.git_root, "relative", work / "relative", {"main.tf": MODULE_MAIN},
                 tag="v1.0.0", submodules={"shared": ("../shared.git", shared)})
    server.add_module("acme", "relative", "aws", "1.0.0",
                      f"git::{server.url}/git/relative.git?ref=v1.0.0")
    server.add_module("acme", "public", "aws", "1.2.0",
                      f"git::https://git.example.com:{server.port}/git/net.git?ref=v1.2.0")

    tarball = server.add_module_archive("tarball-1.0.0.tgz", tar_gz({
        "acme-tarball-abc123/README.md": b"top\n",
        "acme-tarball-abc123/modules/inner/main.tf": MODULE_MAIN,
    }))
    server.add_module("acme", "tarball", "aws", "1.0.0",
                      f"{tarball}//*/modules/inner?archive=tar.gz", style="json")
    server.add_module("acme", "movedtarball", "aws", "1.0.0",
                      f"{server.url}/to-localhost/archives/tarball-1.0.0.tgz"
                      "//*/modules/inner?archive=tar.gz")
    zipped = build_zip({"main.tf": (MODULE_MAIN, 0o644), "files/": (b"", 0o755)})
    server.add_module_archive("zip-2.0.0.zip", zipped)
    server.add_module("Acme-Corp", "Zip_Mod", "aws", "2.0.0",
                      "../../../../../../archives/zip-2.0.0.zip")
    server.add_module("acme", "s3", "aws", "1.0.0", "s3::https://s3.amazonaws.com/b/m.zip")
    server.add_module("acme", "registry", "aws", "1.0.0", "other/module/aws")
    for name, members in {
        "traversal": {"../../evil.tf": b"x"},
        "absolute": {"/etc/evil.tf": b"x"},
        "symlink": {"main.tf": b"x", "link": ("symlink", "../../../etc/passwd")},
        "hardlink": {"main.tf": b"x", "link": ("hardlink", "../outside")},
    }.items():
        url = server.add_module_archive(f"{name}.tar.gz", tar_gz(members))
        server.add_module("evil", name, "aws", "1.0.0", url)


@pytest.fixture
def release_keys(tmp_path: Path, signer: GpgKey) -> Path:
    """The fake releases' signing key, as a proxy's [releases] key file."""
    path = tmp_path / "release-keys.asc"
    path.write_text(signer.armored_public_key)
    return path


@pytest.fixture
def registry(registry_server: FakeRegistry) -> Iterator[FakeRegistry]:
    """The shared fake upstream with a clean request log and no faults."""
    registry_server.reset()
    yield registry_server
    registry_server.reset()


ConfigFactory = Callable[..., Config]


def config_writer(directory: Path, registry: FakeRegistry,
                  upstream_ca_file: Path) -> Callable[..., Path]:
    """A function writing directory/proxy.toml: a proxy config whose registry.terraform.io
    is the fake upstream (extra lines, cache directory, port, [upstream] lines)."""

    def write(extra: str = "", cache_dir: Path | None = None, port: int = 0,
              upstream_extra: str = "") -> Path:
        path = directory / "proxy.toml"
        path.write_text(
            f"""
[server]
listen = "127.0.0.1:{port or 8443}"
state_dir = "{directory / 'state'}"

[cache]
dir = "{cache_dir or directory / 'cache'}"

[upstream]
ca_bundle = "{upstream_ca_file}"
{upstream_extra}

[upstream.hosts."registry.terraform.io".services]
"providers.v1" = "{registry.providers_url}"
"modules.v1" = "{registry.url}/v1/modules/"
{extra}
""")
        return path

    return write


@pytest.fixture
def write_config(tmp_path: Path, registry: FakeRegistry,
                 upstream_ca_file: Path) -> Callable[..., Path]:
    """Write a proxy config whose registry.terraform.io is the fake upstream."""
    return config_writer(tmp_path, registry, upstream_ca_file)


@pytest.fixture
def proxy_config(write_config: Callable[..., Path]) -> Config:
    return load_config(write_config(), environ={})


AppClient = Callable[..., Awaitable[TestClient]]  # type: ignore[type-arg]


class _ServedAsServeServes(TestServer):  # type: ignore[misc]
    """aiohttp's test server with the runner `serve` uses (ProxyRunner: kept answers before
    routing, parser errors in JSON), so in-process tests meet what clients meet."""

    async def _make_runner(self, **kwargs: Any) -> web.BaseRunner:
        return ProxyRunner(self.app, **kwargs)


@pytest.fixture
def aiohttp_client(aiohttp_client):  # type: ignore[no-untyped-def]
    """pytest-aiohttp's client factory; the proxy's own app served as `serve` serves it."""

    def make(app: object, *, server_kwargs: dict[str, Any] | None = None,
             **kwargs: Any) -> Awaitable[TestClient]:  # type: ignore[type-arg]
        if isinstance(app, web.Application) and METRICS_KEY in app:
            return aiohttp_client(_ServedAsServeServes(app, **(server_kwargs or {})),  # type: ignore[no-any-return]
                                  **kwargs)
        return aiohttp_client(app, server_kwargs=server_kwargs, **kwargs)  # type: ignore[no-any-return]

    return make


@pytest.fixture
def make(aiohttp_client, write_config: Callable[..., Path]) -> AppClient:  # type: ignore[no-untyped-def]
    """A test client for the app built from the fake-upstream config, with extra config
    lines and TF_REGISTRY_PROXY_* overrides given as keyword arguments (table_key=value)."""

    async def build(extra: str = "", upstream_extra: str = "", **env: str) -> TestClient:  # type: ignore[type-arg]
        environ = {f"TF_REGISTRY_PROXY_{k.upper()}": v for k, v in env.items()}
        config = load_config(write_config(extra=extra, upstream_extra=upstream_extra),
                             environ=environ)
        return await aiohttp_client(create_app(config))  # type: ignore[no-any-return]

    return build


@pytest.fixture
async def client(aiohttp_client, proxy_config: Config) -> TestClient:  # type: ignore[no-untyped-def, type-arg]
    """A test client for the app with the default fake-upstream config."""
    return await aiohttp_client(create_app(proxy_config))  # type: ignore[no-any-return]
