"""Real OCI clients against the proxy as users run it (a process over TLS, auth on): OpenTofu's
exact request sequence, the ORAS Python client, and CNCF Distribution pulling through it as
an organization's registry would."""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import oras.client
import pytest
import trustme

from tests.support.distribution import PullThroughRegistry
from tests.support.fake_registry import FakeRegistry
from tests.support.oci_client import INDEX, MANIFEST, OciCheckFailed, OpenTofuOciClient
from tests.support.proxy_process import ProxyProcess, free_port

TOKEN = "oci-clients-token-0123456789abcdef"
REPOSITORY = "providers/registry.terraform.io/hashicorp/null"
MODULE = "modules/registry.terraform.io/acme/net/aws"
# What OpenTofu asks for, step by step, for one platform of a version.
SEQUENCE = [("GET", f"/v2/{REPOSITORY}/tags/list"), ("HEAD", f"/v2/{REPOSITORY}/manifests/3.2.1"),
            ("GET", "manifest by digest"), ("GET", "manifest by digest"), ("GET", "blob")]


@pytest.fixture
def proxy(tmp_path: Path, write_config: Callable[..., Path]) -> Iterator[ProxyProcess]:
    port, cache = free_port(), tmp_path / "cache"
    config = write_config(extra=f'[auth]\ntokens = [{{ name = "ci", token = "{TOKEN}" }}]\n',
                          cache_dir=cache, port=port)
    with ProxyProcess(config, cache, port, tmp_path / "proxy.log") as process:
        yield process


def _opentofu(proxy: ProxyProcess, password: str = TOKEN) -> OpenTofuOciClient:
    return OpenTofuOciClient(f"https://127.0.0.1:{proxy.port}", proxy.ca_file, "tofu", password)


def _shape(requests: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The request log with digests named by what they fetch."""
    named = []
    for method, path in requests:
        if "/manifests/sha256:" in path:
            path = "manifest by digest"
        elif "/blobs/sha256:" in path:
            path = "blob"
        named.append((method, path))
    return named


def test_opentofus_request_sequence_installs_every_platform_then_without_upstream(
        proxy: ProxyProcess, registry: FakeRegistry) -> None:
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    for platform in release.platforms:
        client = _opentofu(proxy)
        os_name, arch = platform.split("_")
        package, zh = client.install(REPOSITORY, "3.2.1", os_name, arch)
        assert package == release.zips[platform]
        # The zh: a direct install records: the sha256 in the signed SHA256SUMS.
        assert zh == f"zh:{release.sha256(platform)}"
        assert _shape(client.requests) == SEQUENCE
    assert len(registry.archive_requests()) == len(release.platforms)
    registry.faults.add("down")
    package, _ = _opentofu(proxy).install(REPOSITORY, "3.2.1", "darwin", "arm64")
    assert package == release.zips["darwin_arm64"]


def test_opentofu_without_the_token_is_refused(proxy: ProxyProcess,
                                              registry: FakeRegistry) -> None:
    with pytest.raises(OciCheckFailed, match="token endpoint answered 401"):
        _opentofu(proxy, password="not-the-token").tags(REPOSITORY)
    assert not registry.requests


def _module_files(data: bytes) -> set[str]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert archive.testzip() is None
        return set(archive.namelist())


def test_opentofus_oci_module_source_installs_a_module_then_without_upstream(
        proxy: ProxyProcess, registry: FakeRegistry) -> None:
    """`source = "oci://PROXY/modules/registry.terraform.io/acme/net/aws?tag=1.2.0"`."""
    client = _opentofu(proxy)
    package = client.install_module(MODULE, "1.2.0")
    assert {"main.tf", "modules/sub/main.tf", "scripts/run.sh"} <= _module_files(package)
    assert _shape(client.requests) == [("HEAD", f"/v2/{MODULE}/manifests/1.2.0"),
                                       ("GET", "manifest by digest"), ("GET", "blob")]
    registry.faults.add("down")
    assert _opentofu(proxy).install_module(MODULE, "1.2.0") == package


def test_the_oras_client_lists_resolves_and_pulls_through_the_token_flow(
        proxy: ProxyProcess, registry: FakeRegistry, tmp_path: Path) -> None:
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    host = f"127.0.0.1:{proxy.port}"
    client = oras.client.OrasClient(hostname=host, tls_verify=str(proxy.ca_file))
    client.login(username="tofu", password=TOKEN, hostname=host,
                 config_path=str(tmp_path / "docker-config.json"))
    assert client.get_tags(f"{host}/{REPOSITORY}") == ["3.1.0", "3.2.1"]
    index = client.get_manifest(f"{host}/{REPOSITORY}:3.2.1", allowed_media_type=[INDEX])
    assert index["artifactType"] == "application/vnd.opentofu.provider"
    for entry in index["manifests"]:
        platform = f"{entry['platform']['os']}_{entry['platform']['architecture']}"
        target = f"{host}/{REPOSITORY}@{entry['digest']}"
        manifest = client.get_manifest(target, allowed_media_type=[MANIFEST])
        assert manifest["layers"][0]["digest"] == f"sha256:{release.sha256(platform)}"
        (pulled,) = client.pull(target=target, outdir=str(tmp_path / platform))
        assert Path(pulled).read_bytes() == release.zips[platform]
    assert client.get_tags(f"{host}/{MODULE}") == ["1.1.0", "1.2.0"]
    (module,) = client.pull(target=f"{host}/{MODULE}:1.2.0", outdir=str(tmp_path / "module"))
    assert "main.tf" in _module_files(Path(module).read_bytes())


def test_a_distribution_pull_through_cache_serves_providers_from_the_proxy(
        proxy: ProxyProcess, registry: FakeRegistry, upstream_ca: trustme.CA,
        tmp_path: Path) -> None:
    """Distribution (proxy.remoteurl = the proxy, with a token) as the organization's
    registry: OpenTofu's sequence against it gets the proxy's documents and packages, and
    once they are in its cache, it serves them with the proxy gone."""
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    direct = _opentofu(proxy).resolve(REPOSITORY, "3.2.1")
    with PullThroughRegistry(tmp_path / "registry", upstream_ca, proxy.url.rstrip("/"),
                             proxy.ca_file, "tofu", TOKEN) as cache:
        client = OpenTofuOciClient(cache.url, cache.ca_file)
        for platform in ("linux_amd64", "darwin_arm64"):
            package, zh = client.install(REPOSITORY, "3.2.1", *platform.split("_"))
            assert package == release.zips[platform]
            assert zh == f"zh:{release.sha256(platform)}"
        # The same index bytes: the proxy's digests hold through another registry.
        assert client.resolve(REPOSITORY, "3.2.1") == direct
        module = client.install_module(MODULE, "1.2.0")
        assert "main.tf" in _module_files(module)
        proxy.stop()
        cached = OpenTofuOciClient(cache.url, cache.ca_file)
        index = cached.index(REPOSITORY, direct)
        layer = cached.image(REPOSITORY, cached.select(index, "linux", "amd64"))
        assert cached.fetch(REPOSITORY, layer, "blobs") == release.zips["linux_amd64"]
        assert cached.install_module(MODULE, "1.2.0") == module
