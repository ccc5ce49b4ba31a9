"""The module registry protocol through the proxy: sources fetched, repacked and cached."""

from __future__ import annotations

import asyncio
import io
import tarfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import Config, load_config
from proxy.core.errors import UpstreamError
from proxy.upstream import git
from proxy.upstream.egress import EgressPolicy
from proxy.upstream.egress_gate import EgressGate
from tests.support.fake_registry import FakeRegistry

HOST = "registry.terraform.io"
NET = f"/modules/{HOST}/acme/net/aws"
NET_CLONE = "/git/net.git/info/refs"  # the first request of every clone of net.git
TARBALL = f"/modules/{HOST}/acme/tarball/aws"
Make = Callable[..., Awaitable[TestClient]]


def tar_members(data: bytes) -> dict[str, bytes | None]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {m.name: (tar.extractfile(m).read() if m.isfile() else None)  # type: ignore[union-attr]
                for m in tar.getmembers()}


async def download(client: TestClient, path: str) -> tuple[str, bytes]:
    """Ask for the download, check both answer shapes agree, fetch the archive."""
    response = await client.get(f"{path}/download")
    assert response.status == 200, await response.text()
    location = (await response.json())["location"]
    assert response.headers["X-Terraform-Get"] == location
    assert location.startswith("https://") and location.endswith(".tar.gz")
    assert "//" not in location.removeprefix("https://")
    archive = await client.get(urlsplit(location).path)
    assert archive.status == 200
    return location, await archive.read()


async def test_versions_are_proxied_and_cached(client: TestClient,
                                               registry: FakeRegistry) -> None:
    for _ in range(3):
        response = await client.get(f"{NET}/versions")
        assert response.status == 200
        assert response.content_type == "application/json"
        body = await response.json()
    versions = {v["version"] for v in body["modules"][0]["versions"]}
    assert versions == {"1.2.0", "1.1.0"}
    assert registry.paths() == ["/v1/modules/acme/net/aws/versions"]


async def test_module_names_keep_their_case(client: TestClient, registry: FakeRegistry) -> None:
    response = await client.get(f"/modules/{HOST}/Acme-Corp/Zip_Mod/aws/versions")
    assert response.status == 200
    assert registry.paths() == ["/v1/modules/Acme-Corp/Zip_Mod/aws/versions"]


async def test_git_source_is_cloned_with_submodules_and_served_from_cache(
        client: TestClient, registry: FakeRegistry) -> None:
    location, data = await download(client, f"{NET}/1.2.0")
    members = tar_members(data)
    assert members["main.tf"] is not None and b'default = "net"' in members["main.tf"]
    assert members["modules/sub/main.tf"] == b"# sub\n"
    assert members["shared/main.tf"] is not None  # the submodule was fetched too
    assert not any(name == ".git" or name.startswith(".git/") or "/.git" in name
                   for name in members)
    assert any(p.startswith("/git/shared.git/") for p in registry.paths())

    registry.requests.clear()
    registry.faults.add("down")
    again_location, again = await download(client, f"{NET}/1.2.0")
    assert (again_location, again) == (location, data)
    assert registry.requests == []


async def archive_path(client: TestClient, path: str) -> str:
    """Ask for the download; the path of the archive it names."""
    response = await client.get(f"{path}/download")
    assert response.status == 200, await response.text()
    return urlsplit((await response.json())["location"]).path


async def test_download_answers_at_once_while_a_slow_source_arrives(
        client: TestClient, registry: FakeRegistry) -> None:
    # Terraform gives the download request 10 s; a clone may take minutes. The answer needs
    # only the version list; the archive requests wait for the one clone.
    registry.slow_paths[NET_CLONE] = 3.0
    started = time.monotonic()
    answers = await asyncio.gather(*(client.get(f"{NET}/1.2.0/download") for _ in range(4)))
    assert time.monotonic() - started < 1.0
    assert {r.status for r in answers} == {200}
    path = urlsplit((await answers[0].json())["location"]).path

    async def hang_up() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await client.get(path, timeout=aiohttp.ClientTimeout(total=0.5))

    async def fetch() -> tuple[int, bytes]:
        response = await client.get(path)
        return response.status, await response.read()

    _, head, *gets = await asyncio.gather(hang_up(), client.head(path),
                                          *(fetch() for _ in range(4)))
    assert time.monotonic() - started >= 3.0
    assert {status for status, _ in gets} == {200}
    data = gets[0][1]
    assert all(body == data for _, body in gets)
    members = tar_members(data)
    assert b'default = "net"' in (members["main.tf"] or b"")
    assert members["shared/main.tf"] is not None
    assert head.status == 200 and int(head.headers["Content-Length"]) == len(data)
    # One clone for every client, the one that hung up included; a hang-up cancels nothing.
    assert registry.paths().count(NET_CLONE) == 1
    assert registry.paths().count("/v1/modules/acme/net/aws/1.2.0/download") == 1
    assert (await client.get(path)).status == 200
    assert registry.paths().count(NET_CLONE) == 1


async def test_a_fill_that_times_out_answers_the_archive_request_with_json_504(
        make: Make, registry: FakeRegistry) -> None:
    client = await make(modules_git_timeout="1")
    registry.slow_paths[NET_CLONE] = 3.0
    started = time.monotonic()
    path = await archive_path(client, f"{NET}/1.2.0")
    assert time.monotonic() - started < 1.0
    for method in ("HEAD", "GET"):
        response = await client.request(method, path)
        assert response.status == 504
        assert response.content_type == "application/json"
    assert "timed out" in (await response.json())["errors"][0]


async def test_https_tarball_with_glob_subdir_and_json_location(
        client: TestClient, registry: FakeRegistry) -> None:
    _location, data = await download(client, f"/modules/{HOST}/acme/tarball/aws/1.0.0")
    assert tar_members(data) == {"main.tf": tar_members(data)["main.tf"]}
    assert b"variable" in (tar_members(data)["main.tf"] or b"")


async def test_relative_zip_location(client: TestClient, registry: FakeRegistry) -> None:
    _location, data = await download(client, f"/modules/{HOST}/Acme-Corp/Zip_Mod/aws/2.0.0")
    assert set(tar_members(data)) == {"main.tf", "files"}
    assert "/archives/zip-2.0.0.zip" in registry.paths()


async def test_head_on_module_archive_waits_for_its_fill(client: TestClient,
                                                          registry: FakeRegistry) -> None:
    # Terraform sends HEAD before GET. A HEAD answered before the archive exists could not
    # give its length (and go-getter takes "ranges, no length" as "already downloaded").
    registry.slow_paths["/archives/tarball-1.0.0.tgz"] = 1.0
    path = await archive_path(client, f"{TARBALL}/1.0.0")
    response = await client.head(path)
    assert response.status == 200
    length = int(response.headers["Content-Length"])
    data = await (await client.get(path)).read()
    assert length == len(data) > 0
    assert registry.paths().count("/archives/tarball-1.0.0.tgz") == 1


@pytest.mark.parametrize(("module", "message"), [
    ("acme/s3/aws/1.0.0", "module source type 's3' is not supported"),
    ("acme/registry/aws/1.0.0", "not a URL"),
    ("acme/net/aws/1.1.0", "git checkout"),
    ("evil/traversal/aws/1.0.0", "escapes the root"),
    ("evil/absolute/aws/1.0.0", "absolute"),
    ("evil/symlink/aws/1.0.0", "link escapes the root"),
    ("evil/hardlink/aws/1.0.0", "escapes the root"),
])
async def test_unusable_sources_are_502_and_nothing_is_stored(
        client: TestClient, registry: FakeRegistry, proxy_config: Config,
        module: str, message: str) -> None:
    # The version exists, so the download is answered; the archive request tells the truth.
    response = await client.get(await archive_path(client, f"/modules/{HOST}/{module}"))
    assert response.status == 502
    assert response.content_type == "application/json"
    assert message in (await response.json())["errors"][0]
    cache: Path = proxy_config.cache.dir
    assert not list(cache.rglob("*.tar.gz"))
    assert [p for p in (cache / "tmp").rglob("*") if p.is_file()
            and not p.name.endswith(".lock")] == []
    assert not (cache.parent / "evil.tf").exists() and not Path("/etc/evil.tf").exists()


@pytest.mark.parametrize(("path", "status"), [
    (f"{NET}/9.9.9/download", 404),
    (f"/modules/{HOST}/acme/nosuch/aws/versions", 404),
    ("/modules/example.com/acme/net/aws/versions", 404),
    (f"/modules/{HOST}/acme/net/AWS/versions", 400),
    (f"/modules/{HOST}/-acme/net/aws/versions", 400),
    (f"{NET}/1.0..0/download", 400),
    (f"{NET}/1.2.0/other.tar.gz", 404),
    (f"{NET}/1.2.0/..%2F..%2Fx", 400),
])
async def test_bad_module_requests(client: TestClient, registry: FakeRegistry, path: str,
                                   status: int) -> None:
    response = await client.get(path)
    assert response.status == status
    assert response.content_type == "application/json"
    if status == 400 or "example.com" in path:
        assert registry.requests == []


async def test_proxy_discovery_advertises_modules(client: TestClient) -> None:
    response = await client.get("/.well-known/terraform.json")
    assert response.status == 200
    assert response.content_type == "application/json"
    assert (await response.json())["modules.v1"] == f"/modules/{HOST}/"


async def test_stale_module_versions_with_upstream_down(
        aiohttp_client, write_config, registry: FakeRegistry) -> None:  # type: ignore[no-untyped-def]
    config = load_config(write_config(), environ={"TF_REGISTRY_PROXY_UPSTREAM_VERSIONS_TTL":
                                                  "0.001"})
    client = await aiohttp_client(create_app(config))
    assert (await client.get(f"{NET}/versions")).status == 200
    await asyncio.sleep(0.01)
    registry.faults.add("down")
    response = await client.get(f"{NET}/versions")
    assert response.status == 200


async def test_git_failures_name_no_path_of_the_proxy(
        registry: FakeRegistry, upstream_ca_file: Path, tmp_path: Path) -> None:
    """git names the paths it could not write to; what reaches an answer or a log line
    names none of this machine's."""
    (tmp_path / "a file").write_text("in the way")
    destination = tmp_path / "a file" / "tree"
    gate = EgressGate(EgressPolicy([f"127.0.0.1:{registry.port}"], []), 5.0)
    try:
        with pytest.raises(UpstreamError) as failed:
            await git.clone(f"{registry.url}/git/net.git", "v1.2.0", destination,
                            time_limit=30.0, ca_file=upstream_ca_file, gate=gate)
    finally:
        await gate.close()
    message = failed.value.message
    assert message.startswith(f"git clone of {registry.url}/git/net.git failed: "), message
    assert "<local path>" in message and "a file" not in message, message
    assert str(tmp_path) not in message and "/tmp" not in message, message
