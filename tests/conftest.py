"""Shared fixtures: signing keys, the fake upstream registry, proxy configurations."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import trustme

from proxy.config import Config, load_config
from tests.support.fake_registry import FakeRegistry
from tests.support.gpg import GpgKey, generate_key


@pytest.fixture(scope="session")
def upstream_ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture(scope="session")
def upstream_ca_file(upstream_ca: trustme.CA, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("upstream-ca") / "ca.pem"
    upstream_ca.cert_pem.write_to_path(str(path))
    return path


@pytest.fixture(scope="session")
def signer(tmp_path_factory: pytest.TempPathFactory) -> GpgKey:
    return generate_key(tmp_path_factory.mktemp("gpg") / "signer", "Release Signer")


@pytest.fixture(scope="session")
def impostor(tmp_path_factory: pytest.TempPathFactory) -> GpgKey:
    return generate_key(tmp_path_factory.mktemp("gpg") / "impostor", "Impostor")


@pytest.fixture(scope="session")
def registry_server(upstream_ca: trustme.CA, signer: GpgKey,
                    impostor: GpgKey) -> Iterator[FakeRegistry]:
    server = FakeRegistry(upstream_ca, signer, impostor)
    server.add_release("hashicorp", "null", "3.2.1")
    server.add_release("hashicorp", "null", "3.1.0")
    server.add_release("hashicorp", "random", "3.6.0")
    server.start()
    yield server
    server.stop()


@pytest.fixture
def registry(registry_server: FakeRegistry) -> Iterator[FakeRegistry]:
    """The shared fake upstream with a clean request log and no faults."""
    registry_server.reset()
    yield registry_server
    registry_server.reset()


ConfigFactory = Callable[..., Config]


@pytest.fixture
def write_config(tmp_path: Path, registry: FakeRegistry,
                 upstream_ca_file: Path) -> Callable[..., Path]:
    """Write a proxy config whose registry.terraform.io is the fake upstream."""

    def write(extra: str = "", cache_dir: Path | None = None, port: int = 0) -> Path:
        path = tmp_path / "proxy.toml"
        path.write_text(
            f"""
[server]
listen = "127.0.0.1:{port or 8443}"

[cache]
dir = "{cache_dir or tmp_path / 'cache'}"

[upstream]
ca_bundle = "{upstream_ca_file}"

[upstream.hosts."registry.terraform.io"]
services = {{ "providers.v1" = "{registry.providers_url}" }}
{extra}
""")
        return path

    return write


@pytest.fixture
def proxy_config(write_config: Callable[..., Path]) -> Config:
    return load_config(write_config(), environ={})
