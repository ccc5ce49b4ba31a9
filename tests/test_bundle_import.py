"""Importing air-gap bundles that lie: a refused import names the member (or field) and the
reason, and leaves the cache exactly as it was, so that an offline proxy serves nothing of
it; a mirror directory is read without following links or outgrowing the size limit."""

from __future__ import annotations

import gzip
import io
import json
import lzma
import os
import sqlite3
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diskcache
import pytest
from aiohttp.test_utils import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.airgap import manifest as bundle_manifest
from proxy.airgap.import_bundle import import_bundle
from proxy.airgap.manifest import BundleError
from proxy.app import create_app
from proxy.config import load_config
from proxy.store.archives import ArchiveStore
from proxy.store.usage import UsageLedger
from proxy.verification.hashes import h1_of_zip
from tests.support.bundles import (
    cache_state,
    changes_since,
    cli,
    index_records,
    offline_config,
    read_bundle,
    relist,
    write_bundle,
)
from tests.support.fake_registry import FakeRegistry
from tests.support.small_disk import small_filesystem

NULL = "registry.terraform.io/hashicorp/null"
NET = "registry.terraform.io/acme/net/aws"
# What an offline proxy would serve of the exported bundle's contents.
SERVED = [f"/mirror/{NULL}/terraform-provider-null_3.2.1_linux_amd64.zip",
          f"/mirror/{NULL}/3.2.1.json",
          f"/providers/{NULL}/3.2.1/download/linux/amd64",
          f"/modules/{NET}/versions",
          f"/modules/{NET}/1.2.0/net-aws-1.2.0.tar.gz"]


@dataclass(frozen=True)
class Exported:
    """Signed bundles from a warmed cache: everything (null and random 2 platforms each,
    modules net and tarball), and partial (null and tarball), with the exporter's keys."""

    bundle: Path
    partial: Path
    secret: Path
    public: Path


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory, registry_server: FakeRegistry,
             upstream_ca_file: Path) -> Exported:
    root = tmp_path_factory.mktemp("exported")
    registry_server.reset()
    assert cli("keygen", "--output", str(root / "keys"), cwd=root).returncode == 0
    connected = root / "connected.toml"
    connected.write_text(f"""
[server]
state_dir = "{root / 'state'}"
[cache]
dir = "{root / 'connected'}"
[upstream]
ca_bundle = "{upstream_ca_file}"
[upstream.hosts."registry.terraform.io".services]
"providers.v1" = "{registry_server.providers_url}"
"modules.v1" = "{registry_server.url}/v1/modules/"
""")
    wanted = root / "wanted.txt"
    wanted.write_text("hashicorp/null 3.2.1\nhashicorp/random 3.6.0\nacme/net/aws 1.2.0\n"
                      "acme/tarball/aws 1.0.0\n")
    warmed = cli("warm", "--config", str(connected), "--platform", "linux_amd64",
                 "--platform", "darwin_arm64", str(wanted), cwd=root)
    assert warmed.returncode == 0, warmed.stdout + warmed.stderr
    secret = root / "keys" / "bundle-key.secret.asc"
    some = root / "some.txt"
    some.write_text("hashicorp/null 3.2.1\nacme/tarball/aws\n")
    for output, sources in ((root / "bundle.tar", []), (root / "partial.tar", [str(some)])):
        result = cli("export", "--config", str(connected), "--output", str(output),
                     "--signing-key", str(secret), *sources, cwd=root)
        assert result.returncode == 0, result.stderr
    registry_server.reset()
    return Exported(root / "bundle.tar", root / "partial.tar", secret,
                    root / "keys" / "bundle-key.public.asc")


def import_signed(tmp_path: Path, exported: Exported, bundle: Path,
                  name: str = "inside") -> tuple[int, str, str]:
    """`import --bundle-key` into the offline cache tmp_path/name: rc, stdout, stderr."""
    result = cli("import", "--config", str(offline_config(tmp_path, name)), "--bundle-key",
                 str(exported.public), str(bundle), cwd=tmp_path)
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, result.stdout, result.stderr


def resigned(tmp_path: Path, exported: Exported, members: dict[str, bytes],
             manifest: dict[str, Any], name: str = "altered.tar") -> Path:
    """The bundle altered, and signed again by the exporter (what an exporter's mistake,
    or a stolen key, would carry)."""
    return write_bundle(tmp_path / name, members, manifest, signing_key=exported.secret)


async def statuses(tmp_path: Path, name: str, aiohttp_client: Any) -> dict[str, int]:
    """What an offline proxy on the cache tmp_path/name answers for SERVED."""
    config = load_config(offline_config(tmp_path, name), environ={})
    client: TestClient = await aiohttp_client(create_app(config))  # type: ignore[type-arg]
    found = {}
    for path in SERVED:
        response = await client.get(path)
        found[path] = response.status
        await response.read()
    await client.close()
    return found


def entry(manifest: dict[str, Any], type_: str = "null",
          platform: str = "linux_amd64") -> dict[str, Any]:
    """A provider entry of the manifest."""
    return next(e for e in manifest["providers"]
                if e["type"] == type_ and e["platform"] == platform)


def module(manifest: dict[str, Any], name: str = "net") -> dict[str, Any]:
    """A module entry of the manifest."""
    return next(e for e in manifest["modules"] if e["name"] == name)


# --- one member, one role ---------------------------------------------------------------

ALIASES = {
    # A module archive that is a provider's signature: before, the publish loop moved the
    # staged signature away, the next step failed, and what was published stayed (served).
    "module archive is a signature": (lambda m: module(m), "archive",
                                      lambda m: entry(m)["signature"]),
    "module archive is a SHA256SUMS": (lambda m: module(m), "archive",
                                       lambda m: entry(m)["sums"]),
    "module archive is a zip": (lambda m: module(m), "archive", lambda m: entry(m)["zip"]),
    "two modules, one archive": (lambda m: module(m, "tarball"), "archive",
                                 lambda m: module(m)["archive"]),
    "signature is another release's": (lambda m: entry(m, "random"), "signature",
                                       lambda m: entry(m)["signature"]),
    "zip is a signature": (lambda m: entry(m, "random"), "zip",
                           lambda m: entry(m)["signature"]),
}


@pytest.mark.parametrize("alias", list(ALIASES))
async def test_a_member_used_in_two_roles_is_refused_and_nothing_served(
        tmp_path: Path, exported: Exported, alias: str, aiohttp_client: Any) -> None:
    members, manifest = read_bundle(exported.bundle)
    pick, field, target = ALIASES[alias]
    member = target(manifest)
    pick(manifest)[field] = member
    # The member the alias replaced is no longer used by anything: drop it, as a careful
    # forger would, so that the alias is the only problem.
    used = {e[k] for e in manifest["providers"] for k in ("zip", "sums", "signature")} | {
        e["archive"] for e in manifest["modules"]}
    manifest["files"] = {k: v for k, v in manifest["files"].items() if k in used}
    members = {k: v for k, v in members.items() if k in used or k.startswith("manifest")}
    altered = resigned(tmp_path, exported, members, manifest)

    rc, _out, err = import_signed(tmp_path, exported, altered)
    assert rc == 2
    assert f"refused {altered}: {member}: used as " in err, err
    assert not (tmp_path / "inside").exists()  # no directory made, no index created
    assert set((await statuses(tmp_path, "inside", aiohttp_client)).values()) == {404}


def test_an_unsigned_bundle_with_a_member_in_two_roles_is_refused(
        tmp_path: Path, exported: Exported) -> None:
    """Without a bundle signature (--allow-unsigned-bundle) the same rule holds: a module
    archive that is a provider's SHA256SUMS is refused, and nothing is published."""
    members, manifest = read_bundle(exported.bundle)
    sums = entry(manifest)["sums"]
    del manifest["files"][module(manifest)["archive"]]
    del members[module(manifest)["archive"]]
    module(manifest)["archive"] = sums
    del members["manifest.json.sig"]
    unsigned = write_bundle(tmp_path / "unsigned.tar", members, manifest)
    result = cli("import", "--config", str(offline_config(tmp_path, "inside")),
                 "--allow-unsigned-bundle", str(unsigned), cwd=tmp_path)
    assert result.returncode == 2, result.stdout
    assert f"refused {unsigned}: {sums}: used as the SHA256SUMS of " in result.stderr, \
        result.stderr
    assert not (tmp_path / "inside").exists()


def test_a_member_listed_but_used_by_nothing_is_refused(tmp_path: Path,
                                                        exported: Exported) -> None:
    members, manifest = read_bundle(exported.bundle)
    manifest["modules"] = [e for e in manifest["modules"] if e["name"] != "net"]
    rc, _out, err = import_signed(tmp_path, exported,
                                  resigned(tmp_path, exported, members, manifest))
    assert rc == 2
    assert f"{module(read_bundle(exported.bundle)[1])['archive']}: listed in files but " \
        "used by no entry" in err, err
    assert not (tmp_path / "inside").exists()


# --- all or nothing ---------------------------------------------------------------------

async def test_a_failure_while_publishing_undoes_everything(
        tmp_path: Path, exported: Exported, aiohttp_client: Any) -> None:
    """The cache holds the partial bundle, and a file sits where the net module's directory
    must go: publishing fails after the provider zips went into place. Everything this
    import published goes again; the cache is as it was, and serves what it served."""
    rc, _out, err = import_signed(tmp_path, exported, exported.partial)
    assert rc == 0, err
    cache = tmp_path / "inside"
    (cache / "modules" / "registry.terraform.io" / "acme" / "net").write_bytes(b"in the way")
    served = await statuses(tmp_path, "inside", aiohttp_client)
    assert served[SERVED[0]] == 200 and served[SERVED[-1]] == 404
    before = cache_state(cache)

    rc, _out, err = import_signed(tmp_path, exported, exported.bundle)
    assert rc == 2
    assert "cannot write to the cache" in err and "nothing was imported" in err, err
    assert changes_since(before, cache) == []
    assert not list(cache.rglob("terraform-provider-random*"))
    assert await statuses(tmp_path, "inside", aiohttp_client) == served


def test_a_failure_writing_the_index_removes_the_published_files(
        tmp_path: Path, exported: Exported, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills up (SQLite says so) while the index records are written, after every
    file went into place: the files go again, and no record or value file stays."""
    config = load_config(offline_config(tmp_path, "inside"), environ={})
    cache = tmp_path / "inside"
    members, manifest = read_bundle(exported.bundle)
    # A record large enough that diskcache keeps it in a file beside the database.
    entry(manifest, "random")["document"]["padding"] = "x" * 100_000
    altered = resigned(tmp_path, exported, members, manifest)
    import_bundle(config, exported.partial, None)
    before = cache_state(cache)
    real_set = diskcache.Cache.set
    written: list[str] = []
    value_files: list[Path] = []

    def set_until_full(self: diskcache.Cache, key: Any, value: Any, *args: Any,
                       **kwargs: Any) -> bool:
        if written and written[-1].endswith("/random/3.6.0/linux_amd64"):
            value_files.extend(p for p in (cache / "index").rglob("*.val"))
            raise sqlite3.OperationalError("database or disk is full")
        written.append(key)
        return bool(real_set(self, key, value, *args, **kwargs))

    monkeypatch.setattr(diskcache.Cache, "set", set_until_full)
    with pytest.raises(BundleError, match=r"cannot write to the cache: .*disk is full"):
        import_bundle(config, altered, None)
    monkeypatch.undo()
    assert value_files  # the large record was on disk when the failure came
    assert list(cache.rglob("terraform-provider-random*")) == []
    assert changes_since(before, cache) == []


def test_a_refused_import_makes_no_cache_directories(tmp_path: Path,
                                                     exported: Exported) -> None:
    """Refused after the members were copied out (a zip does not match its signed
    checksum): the cache directory this import made goes again."""
    members, manifest = read_bundle(exported.bundle)
    zip_name = entry(manifest)["zip"]
    members[zip_name] = members[zip_name][:-1] + bytes([members[zip_name][-1] ^ 1])
    relist(manifest, zip_name, members[zip_name])
    rc, _out, err = import_signed(tmp_path, exported,
                                  resigned(tmp_path, exported, members, manifest))
    assert rc == 2 and f"{zip_name}: sha256 does not match the signed checksum" in err
    assert not (tmp_path / "inside").exists()


def test_counts_leave_out_what_the_cache_held(tmp_path: Path, exported: Exported) -> None:
    rc, out, err = import_signed(tmp_path, exported, exported.partial)
    assert rc == 0, err
    assert "imported 2 provider packages, 1 module archives (bundle signed by " in out
    assert "already" not in out
    rc, out, err = import_signed(tmp_path, exported, exported.bundle)
    assert rc == 0, err
    assert out.startswith("imported 2 provider packages, 1 module archives (bundle signed "), out
    assert out.rstrip().endswith("; 3 already in the cache"), out
    state = cache_state(tmp_path / "inside")
    rc, out, err = import_signed(tmp_path, exported, exported.bundle)
    assert rc == 0, err
    assert out.startswith("imported 0 provider packages, 0 module archives"), out
    assert out.rstrip().endswith("; 6 already in the cache"), out
    assert changes_since(state, tmp_path / "inside") == []


def test_running_proxies_count_what_an_import_added(tmp_path: Path,
                                                    exported: Exported) -> None:
    """The cache's shared usage record (what every process holds against cache.max_size)
    includes the imported files."""
    config = load_config(offline_config(tmp_path, "inside"), environ={})
    store = ArchiveStore(config.cache.dir)
    assert store.measure() == 0  # as a proxy starting on the empty cache records it
    store.close()
    import_bundle(config, exported.partial, None)
    stored = [p for area in ("archives", "modules")
              for p in (config.cache.dir / area).rglob("*") if p.is_file()]
    assert stored  # else the totals below are 0 == 0
    usage = UsageLedger(config.cache.dir / "tmp" / "locks" / "usage.lock").peek()
    assert usage is not None
    assert (usage.bytes, usage.files) == (sum(p.stat().st_size for p in stored), len(stored))


def test_imported_module_archives_are_checked_against_the_bundle_sha256(
        tmp_path: Path, exported: Exported) -> None:
    """An imported module archive is recorded with the sha256 the signed manifest gave it,
    as a fetched one is: exporting it again after it rotted on disk is refused on that
    ground, not merely on its gzip checksum."""
    rc, _out, err = import_signed(tmp_path, exported, exported.partial)
    assert rc == 0, err
    _members, manifest = read_bundle(exported.partial)
    archive = module(manifest, "tarball")["archive"]
    records = index_records(tmp_path / "inside")
    assert records["module-archive/registry.terraform.io/acme/tarball/aws/1.0.0"]["sha256"] \
        == manifest["files"][archive]["sha256"]
    stored = tmp_path / "inside/modules/registry.terraform.io/acme/tarball/aws/1.0.0.tar.gz"
    data = bytearray(stored.read_bytes())
    data[len(data) // 2] ^= 0xFF  # bit rot: the same size, another byte
    stored.write_bytes(bytes(data))
    result = cli("export", "--config", str(offline_config(tmp_path, "inside")), "--output",
                 str(tmp_path / "again.tar"), "--unsigned", cwd=tmp_path)
    assert result.returncode == 2
    assert f"{stored} does not match the sha256 it was stored with" in result.stderr, \
        result.stderr


# --- what the bundle file is ------------------------------------------------------------

@pytest.mark.parametrize("kind", ["gzip", "xz"])
def test_a_compressed_bundle_is_refused_before_it_is_read(tmp_path: Path, exported: Exported,
                                                          kind: str) -> None:
    data = exported.bundle.read_bytes()
    packed = tmp_path / f"bundle.tar.{kind}"
    packed.write_bytes(gzip.compress(data) if kind == "gzip" else lzma.compress(data))
    rc, _out, err = import_signed(tmp_path, exported, packed)
    assert rc == 2
    assert f"refused {packed}: a {kind}-compressed file: import takes the plain tar" in err
    assert not (tmp_path / "inside").exists()


def test_a_flood_of_members_is_refused_while_headers_are_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Headers are read one by one and counted: a tar of many tiny members stops at the
    limit, long before the manifest (written last) is looked for."""
    monkeypatch.setattr(bundle_manifest, "MAX_MEMBERS", 1000)
    flood = tmp_path / "flood.tar"
    with tarfile.open(flood, "w") as tar:
        for number in range(5000):
            tar.addfile(tarfile.TarInfo(f"providers/x/{number:05d}"))
    read = []
    real_next = tarfile.TarFile.next

    def counting_next(self: tarfile.TarFile) -> tarfile.TarInfo | None:
        member = real_next(self)
        read.append(member)
        return member

    monkeypatch.setattr(tarfile.TarFile, "next", counting_next)
    config = load_config(offline_config(tmp_path, "inside"), environ={})
    with pytest.raises(BundleError, match="more than 1000 members: not a bundle from"):
        import_bundle(config, flood, None)
    assert len(read) <= 1002  # (tarfile reads the first header twice)
    assert not (tmp_path / "inside").exists()


def test_a_huge_tar_extension_header_is_refused_unread(tmp_path: Path) -> None:
    """A pax header is read into memory whole: one of megabytes is refused from its size."""
    bomb = tmp_path / "pax.tar"
    with tarfile.open(bomb, "w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("manifest.json")
        info.pax_headers = {"comment": "x" * (2 << 20)}
        tar.addfile(info, io.BytesIO(b""))
    config = load_config(offline_config(tmp_path, "inside"), environ={})
    with pytest.raises(BundleError, match=r"a tar extension header of [0-9]+ bytes"):
        import_bundle(config, bomb, None)


def _tar(path: Path, entries: list[tuple[str, bytes, str]]) -> Path:
    """A tar of (name, tar type, data: the content of a file, the target of a link)."""
    with tarfile.open(path, "w") as tar:
        for name, kind, data in entries:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind == tarfile.REGTYPE:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                info.linkname = data.decode()
                tar.addfile(info)
    return path


REG, SYM, LNK = tarfile.REGTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE
TAR_TRICKS = {
    "the same name twice, as ./x and x": (
        [("manifest.json", REG, b"{}"), ("./manifest.json", REG, b"{}")],
        "manifest.json: appears twice in the bundle (as 'manifest.json' and "
        "'./manifest.json')"),
    "the same name twice, as a//x and a/x": (
        [("modules/a.tar.gz", REG, b""), ("modules//a.tar.gz", REG, b"")],
        "modules/a.tar.gz: appears twice in the bundle (as 'modules/a.tar.gz' and "
        "'modules//a.tar.gz')"),
    "a .. that leaves the tree": ([("providers/../../manifest.json", REG, b"{}")],
                                  "unsafe member name 'providers/../../manifest.json'"),
    "a .. that stays in the tree": ([("providers/../manifest.json", REG, b"{}")],
                                    "unsafe member name 'providers/../manifest.json'"),
    "an absolute path": ([("/manifest.json", REG, b"{}")],
                         "unsafe member name '/manifest.json'"),
    "backslashes": ([("a\\..\\manifest.json", REG, b"{}")],
                    "unsafe member name 'a\\\\..\\\\manifest.json'"),
    "a FIFO": ([("manifest.json", tarfile.FIFOTYPE, b"")],
               "manifest.json: a FIFO, not a regular file"),
    "a character device": ([("x", tarfile.CHRTYPE, b"")], "x: a device, not a regular file"),
    "a block device": ([("x", tarfile.BLKTYPE, b"")], "x: a device, not a regular file"),
    "a symbolic link": ([("manifest.json", SYM, b"/etc/passwd")],
                        "manifest.json: a symbolic link (to '/etc/passwd'), not a regular "
                        "file"),
    "a hard link": ([("a", REG, b"{}"), ("manifest.json", LNK, b"a")],
                    "manifest.json: a hard link (to 'a'), not a regular file"),
    "control characters": ([("a\x1b[2Jb", REG, b"{}")], "unsafe member name 'a\\x1b[2Jb'"),
}


@pytest.mark.parametrize("trick", list(TAR_TRICKS))
def test_tar_tricks_are_refused_naming_the_member(tmp_path: Path, trick: str) -> None:
    entries, message = TAR_TRICKS[trick]
    tricky = _tar(tmp_path / "tricky.tar", entries)
    config = load_config(offline_config(tmp_path, "inside"), environ={})
    with pytest.raises(BundleError) as refused:
        import_bundle(config, tricky, None)
    assert str(refused.value) == message
    assert not (tmp_path / "inside").exists()


def test_a_bundle_larger_than_the_free_space_is_refused_before_copying(
        tmp_path: Path, exported: Exported) -> None:
    """Its members are copied out onto the cache's filesystem first: one that cannot hold
    them all refuses the bundle up front, instead of filling the disk."""
    _members, manifest = read_bundle(exported.bundle)
    needed = sum(fact["size"] for fact in manifest["files"].values())
    with small_filesystem(tmp_path / "disk", 4 << 20) as disk:
        config = load_config(offline_config(tmp_path / "disk", "inside"), environ={})
        disk.fill(leave=needed // 2)
        free = disk.free_bytes()
        with pytest.raises(BundleError) as refused:
            import_bundle(config, exported.bundle, None)
        assert str(refused.value) == (
            f"the bundle's members add up to {needed} bytes; the filesystem of the cache "
            f"({tmp_path / 'disk' / 'inside'}) has {free} bytes free")
        assert not (tmp_path / "disk" / "inside").exists()
        disk.empty()
        assert import_bundle(config, exported.bundle, None).providers == 4


# --- every field checked, every address normalized, every message escaped ----------------

def test_a_malformed_version_list_is_named_not_a_traceback(tmp_path: Path,
                                                           exported: Exported) -> None:
    members, manifest = read_bundle(exported.bundle)
    manifest["versions"][NULL] = [{"version": "3.2.1", "protocols": ["5.0"],
                                   "platforms": [5]}]
    rc, _out, err = import_signed(tmp_path, exported,
                                  resigned(tmp_path, exported, members, manifest))
    assert rc == 2
    assert f"manifest.json: versions['{NULL}'][0].platforms: not an array of OS_ARCH " \
        "strings" in err, err
    assert not (tmp_path / "inside").exists()


WRONG_TYPES = {
    "a version that is a number": (lambda m: entry(m).__setitem__("version", 321),
                                   "version: a JSON number is not a valid string"),
    "a missing checksum": (lambda m: entry(m).pop("shasum"),
                           "shasum: a JSON null is not a valid string"),
    "modules as an object": (lambda m: m.__setitem__("modules", {}),
                             "manifest.json: modules is a JSON object, not a JSON array"),
    "a provider entry that is a string": (
        lambda m: m["providers"].__setitem__(0, "x"),
        "manifest.json: providers[0] is 'x', not an object"),
}


@pytest.mark.parametrize("wrong", list(WRONG_TYPES))
def test_fields_of_the_wrong_type_are_named_not_a_traceback(tmp_path: Path, exported: Exported,
                                                            wrong: str) -> None:
    members, manifest = read_bundle(exported.bundle)
    change, message = WRONG_TYPES[wrong]
    change(manifest)
    rc, _out, err = import_signed(tmp_path, exported,
                                  resigned(tmp_path, exported, members, manifest))
    assert rc == 2
    assert err.startswith("tf-registry-proxy: refused ") and message in err, err
    assert not (tmp_path / "inside").exists()


async def test_addresses_are_normalized_as_requests_are(tmp_path: Path, exported: Exported,
                                                        aiohttp_client: Any) -> None:
    members, manifest = read_bundle(exported.bundle)
    for item in manifest["providers"] + manifest["modules"]:
        item["hostname"] = "Registry.Terraform.IO:443"
    for item in manifest["providers"]:
        item["namespace"], item["type"] = item["namespace"].upper(), item["type"].upper()
    # The version lists under the very same spelling, as an exporter of these entries would
    # have written them.
    manifest["versions"] = {"Registry.Terraform.IO:443/" + k.split("/", 1)[1].upper(): v
                            for k, v in manifest["versions"].items()}
    rc, out, err = import_signed(tmp_path, exported,
                                 resigned(tmp_path, exported, members, manifest))
    assert rc == 0, err
    assert "imported 4 provider packages, 2 module archives" in out
    cache = tmp_path / "inside"
    assert sorted(p.name for p in (cache / "archives").iterdir()) == ["registry.terraform.io"]
    assert sorted(p.name for p in (cache / "modules").iterdir()) == ["registry.terraform.io"]
    assert sorted(p.name for p in (cache / "archives/registry.terraform.io").iterdir()) == [
        "hashicorp"]
    assert [key for key in index_records(cache) if key != key.lower() or ":443" in key] == []
    assert set((await statuses(tmp_path, "inside", aiohttp_client)).values()) == {200}


def test_entries_that_normalize_to_one_package_are_refused(tmp_path: Path,
                                                           exported: Exported) -> None:
    members, manifest = read_bundle(exported.bundle)
    original = entry(manifest)
    twin = dict(original, hostname="REGISTRY.TERRAFORM.IO", zip=original["zip"] + ".twin")
    members[twin["zip"]] = members[original["zip"]]
    manifest["files"][twin["zip"]] = manifest["files"][original["zip"]]
    manifest["providers"].append(twin)
    rc, _out, err = import_signed(tmp_path, exported,
                                  resigned(tmp_path, exported, members, manifest))
    assert rc == 2
    assert f"manifest.json: {NULL} 3.2.1 linux_amd64 is listed twice" in err, err


ESCAPES = {
    "provider type": lambda m: entry(m).__setitem__("type", "null\x1b[2J\x1b]0;pwned\x07"),
    "hostname": lambda m: entry(m).__setitem__("hostname", "\x1b[31mevil.example"),
    "module name": lambda m: module(m).__setitem__("name", "net\x1b[1A\rimported"),
    "version": lambda m: entry(m).__setitem__("version", "3.2.1\x1b[2K"),
    "version list": lambda m: m["versions"].__setitem__(NULL + "\x1b[2J", []),
    "member name": lambda m: module(m).__setitem__("archive", "modules/\x1b[2Jx.tar.gz"),
    "filename": lambda m: entry(m).__setitem__("filename", "\x9b2Jx.zip"),
}


@pytest.mark.parametrize("field", list(ESCAPES))
def test_control_sequences_from_a_bundle_never_reach_the_terminal(
        tmp_path: Path, exported: Exported, field: str) -> None:
    members, manifest = read_bundle(exported.bundle)
    ESCAPES[field](manifest)
    rc, _out, err = import_signed(tmp_path, exported,
                                  resigned(tmp_path, exported, members, manifest))
    assert rc == 2
    assert "\x1b" not in err and "\x9b" not in err and "\x07" not in err, repr(err)
    assert "\\x1b" in err or "\\x9b" in err, err  # shown escaped, so the operator sees it


# Where a forger could put something of the wrong shape: every level of the manifest.
PROVIDER = ("providers", "0")
VERSIONS = ("versions", NULL, "0")
PATHS = [("providers",), PROVIDER, *[(*PROVIDER, key) for key in (
             "hostname", "namespace", "type", "version", "platform", "filename", "shasum",
             "h1", "sums_id", "zip", "sums", "signature", "document")],
         (*PROVIDER, "document", "signing_keys"),
         (*PROVIDER, "document", "signing_keys", "gpg_public_keys"),
         (*PROVIDER, "document", "signing_keys", "gpg_public_keys", "0"),
         ("modules",), ("modules", "0"), *[("modules", "0", key) for key in (
             "hostname", "namespace", "name", "system", "version", "archive")],
         ("versions",), ("versions", NULL), VERSIONS, (*VERSIONS, "version"),
         (*VERSIONS, "protocols"), (*VERSIONS, "platforms"), (*VERSIONS, "platforms", "0"),
         ("files",), ("files", "manifest.json"), ("format",)]
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner,
                                                               max_size=3), max_leaves=6)


@pytest.fixture(scope="module")
def pristine(exported: Exported) -> tuple[dict[str, bytes], dict[str, Any]]:
    """The partial bundle's members and manifest (small: quick to write again)."""
    return read_bundle(exported.partial)


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(PATHS), JSON)
def test_any_shape_of_manifest_is_refused_with_a_bundle_error(
        pristine: tuple[dict[str, bytes], dict[str, Any]], path: str, value: Any) -> None:
    """Replace one field, at any level, with any JSON: the import either goes through or
    is refused with a BundleError, never another exception."""
    members, original = pristine
    manifest = json.loads(json.dumps(original))
    _replace(manifest, path, value)
    with tempfile.TemporaryDirectory() as name:  # one per example: tmp_path is per test
        work = Path(name)
        config = load_config(offline_config(work, "inside"), environ={})
        bundle = write_bundle(work / "bundle.tar", members, manifest)
        try:
            import_bundle(config, bundle, None)
        except BundleError as exc:
            assert str(exc).isprintable(), repr(str(exc))
            assert not (work / "inside").exists()


def _replace(document: Any, path: tuple[str, ...], value: Any) -> None:
    for part in path[:-1]:
        document = document[int(part)] if isinstance(document, list) else document[part]
    last = path[-1]
    if isinstance(document, list):
        document[int(last)] = value
    else:
        document[last] = value


# --- `terraform providers mirror` directories ---------------------------------------------

@pytest.fixture
def mirror(tmp_path: Path, registry: FakeRegistry) -> Iterator[Path]:
    """A directory as `terraform providers mirror` writes it, with one package."""
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    directory = tmp_path / "mirror" / "registry.terraform.io" / "hashicorp" / "null"
    directory.mkdir(parents=True)
    zip_path = directory / release.filename("linux_amd64")
    zip_path.write_bytes(release.zips["linux_amd64"])
    (directory / "index.json").write_text('{"versions": {"3.2.1": {}}}')
    (directory / "3.2.1.json").write_text(json.dumps({"archives": {"linux_amd64": {
        "url": zip_path.name, "hashes": [h1_of_zip(zip_path)]}}}))
    yield tmp_path / "mirror"


def import_mirror(tmp_path: Path, directory: Path, extra: str = "") -> tuple[int, str, str]:
    """`import --allow-unsigned-bundle` of a mirror directory into tmp_path/inside."""
    result = cli("import", "--config", str(offline_config(tmp_path, "inside", extra)),
                 "--allow-unsigned-bundle", str(directory), cwd=tmp_path)
    assert "Traceback" not in result.stderr, result.stderr
    return result.returncode, result.stdout, result.stderr


def test_a_symlinked_zip_in_a_mirror_directory_is_refused(tmp_path: Path, mirror: Path) -> None:
    zip_path = next(mirror.rglob("*.zip"))
    elsewhere = tmp_path / "elsewhere.zip"
    zip_path.rename(elsewhere)
    zip_path.symlink_to(elsewhere)  # the very package: still, nothing is followed
    rc, _out, err = import_mirror(tmp_path, mirror)
    assert rc == 2
    assert f"{zip_path}: a symbolic link" in err, err
    assert not (tmp_path / "inside").exists()


def test_a_symlink_to_a_device_is_refused_unread(tmp_path: Path, mirror: Path) -> None:
    zip_path = next(mirror.rglob("*.zip"))
    zip_path.unlink()
    # A device (/dev/zero would fill the disk of a copy that followed the link).
    zip_path.symlink_to("/dev/null")
    rc, _out, err = import_mirror(tmp_path, mirror)
    assert rc == 2 and f"{zip_path}: a symbolic link" in err, err
    assert not (tmp_path / "inside").exists()


def test_a_symlinked_directory_in_a_mirror_directory_is_refused(tmp_path: Path,
                                                                mirror: Path) -> None:
    namespace = mirror / "registry.terraform.io" / "hashicorp"
    namespace.rename(tmp_path / "hashicorp")
    namespace.symlink_to(tmp_path / "hashicorp")
    rc, _out, err = import_mirror(tmp_path, mirror)
    assert rc == 2 and f"{namespace}: a symbolic link" in err, err
    assert not (tmp_path / "inside").exists()


def test_a_mirror_zip_over_the_size_limit_is_refused(tmp_path: Path, mirror: Path) -> None:
    zip_path = next(mirror.rglob("*.zip"))
    limit = zip_path.stat().st_size - 1
    rc, _out, err = import_mirror(tmp_path, mirror, f'max_archive_size = "{limit}B"')
    assert rc == 2
    assert f"{zip_path}: over the {limit}-byte limit (upstream.max_archive_size)" in err, err
    assert not (tmp_path / "inside").exists()
    rc, out, err = import_mirror(tmp_path, mirror, f'max_archive_size = "{limit + 1}B"')
    assert rc == 0 and "imported 1 provider packages" in out, err


def test_a_refused_mirror_directory_leaves_no_trace(tmp_path: Path, mirror: Path,
                                                   registry: FakeRegistry) -> None:
    """Two packages, one of which matches no hash: nothing is imported, no cache directory
    made; without it, the other imports, and again it is counted as already there."""
    directory = mirror / "registry.terraform.io" / "hashicorp" / "null"
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    other = directory / release.filename("darwin_arm64")
    other.write_bytes(release.zips["darwin_arm64"])
    document = json.loads((directory / "3.2.1.json").read_text())
    document["archives"]["darwin_arm64"] = {"hashes": ["h1:" + "A" * 43 + "="]}
    (directory / "3.2.1.json").write_text(json.dumps(document))
    rc, _out, err = import_mirror(tmp_path, mirror)
    assert rc == 2 and f"{other}: matches none of the hashes" in err, err
    assert not (tmp_path / "inside").exists()
    os.unlink(other)
    rc, out, err = import_mirror(tmp_path, mirror)
    assert rc == 0 and "imported 1 provider packages" in out, err
    state = cache_state(tmp_path / "inside")
    rc, out, err = import_mirror(tmp_path, mirror)
    assert rc == 0 and "imported 0 provider packages" in out and "1 already" in out, out
    assert changes_since(state, tmp_path / "inside") == []


def test_a_fifo_named_as_a_zip_is_refused_unread(tmp_path: Path, mirror: Path) -> None:
    zip_path = next(mirror.rglob("*.zip"))
    zip_path.unlink()
    os.mkfifo(zip_path)  # opening it to read would wait for a writer forever
    rc, _out, err = import_mirror(tmp_path, mirror)
    assert rc == 2 and f"{zip_path}: not a regular file" in err, err
    assert not (tmp_path / "inside").exists()


def test_a_symlinked_version_document_is_refused(tmp_path: Path, mirror: Path) -> None:
    document = next(mirror.rglob("3.2.1.json"))
    elsewhere = tmp_path / "elsewhere.json"
    document.rename(elsewhere)
    document.symlink_to(elsewhere)
    rc, _out, err = import_mirror(tmp_path, mirror)
    assert rc == 2 and f"{document}: a symbolic link" in err, err
    assert not (tmp_path / "inside").exists()
