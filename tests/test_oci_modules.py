"""Registry modules as OCI artifacts (/v2/modules/...), in-process against the fake upstream:
the manifest and its zip layer, made from the same stored archive `modules.v1` serves, the
same bytes in every process and after a rebuild."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
import zipfile
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import load_config
from proxy.modules.packing import pack
from proxy.modules.zip_layer import zip_from_packed
from tests.conftest import AppClient
from tests.support.audit import eventually
from tests.support.fake_registry import FakeRegistry

HOST = "registry.terraform.io"
REPO = f"/v2/modules/{HOST}/acme/net/aws"
ARCHIVE = f"/modules/{HOST}/acme/net/aws/1.2.0/net-aws-1.2.0.tar.gz"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
EMPTY = "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a"
CLONES = "/git/net.git/info/refs"


async def _manifest(client: TestClient, tag: str = "1.2.0") -> tuple[str, dict[str, Any]]:
    response = await client.get(f"{REPO}/manifests/{tag}")
    assert response.status == 200, await response.text()
    assert response.headers["Content-Type"] == MANIFEST
    body = await response.read()
    digest = response.headers["Docker-Content-Digest"]
    assert digest == "sha256:" + hashlib.sha256(body).hexdigest()
    return digest, json.loads(body)


async def _layer(client: TestClient) -> tuple[dict[str, Any], bytes]:
    _, manifest = await _manifest(client)
    (layer,) = manifest["layers"]
    blob = await client.get(f"{REPO}/blobs/{layer['digest']}")
    assert blob.status == 200, await blob.text()
    return layer, await blob.read()


def _zip_files(data: bytes) -> dict[str, tuple[bytes, int]]:
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return {info.filename: (archive.read(info), info.external_attr >> 16)
                for info in archive.infolist()}


def _tar_files(data: bytes) -> dict[str, tuple[bytes, int]]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        return {(m.name + "/" if m.isdir() else m.name):
                (tar.extractfile(m).read() if m.isfile() else b"",  # type: ignore[union-attr]
                 (0o40000 if m.isdir() else 0o100000) | m.mode)
                for m in tar.getmembers()}


def _clones(registry: FakeRegistry) -> int:
    return sum(1 for _method, path in registry.requests if path == CLONES)


def test_the_zip_of_a_tree_is_the_same_bytes_whenever_it_is_made(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    (tree / "main.tf").write_bytes(b"# main\n")
    (tree / "scripts" / "run.sh").write_bytes(b"#!/bin/sh\n")
    (tree / "scripts" / "run.sh").chmod(0o755)
    made = []
    for attempt in range(2):
        packed = tmp_path / f"packed-{attempt}.tar.gz"
        pack(tree, packed, 1 << 20)
        os.utime(tree / "main.tf", (attempt * 1000, attempt * 1000))
        with open(packed, "rb") as handle:
            zip_from_packed(handle, tmp_path / f"made-{attempt}.zip")
        made.append((tmp_path / f"made-{attempt}.zip").read_bytes())
    assert made[0] == made[1]
    files = _zip_files(made[0])
    assert files == {"main.tf": (b"# main\n", 0o100644), "scripts/": (b"", 0o40755),
                     "scripts/run.sh": (b"#!/bin/sh\n", 0o100755)}
    with zipfile.ZipFile(io.BytesIO(made[0])) as archive:
        assert {info.date_time for info in archive.infolist()} == {(1980, 1, 1, 0, 0, 0)}
        assert archive.testzip() is None


def test_what_is_not_an_intact_archive_makes_no_zip(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not an intact"):
        zip_from_packed(io.BytesIO(b"\x1f\x8b not gzip"), tmp_path / "out.zip")


async def test_tags_are_the_module_versions(client: TestClient) -> None:
    response = await client.get(f"{REPO}/tags/list")
    assert response.status == 200
    assert await response.json() == {"name": f"modules/{HOST}/acme/net/aws",
                                     "tags": ["1.1.0", "1.2.0"]}


async def test_a_tag_is_a_modulepkg_manifest_whose_zip_is_the_served_archive(
        client: TestClient, registry: FakeRegistry) -> None:
    head = await client.head(f"{REPO}/manifests/1.2.0")
    assert head.status == 200 and head.headers["Content-Type"] == MANIFEST
    digest, manifest = await _manifest(client)
    assert head.headers["Docker-Content-Digest"] == digest
    assert int(head.headers["Content-Length"]) == len(json.dumps(manifest,
                                                                 separators=(",", ":")))
    assert manifest["artifactType"] == "application/vnd.opentofu.modulepkg"
    assert manifest["config"]["digest"] == EMPTY
    layer, data = await _layer(client)
    assert layer["mediaType"] == "archive/zip" and layer["size"] == len(data)
    assert layer["digest"] == "sha256:" + hashlib.sha256(data).hexdigest()
    archive = await client.get(ARCHIVE)  # modules.v1's archive: a hit, the same files
    assert archive.status == 200
    assert _zip_files(data) == _tar_files(await archive.read())
    assert _clones(registry) == 1
    assert (await client.get(f"{REPO}/blobs/{EMPTY}")).status == 200
    by_digest = await client.get(f"{REPO}/manifests/{digest}")
    assert json.loads(await by_digest.read()) == manifest


async def test_a_module_fetched_through_modules_v1_is_a_hit_for_oci(
        client: TestClient, registry: FakeRegistry) -> None:
    archive = await client.get(ARCHIVE)
    assert archive.status == 200
    await archive.read()
    await _layer(client)
    assert _clones(registry) == 1


async def test_a_zip_blob_supports_range_requests(client: TestClient) -> None:
    layer, data = await _layer(client)
    part = await client.get(f"{REPO}/blobs/{layer['digest']}", headers={"Range": "bytes=5-24"})
    assert part.status == 206
    assert await part.read() == data[5:25]


async def test_the_zip_is_the_same_bytes_after_a_restart_a_rebuild_and_in_another_cache(
        aiohttp_client: Any, write_config: Any, tmp_path: Path) -> None:
    config = load_config(write_config(), environ={})
    first = await aiohttp_client(create_app(config))
    digest, _ = await _manifest(first)
    layer, data = await _layer(first)
    await first.close()
    stored = tmp_path / "cache" / "modules" / HOST / "acme" / "net" / "aws" / "1.2.0.zip"
    assert stored.read_bytes() == data
    stored.unlink()  # evicted: made again from the archive
    again = await aiohttp_client(create_app(config))
    blob = await again.get(f"{REPO}/blobs/{layer['digest']}")
    assert await blob.read() == data
    assert (await _manifest(again))[0] == digest
    await again.close()
    elsewhere = await aiohttp_client(create_app(load_config(
        write_config(cache_dir=tmp_path / "another-cache"), environ={})))
    assert (await _manifest(elsewhere))[0] == digest  # another replica, fetched afresh


async def test_a_damaged_zip_is_dropped_and_made_again(
        aiohttp_client: Any, write_config: Any, tmp_path: Path) -> None:
    config = load_config(write_config(), environ={})
    first = await aiohttp_client(create_app(config))
    layer, data = await _layer(first)
    await first.close()
    stored = tmp_path / "cache" / "modules" / HOST / "acme" / "net" / "aws" / "1.2.0.zip"
    damaged = bytearray(data)
    damaged[len(damaged) // 2] ^= 0xFF
    stored.write_bytes(bytes(damaged))
    os.utime(stored, (1, 1))
    second = await aiohttp_client(create_app(config))
    blob = await second.get(f"{REPO}/blobs/{layer['digest']}")
    assert blob.status == 200
    assert await blob.read() == data


async def test_a_zip_served_is_audited_as_its_module_version(make: AppClient,
                                                              tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    client = await make(server_audit_log=str(log))
    layer, data = await _layer(client)
    [served] = await eventually(log, "served")
    assert (served["kind"], served["name"], served["version"]) == ("module", "net", "1.2.0")
    assert served["sha256"] == layer["digest"].removeprefix("sha256:")
    assert served["bytes"] == len(data)


async def test_offline_a_held_module_is_served_and_a_missing_one_is_unknown(
        aiohttp_client: Any, write_config: Any) -> None:
    online = await aiohttp_client(create_app(load_config(write_config(), environ={})))
    digest, _ = await _manifest(online)
    await online.close()
    offline = await aiohttp_client(create_app(load_config(
        write_config(upstream_extra='mode = "offline"'), environ={})))
    assert (await _manifest(offline))[0] == digest
    missing = await offline.get(f"{REPO}/manifests/1.1.0")
    assert missing.status == 404
    assert (await missing.json())["errors"][0]["code"] == "MANIFEST_UNKNOWN"


async def test_errors_filters_and_hostile_references(make: AppClient,
                                                     registry: FakeRegistry) -> None:
    client = await make(extra='[filters]\nmodules = ["registry.terraform.io/acme/tarball/*"]\n')
    cases = {
        f"{REPO}/tags/list": (404, "NAME_UNKNOWN"),  # filtered out
        f"/v2/modules/{HOST}/acme/tarball/aws/manifests/9.9.9": (404, "MANIFEST_UNKNOWN"),
        f"/v2/modules/{HOST}/acme/tarball/aws/manifests/latest": (404, "MANIFEST_UNKNOWN"),
        f"/v2/modules/{HOST}/acme/tarball/aws/blobs/sha256:{'0' * 64}": (404, "BLOB_UNKNOWN"),
        f"/v2/modules/{HOST}/acme/tarball/aws/blobs/sha1:abc": (400, "DIGEST_INVALID"),
        f"/v2/modules/{HOST}/acme/tarball/aws/manifests/..%2f..%2fetc": (400, "NAME_INVALID"),
        f"/v2/modules/{HOST}/ac!me/tarball/aws/tags/list": (400, "NAME_INVALID"),
        "/v2/modules/unknown.example/acme/tarball/aws/tags/list": (404, "NAME_UNKNOWN"),
    }
    for path, (status, code) in cases.items():
        response = await client.get(path)
        assert response.status == status, (path, await response.text())
        assert (await response.json())["errors"][0]["code"] == code, path
    assert not [p for _m, p in registry.requests if "archives" in p or "git" in p]
