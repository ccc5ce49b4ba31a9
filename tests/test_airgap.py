"""Air-gap operations: warm, export, import into an offline proxy, install with Terraform."""

from __future__ import annotations

import io
import json
import os
import ssl
import subprocess
import sys
import tarfile
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import load_config
from proxy.hashes import h1_of_zip
from tests.support.fake_registry import FakeRegistry
from tests.support.gpg import GpgKey
from tests.support.proxy_process import ProxyProcess, free_port
from tests.support.terraform import terraform_env, terraform_init

ROOT_MODULE = """
terraform {
  required_providers {
    null   = { source = "hashicorp/null", version = "~> 3.1" }
    random = { source = "hashicorp/random", version = ">= 3.0" }
  }
}
module "net" {
  source  = "acme/net/aws"
  version = "1.2.0"
}
module "tarball" {
  source  = "acme/tarball/aws"
  version = "~> 1.0"
}
"""


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd)}
    return subprocess.run([sys.executable, "-m", "proxy", *args], capture_output=True,
                          text=True, env=env, timeout=300, cwd=cwd)


def offline_config(tmp_path: Path, name: str, port: int = 8443) -> Path:
    """A proxy in the air-gapped network: its upstream does not exist, and it is offline."""
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""
[server]
listen = "127.0.0.1:{port}"
[cache]
dir = "{tmp_path / name}"
[upstream]
mode = "offline"
[upstream.hosts."registry.terraform.io".services]
"providers.v1" = "https://upstream.invalid/v1/providers/"
"modules.v1" = "https://upstream.invalid/v1/modules/"
""")
    return path


def read_bundle(bundle: Path) -> tuple[dict[str, bytes], dict[str, Any]]:
    """Every member of a bundle, and its manifest."""
    with tarfile.open(bundle) as tar:
        members = {m.name: tar.extractfile(m).read() for m in tar.getmembers()  # type: ignore[union-attr]
                   if m.isfile()}
    return members, json.loads(members["manifest.json"])


def write_bundle(path: Path, members: dict[str, bytes],
                 manifest: dict[str, Any] | None = None) -> Path:
    """A tar of the given members (the manifest, when given, rewritten first)."""
    if manifest is not None:
        members = {**members, "manifest.json": json.dumps(manifest).encode()}
    with tarfile.open(path, "w") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return path


@pytest.fixture
def trusted_keys(tmp_path: Path, signer: GpgKey) -> Path:
    """The release signer's public key, as an operator would get it from the registry."""
    path = tmp_path / "trusted-keys.asc"
    path.write_text(signer.armored_public_key)
    return path


@pytest.fixture
def bundle(tmp_path: Path, write_config: Callable[..., Path],
           registry: FakeRegistry) -> Path:
    """Warm a connected proxy's cache from a configuration and export it."""
    configuration = tmp_path / "configuration"
    configuration.mkdir()
    (configuration / "main.tf").write_text(ROOT_MODULE)
    connected = write_config(cache_dir=tmp_path / "connected")
    warmed = cli("warm", "--config", str(connected), "--platform", "linux_amd64",
                 "--platform", "darwin_arm64", str(configuration), cwd=tmp_path)
    assert warmed.returncode == 0, warmed.stdout + warmed.stderr
    rows = {line.split("  ")[0].strip(): line.split() for line in warmed.stdout.splitlines()}
    assert rows["registry.terraform.io/hashicorp/null ~> 3.1"][-4:] == ["3.2.1", "2", "0.0",
                                                                       "ok"]
    assert rows["registry.terraform.io/acme/net/aws 1.2.0"][-1] == "ok"
    registry.requests.clear()
    again = cli("warm", "--config", str(connected), "--platform", "linux_amd64",
                str(configuration), cwd=tmp_path)
    assert again.returncode == 0
    assert registry.archive_requests() == []  # resumable: what is cached is not fetched again
    output = tmp_path / "bundle.tar"
    exported = cli("export", "--config", str(connected), "--output", str(output),
                   cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    assert "4 provider packages, 2 module archives" in exported.stdout
    # A selection: only what a list names.
    listing = tmp_path / "only-null.txt"
    listing.write_text("hashicorp/null ~> 3.0\nacme/tarball/aws\n")
    partial = tmp_path / "partial.tar"
    selected = cli("export", "--config", str(connected), "--output", str(partial),
                   str(listing), cwd=tmp_path)
    assert selected.returncode == 0, selected.stderr
    assert "2 provider packages, 1 module archives" in selected.stdout
    with tarfile.open(partial) as tar:
        names = tar.getnames()
    assert not any("random" in n or "acme/net" in n for n in names)
    return output


@pytest.mark.e2e
def test_carry_the_cache_across_the_gap(tmp_path: Path, bundle: Path, trusted_keys: Path,
                                        registry: FakeRegistry) -> None:
    port = free_port()
    inside = offline_config(tmp_path, "inside", port)
    refused = cli("import", "--config", str(inside), str(bundle), cwd=tmp_path)
    assert refused.returncode == 2 and "--trusted-keys" in refused.stderr
    imported = cli("import", "--config", str(inside), "--trusted-keys", str(trusted_keys),
                   str(bundle), cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    registry.requests.clear()
    with ProxyProcess(inside, tmp_path / "inside", port, tmp_path / "inside.log") as proxy:
        printed = proxy.cli("client-config")
        cli_config = tmp_path / "inside.tfrc"
        cli_config.write_text(printed.stdout)
        workdir = tmp_path / "air-gapped"
        workdir.mkdir()
        (workdir / "main.tf").write_text(ROOT_MODULE)
        result = terraform_init(workdir, terraform_env(tmp_path / "home", cli_config,
                                                       proxy.ca_file))
        assert result.retcode == 0, result.output
        assert "Installed hashicorp/null v3.2.1" in result.stdout
        assert (workdir / ".terraform/modules/net/shared/main.tf").exists()
        # The registry protocol, offline, lists only the platforms the cache holds.
        context = ssl.create_default_context(cafile=str(proxy.ca_file))
        url = f"{proxy.url}providers/registry.terraform.io/hashicorp/null/versions"
        with urllib.request.urlopen(url, context=context) as response:
            listed = json.load(response)["versions"]
        assert listed == [{"version": "3.2.1", "protocols": ["5.0"], "platforms": [
            {"os": "linux", "arch": "amd64"}, {"os": "darwin", "arch": "arm64"}]}]
    assert registry.requests == []


def test_altered_bundle_is_refused_and_the_cache_untouched(tmp_path: Path,
                                                           bundle: Path) -> None:
    data = bytearray(bundle.read_bytes())
    with tarfile.open(bundle) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("linux_amd64.zip"))
    data[member.offset_data + 200] ^= 0x01
    altered = tmp_path / "altered.tar"
    altered.write_bytes(bytes(data))
    inside = offline_config(tmp_path, "inside")
    result = cli("import", "--config", str(inside), "--trust-bundle-keys", str(altered),
                 cwd=tmp_path)
    assert result.returncode == 2
    assert member.name in result.stderr and "does not match the manifest" in result.stderr
    cache = tmp_path / "inside"
    assert not list(cache.rglob("*.zip")) and not list(cache.rglob("*.tar.gz"))


def test_a_forged_manifest_cannot_carry_a_forged_package(tmp_path: Path,
                                                         bundle: Path) -> None:
    """Rewrite a zip and its manifest line consistently: the signed checksum still says no."""
    members, manifest = read_bundle(bundle)
    name = next(n for n in members if n.endswith("linux_amd64.zip"))
    members[name] = members[name][:-1] + bytes([members[name][-1] ^ 1])
    import hashlib
    manifest["files"][name] = hashlib.sha256(members[name]).hexdigest()
    forged = write_bundle(tmp_path / "forged.tar", members, manifest)
    result = cli("import", "--config", str(offline_config(tmp_path, "inside")),
                 "--trust-bundle-keys", str(forged), cwd=tmp_path)
    assert result.returncode == 2
    assert "signed checksum" in result.stderr


async def test_terraform_providers_mirror_directory_imports_and_serves(
        tmp_path: Path, registry: FakeRegistry, aiohttp_client) -> None:  # type: ignore[no-untyped-def]
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    # What `terraform providers mirror` writes (Unicode host names would be written as such).
    directory = tmp_path / "mirror" / "registry.terraform.io" / "hashicorp" / "null"
    directory.mkdir(parents=True)
    zip_path = directory / release.filename("linux_amd64")
    zip_path.write_bytes(release.zips["linux_amd64"])
    (directory / "index.json").write_text('{"versions": {"3.2.1": {}}}')
    (directory / "3.2.1.json").write_text(json.dumps({"archives": {"linux_amd64": {
        "url": zip_path.name, "hashes": [h1_of_zip(zip_path)]}}}))
    inside = offline_config(tmp_path, "inside")
    result = cli("import", "--config", str(inside), str(tmp_path / "mirror"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    client: TestClient = await aiohttp_client(create_app(load_config(inside, environ={})))
    base = "/mirror/registry.terraform.io/hashicorp/null"
    assert await (await client.get(f"{base}/index.json")).json() == {"versions": {"3.2.1": {}}}
    document = await (await client.get(f"{base}/3.2.1.json")).json()
    assert document["archives"]["linux_amd64"]["hashes"][0] == h1_of_zip(zip_path)
    assert await (await client.get(f"{base}/{zip_path.name}")).read() == \
        release.zips["linux_amd64"]

    (directory / "3.2.1.json").write_text(json.dumps({"archives": {"linux_amd64": {
        "url": zip_path.name, "hashes": ["h1:AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA="]}}}))
    other = offline_config(tmp_path, "other")
    refused = cli("import", "--config", str(other), str(tmp_path / "mirror"), cwd=tmp_path)
    assert refused.returncode == 2 and "matches none of the hashes" in refused.stderr


def test_warm_a_running_proxy(tmp_path: Path, write_config: Callable[..., Path],
                              registry: FakeRegistry) -> None:
    listing = tmp_path / "wanted.txt"
    listing.write_text("registry.terraform.io/hashicorp/null 3.1.0\nacme/tarball/aws\n"
                       "hashicorp/nonexistent\n")
    port = free_port()
    config = write_config(cache_dir=tmp_path / "running", port=port)
    with ProxyProcess(config, tmp_path / "running", port, tmp_path / "running.log") as proxy:
        result = cli("warm", "--proxy", proxy.url, "--ca-file", str(proxy.ca_file),
                     str(listing), cwd=tmp_path)
    assert result.returncode == 1  # one requirement failed; the others were warmed
    assert "terraform-provider-null_3.1.0_linux_amd64.zip" in " ".join(
        registry.archive_requests())
    rows = {line.split("  ")[0].strip(): line for line in result.stdout.splitlines()}
    assert rows["registry.terraform.io/hashicorp/null 3.1.0"].endswith("ok")
    assert rows["registry.terraform.io/acme/tarball/aws"].endswith("ok")
    assert "HTTP 404" in rows["registry.terraform.io/hashicorp/nonexistent"]


@pytest.mark.parametrize("damage", ["drop a file", "bad version", "no manifest"])
def test_malformed_bundles_are_refused_cleanly(tmp_path: Path, bundle: Path,
                                               damage: str) -> None:
    members, manifest = read_bundle(bundle)
    if damage == "drop a file":
        del members[manifest["providers"][0]["sums"]]
        del manifest["files"][manifest["providers"][0]["sums"]]
    elif damage == "bad version":
        manifest["providers"][0]["version"] = "../../../etc"
    members["manifest.json"] = json.dumps(manifest).encode()
    if damage == "no manifest":
        del members["manifest.json"]
    broken = write_bundle(tmp_path / "broken.tar", members)
    result = cli("import", "--config", str(offline_config(tmp_path, "inside")),
                 "--trust-bundle-keys", str(broken), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "refused" in result.stderr and "Traceback" not in result.stderr
    assert not list((tmp_path / "inside").rglob("*.zip"))


def test_a_bundle_signed_by_its_own_key_is_refused(tmp_path: Path, bundle: Path,
                                                   trusted_keys: Path, impostor: GpgKey,
                                                   registry: FakeRegistry) -> None:
    """Replace a package, re-sign its SHA256SUMS with another key and put that key in the
    bundle: consistent with itself, but not with the trusted keys."""
    import hashlib
    members, manifest = read_bundle(bundle)
    entry = next(e for e in manifest["providers"] if e["platform"] == "linux_amd64"
                 and e["type"] == "null")
    from tests.support.fake_registry import build_zip
    evil = build_zip({"terraform-provider-null_v3.2.1": (b"#!/bin/sh\necho pwned\n", 0o755)})
    sha = hashlib.sha256(evil).hexdigest()
    sums = f"{sha}  {entry['filename']}\n".encode()
    members[entry["zip"]] = evil
    members[entry["sums"]] = sums
    members[entry["signature"]] = impostor.detach_sign(sums)
    entry["shasum"], entry["h1"] = sha, None
    entry["document"]["shasum"] = sha
    entry["document"]["signing_keys"] = {"gpg_public_keys": [
        {"ascii_armor": impostor.armored_public_key}]}
    for name in (entry["zip"], entry["sums"], entry["signature"]):
        manifest["files"][name] = hashlib.sha256(members[name]).hexdigest()
    manifest["providers"] = [entry]
    members = {k: v for k, v in members.items()
               if k in (entry["zip"], entry["sums"], entry["signature"])}
    manifest["files"] = {k: manifest["files"][k] for k in members}
    manifest["modules"] = []
    manifest["versions"] = {}
    forged = write_bundle(tmp_path / "self-signed.tar", members, manifest)
    result = cli("import", "--config", str(offline_config(tmp_path, "inside")),
                 "--trusted-keys", str(trusted_keys), str(forged), cwd=tmp_path)
    assert result.returncode == 2
    assert "does not verify" in result.stderr
    assert not list((tmp_path / "inside").rglob("*.zip"))


def test_user_mistakes_get_clear_answers(tmp_path: Path, bundle: Path, trusted_keys: Path,
                                         write_config: Callable[..., Path],
                                         signer: GpgKey) -> None:
    connected = str(write_config(cache_dir=tmp_path / "connected"))
    inside = str(offline_config(tmp_path, "inside"))
    wanted = tmp_path / "aws.txt"
    wanted.write_text("hashicorp/aws ~> 5.0\n")
    cases = {
        "not cached": (["export", "--config", connected, "--output",
                        str(tmp_path / "aws.tar"), str(wanted)],
                       "not in the cache (warm it first): registry.terraform.io/hashicorp/aws"),
        "bad platform": (["warm", "--config", connected, "--platform", "linux-amd64",
                          str(wanted)], "expected OS_ARCH"),
        "bad constraint": (["warm", "--config", connected, str(_write(tmp_path / "c.txt",
                           "hashicorp/null banana\n"))], "c.txt:1: "),
        "binary keys": (["import", "--config", inside, "--trusted-keys",
                         str(_write(tmp_path / "k.gpg", b"\x99\x01\x0d")), str(bundle)],
                        "not ASCII-armored"),
        "unpacked bundle": (["import", "--config", inside, str(_unpack(bundle, tmp_path))],
                            "looks like an unpacked bundle"),
    }
    for name, (args, message) in cases.items():
        result = cli(*args, cwd=tmp_path)
        assert result.returncode == 2, (name, result.stdout, result.stderr)
        assert message in result.stderr, (name, result.stderr)
        assert "Traceback" not in result.stderr, name
    assert not (tmp_path / "aws.tar").exists()

    # A bundle unpacked and packed again with tar (./ names, directory entries) still imports.
    repacked = tmp_path / "repacked.tar"
    subprocess.run(["tar", "cf", str(repacked), "-C", str(_unpack(bundle, tmp_path / "r")),
                    "."], check=True)
    result = cli("import", "--config", inside, "--trusted-keys", str(trusted_keys),
                 str(repacked), cwd=tmp_path)
    assert result.returncode == 0, result.stderr


def _write(path: Path, content: str | bytes) -> Path:
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    return path


def _unpack(bundle: Path, where: Path) -> Path:
    target = where / "unpacked"
    target.mkdir(parents=True)
    subprocess.run(["tar", "xf", str(bundle), "-C", str(target)], check=True)
    return target
