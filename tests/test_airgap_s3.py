"""The air-gap commands on the S3 backend, against a real S3 server: a bundle exported from a
cache directory imports into a bucket and an offline proxy on it (with an empty cache.dir)
serves it without upstream; warm fills a bucket, export reads it, and a cache directory
imports it; an import that fails part-way leaves the bucket exactly as it was."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

import proxy.store.s3_index
from proxy.app import create_app
from proxy.cli import main
from proxy.config import load_config
from proxy.store.s3_objects import StoreUnavailable
from tests.support.bundles import read_bundle, write_bundle
from tests.support.fake_registry import FakeRegistry
from tests.support.seaweedfs import S3Server
from tests.support.stores import use_s3_credentials

NULL = "registry.terraform.io/hashicorp/null"
NET = "registry.terraform.io/acme/net/aws"
ZIP = "terraform-provider-null_3.2.1_linux_amd64.zip"
# What an offline proxy answers from the store alone once the bundle is in.
SERVED = [f"/mirror/{NULL}/index.json",
          f"/mirror/{NULL}/3.2.1.json",
          f"/mirror/{NULL}/{ZIP}",
          f"/providers/{NULL}/versions",
          f"/providers/{NULL}/3.2.1/download/linux/amd64",
          f"/modules/{NET}/versions",
          f"/modules/{NET}/1.2.0/download",
          f"/modules/{NET}/1.2.0/net-aws-1.2.0.tar.gz"]


def s3_section(server: S3Server, bucket: str) -> str:
    """The [cache.s3] table for a bucket of the test server."""
    return (f'[cache.s3]\nbucket = "{bucket}"\nendpoint_url = "{server.endpoint_url}"\n'
            f'region = "{server.region}"\n')


def offline_config(tmp_path: Path, cache_dir: Path, s3: str = "") -> Path:
    """A proxy in the air-gapped network: offline, its upstream does not exist."""
    path = tmp_path / f"offline-{cache_dir.name}.toml"
    path.write_text(f"""
[server]
state_dir = "{tmp_path / 'offline-state'}"
[cache]
dir = "{cache_dir}"
[upstream]
mode = "offline"
[upstream.hosts."registry.terraform.io".services]
"providers.v1" = "https://upstream.invalid/v1/providers/"
"modules.v1" = "https://upstream.invalid/v1/modules/"
{s3}""")
    return path


async def command(*args: str) -> int:
    """The command line, run as `tf-registry-proxy ARGS` would (off the test's loop)."""
    return await asyncio.to_thread(main, list(args))


async def warm_and_export(tmp_path: Path, config: Path, bundle: Path) -> None:
    wanted = tmp_path / "wanted.txt"
    wanted.write_text("hashicorp/null 3.2.1\nacme/net/aws 1.2.0\n")
    assert await command("warm", "--config", str(config), "--platform", "linux_amd64",
                         str(wanted)) == 0
    assert await command("export", "--config", str(config), "--output", str(bundle),
                         "--unsigned") == 0


async def served_offline(aiohttp_client: Any, config: Path,
                         registry: FakeRegistry) -> dict[str, tuple[int, bytes]]:
    """What an offline proxy on config answers for SERVED (status, body; documents name
    the test server's own port); upstream is never asked."""
    registry.requests.clear()
    client: TestClient = await aiohttp_client(  # type: ignore[type-arg]
        create_app(load_config(config, environ={})))
    found = {}
    for path in SERVED:
        response = await client.get(path)
        found[path] = (response.status, await response.read())
    await client.close()
    assert registry.requests == []
    return found




def bucket_state(server: S3Server, bucket: str) -> dict[str, tuple[str, int]]:
    """Every object in the bucket with its ETag and size, but the last-use marks: a serve
    writes those in the background, and they are bookkeeping for prune, not content."""
    client: Any = server.client()
    state = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for found in page.get("Contents", []):
            if "/access/" not in found["Key"]:
                state[found["Key"]] = (found["ETag"], found["Size"])
    assert state, "the bucket holds nothing: the test would compare empty states"
    return state


async def test_a_disk_bundle_imports_into_s3_and_an_offline_replica_serves_it(
        aiohttp_client: Any, write_config: Callable[..., Path], registry: FakeRegistry,
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    use_s3_credentials(s3_server, monkeypatch)
    bundle = tmp_path / "bundle.tar"
    await warm_and_export(tmp_path, write_config(cache_dir=tmp_path / "connected"), bundle)
    bucket = s3_server.new_bucket()
    importer = offline_config(tmp_path, tmp_path / "importer", s3_section(s3_server, bucket))
    capsys.readouterr()
    assert await command("import", "--config", str(importer), "--allow-unsigned-bundle",
                         str(bundle)) == 0, capsys.readouterr().err
    assert "imported 1 provider packages, 1 module archives" in capsys.readouterr().out
    stored = bucket_state(s3_server, bucket)
    assert f"tfproxy/archives/{NULL}/3.2.1/{ZIP}" in stored
    assert f"tfproxy/index/package/{NULL}/3.2.1/linux_amd64" in stored
    assert f"tfproxy/modules/{NET}/1.2.0.tar.gz" in stored

    # Another replica, offline, with an empty cache.dir: everything comes from the bucket.
    replica = offline_config(tmp_path, tmp_path / "replica", s3_section(s3_server, bucket))
    answers = await served_offline(aiohttp_client, replica, registry)
    assert {path: status for path, (status, _body) in answers.items()} == dict.fromkeys(
        SERVED, 200)
    zip_bytes = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    assert answers[f"/mirror/{NULL}/{ZIP}"][1] == zip_bytes


async def test_warm_into_s3_export_from_it_import_into_a_cache_directory(
        aiohttp_client: Any, write_config: Callable[..., Path], registry: FakeRegistry,
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    use_s3_credentials(s3_server, monkeypatch)
    bucket = s3_server.new_bucket()
    connected = write_config(cache_dir=tmp_path / "connected",
                             extra=s3_section(s3_server, bucket))
    bundle = tmp_path / "bundle.tar"
    await warm_and_export(tmp_path, connected, bundle)
    # warm filled the bucket
    assert f"tfproxy/archives/{NULL}/3.2.1/{ZIP}" in bucket_state(s3_server, bucket)
    # Export read the bucket, not the hot copies warm left: without them it still works.
    again = tmp_path / "again.tar"
    connected_elsewhere = write_config(cache_dir=tmp_path / "elsewhere",
                                       extra=s3_section(s3_server, bucket))
    assert await command("export", "--config", str(connected_elsewhere), "--output",
                         str(again), "--unsigned") == 0
    assert "1 provider packages, 1 module archives" in capsys.readouterr().out

    inside = offline_config(tmp_path, tmp_path / "inside")
    assert await command("import", "--config", str(inside), "--allow-unsigned-bundle",
                         str(again)) == 0, capsys.readouterr().err
    assert (tmp_path / "inside" / "archives").is_dir()  # the disk backend, no S3 in it
    answers = await served_offline(aiohttp_client, inside, registry)
    assert {path: status for path, (status, _body) in answers.items()} == dict.fromkeys(
        SERVED, 200)


async def test_export_from_s3_refuses_an_object_damaged_in_the_bucket(
        write_config: Callable[..., Path], s3_server: S3Server, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    use_s3_credentials(s3_server, monkeypatch)
    bucket = s3_server.new_bucket()
    connected = write_config(cache_dir=tmp_path / "connected",
                             extra=s3_section(s3_server, bucket))
    await warm_and_export(tmp_path, connected, tmp_path / "bundle.tar")
    key = f"archives/{NULL}/3.2.1/{ZIP}"
    client: Any = s3_server.client()
    body = client.get_object(Bucket=bucket, Key=f"tfproxy/{key}")["Body"].read()
    client.put_object(Bucket=bucket, Key=f"tfproxy/{key}",
                      Body=body[:-8] + bytes(8))  # bit rot: same size, other bytes
    capsys.readouterr()
    output = tmp_path / "rotten.tar"
    elsewhere = write_config(cache_dir=tmp_path / "elsewhere",
                             extra=s3_section(s3_server, bucket))
    assert await command("export", "--config", str(elsewhere), "--output", str(output),
                         "--unsigned") == 2
    err = capsys.readouterr().err
    assert key in err and "does not match the sha256 it was stored with" in err, err
    assert not output.exists()


async def test_an_import_failing_part_way_leaves_the_bucket_as_it_was(
        aiohttp_client: Any, write_config: Callable[..., Path], registry: FakeRegistry,
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The bucket holds part of the bundle (null; its version list) when the full one is
    imported, and the bucket fails the last record write, after every blob and record went
    in: every object this import made goes again, the record it replaced is put back."""
    use_s3_credentials(s3_server, monkeypatch)
    connected = write_config(cache_dir=tmp_path / "connected")
    await warm_and_export(tmp_path, connected, tmp_path / "bundle.tar")
    partial = tmp_path / "partial.tar"
    only_null = tmp_path / "only-null.txt"
    only_null.write_text("hashicorp/null 3.2.1\n")
    assert await command("export", "--config", str(connected), "--output", str(partial),
                         "--unsigned", str(only_null)) == 0
    # Its version list as an older proxy would have it: without darwin_arm64, which the full
    # import then adds (a record the full import replaces).
    members, manifest = read_bundle(partial)
    manifest["versions"][NULL][0]["platforms"] = ["linux_amd64"]
    write_bundle(partial, members, manifest)
    wider = tmp_path / "wider.txt"  # another platform, and the module, for the full import
    wider.write_text("hashicorp/null 3.2.1\nacme/net/aws 1.2.0\n")
    assert await command("warm", "--config", str(connected), "--platform", "darwin_arm64",
                         str(wider)) == 0
    full = tmp_path / "full.tar"
    assert await command("export", "--config", str(connected), "--output", str(full),
                         "--unsigned") == 0

    bucket = s3_server.new_bucket()
    inside = offline_config(tmp_path, tmp_path / "inside", s3_section(s3_server, bucket))
    assert await command("import", "--config", str(inside), "--allow-unsigned-bundle",
                         str(partial)) == 0
    served = await served_offline(aiohttp_client, inside, registry)
    assert served[f"/mirror/{NULL}/{ZIP}"][0] == 200
    assert served[f"/modules/{NET}/1.2.0/net-aws-1.2.0.tar.gz"][0] == 404
    before = bucket_state(s3_server, bucket)  # serving noted what it checked: taken after

    real_set = proxy.store.s3_index.S3Index.set
    written: list[str] = []

    async def set_then_fail(self: Any, key: str, value: dict[str, Any]) -> None:
        written.append(key)
        await real_set(self, key, value)
        if key == f"versions/{NULL}" and written.count(key) == 1:  # the last record,
            # replacing the one held: written, but its answer lost (once: undo puts it back)
            raise StoreUnavailable("the object store is unreachable (injected)")

    monkeypatch.setattr(proxy.store.s3_index.S3Index, "set", set_then_fail)
    capsys.readouterr()
    assert await command("import", "--config", str(inside), "--allow-unsigned-bundle",
                         str(full)) == 2
    err = capsys.readouterr().err
    assert "cannot write to the cache" in err and "nothing was imported" in err, err
    monkeypatch.setattr(proxy.store.s3_index.S3Index, "set", real_set)
    # Blobs went in first, then every record: each one made is deleted again, and the
    # version list it replaced is put back.
    assert written[:5] == [f"package/{NULL}/3.2.1/darwin_arm64",
                           f"module-archive/{NET}/1.2.0", f"module-versions/{NET}",
                           f"sightings/module/{NET}", f"versions/{NULL}"]
    assert bucket_state(s3_server, bucket) == before
    after = await served_offline(aiohttp_client, inside, registry)
    assert {path: status for path, (status, _body) in after.items()} == {
        path: status for path, (status, _body) in served.items()}
    assert after[f"/mirror/{NULL}/{ZIP}"] == served[f"/mirror/{NULL}/{ZIP}"]


async def test_export_and_import_name_a_bucket_that_is_not_there(
        write_config: Callable[..., Path], s3_server: S3Server, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    use_s3_credentials(s3_server, monkeypatch)
    bundle = tmp_path / "bundle.tar"
    await warm_and_export(tmp_path, write_config(cache_dir=tmp_path / "connected"), bundle)
    missing = offline_config(tmp_path, tmp_path / "inside",
                             s3_section(s3_server, "no-such-bucket"))
    capsys.readouterr()
    assert await command("export", "--config", str(missing), "--output",
                         str(tmp_path / "out.tar"), "--unsigned") == 2
    assert await command("import", "--config", str(missing), "--allow-unsigned-bundle",
                         str(bundle)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("no bucket 'no-such-bucket'") == 2, err
    assert "nothing was exported" in err and "nothing was imported" in err, err
    assert not (tmp_path / "out.tar").exists()


async def test_a_blob_an_import_left_without_its_record_is_not_served(
        aiohttp_client: Any, write_config: Callable[..., Path], registry: FakeRegistry,
        s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An import that dies after publishing a package but before its record (records go
    last): an offline proxy on the bucket neither serves nor lists that package."""
    use_s3_credentials(s3_server, monkeypatch)
    bucket = s3_server.new_bucket()
    zip_bytes = registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"]
    client: Any = s3_server.client()
    client.put_object(Bucket=bucket, Key=f"tfproxy/archives/{NULL}/3.2.1/{ZIP}", Body=zip_bytes)
    replica = offline_config(tmp_path, tmp_path / "replica", s3_section(s3_server, bucket))
    answers = await served_offline(aiohttp_client, replica, registry)
    status, body = answers[f"/mirror/{NULL}/{ZIP}"]
    assert status != 200 and body != zip_bytes
    assert answers[f"/mirror/{NULL}/index.json"][0] != 200
