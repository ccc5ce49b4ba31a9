"""CLI releases across the air gap: `warm --cli` fills the cache (resumable), `export`
carries the releases with their SHA256SUMS and signatures, `import` checks them again
against the release keys configured inside, and the offline proxy serves them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from proxy.app import create_app
from proxy.config import load_config
from tests.support.bundles import cli, read_bundle, relist, write_bundle
from tests.support.fake_registry import FakeRegistry
from tests.support.fake_releases import release_requests
from tests.support.gpg import GpgKey

TF = "/releases/terraform"


def _inside(tmp_path: Path, keys: Path) -> Path:
    """An offline proxy in the air-gapped network, trusting keys for releases."""
    path = tmp_path / "inside.toml"
    path.write_text(f"""
[server]
state_dir = "{tmp_path / 'inside-state'}"
[cache]
dir = "{tmp_path / 'inside'}"
[upstream]
mode = "offline"
[releases]
terraform_keys = "{keys}"
opentofu_keys = "{keys}"
""")
    return path


@pytest.fixture
def exported(tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry,
             release_keys: Path) -> Path:
    """Warm two releases for two platforms, then export the cache, unsigned."""
    connected = write_config(cache_dir=tmp_path / "connected",
                             extra=registry.cli.toml(release_keys))
    args = ["warm", "--config", str(connected), "--cli", "terraform", "1.11.4",
            "--cli", "opentofu", "~> 1.8.0", "--platform", "linux_amd64",
            "--platform", "darwin_arm64"]
    warmed = cli(*args, cwd=tmp_path)
    assert warmed.returncode == 0, warmed.stdout + warmed.stderr
    rows = {line.split()[0]: line.split() for line in warmed.stdout.splitlines()[1:]}
    # requirement, version, items, MiB, result
    assert rows["terraform"][-4:] == ["1.11.4", "2", "0.0", "ok"]
    assert rows["opentofu"][-4:] == ["1.8.8", "3", "0.0", "ok"]  # linux: .zip and .tar.gz
    assert len(release_requests(registry.requests)) == 5
    registry.requests.clear()
    again = cli(*args, cwd=tmp_path)
    assert again.returncode == 0 and release_requests(registry.requests) == []  # resumable
    output = tmp_path / "bundle.tar"
    result = cli("export", "--config", str(connected), "--output", str(output), "--unsigned",
                 cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "5 CLI release archives" in result.stdout
    return output


async def test_releases_cross_the_air_gap_and_are_served_offline(
        tmp_path: Path, exported: Path, release_keys: Path, registry: FakeRegistry,
        aiohttp_client: Any) -> None:
    _members, manifest = read_bundle(exported)
    assert {(r["product"], r["version"]) for r in manifest["releases"]} == {
        ("terraform", "1.11.4"), ("opentofu", "1.8.8")}
    inside = _inside(tmp_path, release_keys)
    imported = cli("import", "--config", str(inside), "--allow-unsigned-bundle", str(exported),
                   cwd=tmp_path)
    assert imported.returncode == 0, imported.stderr
    assert "5 CLI release archives" in imported.stdout
    client = await aiohttp_client(create_app(load_config(inside, environ={})))
    release = registry.cli.releases[("terraform", "1.11.4")]
    for name in (release.archive("linux_amd64"), release.sums_name, release.keyed_signature):
        response = await client.get(f"{TF}/1.11.4/{name}")
        assert response.status == 200, await response.text()
        assert await response.read() == release.files[name]
    page = await (await client.get(f"{TF}/")).text()
    assert "1.11.4" in page and "1.10.5" not in page
    tofu = registry.cli.releases[("opentofu", "1.8.8")]
    response = await client.get("/releases/opentofu/opentofu/releases/download/v1.8.8/"
                                + tofu.archive("darwin_arm64"))
    assert await response.read() == tofu.files[tofu.archive("darwin_arm64")]
    # TofuDL's list names what is held, and each of it is served (the .tar.gz TofuDL takes).
    api = await (await client.get("/releases/tofu/api.json")).json()
    (held,) = [v["files"] for v in api["versions"] if v["id"] == "1.8.8"]
    assert tofu.archive("linux_amd64", ".tar.gz") in held
    assert tofu.archive("windows_amd64") not in held  # not warmed
    for name in held:
        response = await client.get(
            f"/releases/opentofu/opentofu/releases/download/v1.8.8/{name}")
        assert response.status == 200, name
    again = cli("import", "--config", str(inside), "--allow-unsigned-bundle", str(exported),
                cwd=tmp_path)
    assert again.returncode == 0 and "5 already in the cache" in again.stdout


def test_a_tampered_release_archive_is_refused_on_import(tmp_path: Path, exported: Path,
                                                         release_keys: Path) -> None:
    members, manifest = read_bundle(exported)
    name = next(r["archive"] for r in manifest["releases"] if r["product"] == "terraform")
    members[name] = members[name][:-40] + bytes([members[name][-40] ^ 1]) + members[name][-39:]
    relist(manifest, name, members[name])
    forged = write_bundle(tmp_path / "forged.tar", members, manifest)
    result = cli("import", "--config", str(_inside(tmp_path, release_keys)),
                 "--allow-unsigned-bundle", str(forged), cwd=tmp_path)
    assert result.returncode == 2
    assert "sha256 does not match the signed checksum" in result.stderr
    assert not (tmp_path / "inside" / "releases").exists()


def test_releases_signed_by_another_key_than_the_inside_trusts_are_refused(
        tmp_path: Path, exported: Path, impostor: GpgKey) -> None:
    other = tmp_path / "other-keys.asc"
    other.write_text(impostor.armored_public_key)
    result = cli("import", "--config", str(_inside(tmp_path, other)), "--allow-unsigned-bundle",
                 str(exported), cwd=tmp_path)
    assert result.returncode == 2
    assert "signature does not verify with the" in result.stderr
    assert "Traceback" not in result.stderr


def test_warm_cli_refuses_an_unknown_product_and_needs_something_to_warm(
        tmp_path: Path) -> None:
    unknown = cli("warm", "--cli", "vault", "1.0.0", cwd=tmp_path)
    assert unknown.returncode == 2 and "expected one of terraform, opentofu" in unknown.stderr
    nothing = cli("warm", cwd=tmp_path)
    assert nothing.returncode == 2 and "nothing to warm" in nothing.stderr


HOSTILE_ENTRIES: list[tuple[str, Any, str]] = [
    ("product", "vault", "no CLI called"),
    ("version", "../../etc", "invalid release version"),
    ("filename", "terraform_1.10.5_linux_amd64.zip", "is not an archive of"),
    ("filename", "../../../x.zip", "is not an archive of"),
    ("sha256", "0" * 63, "is not valid"),
    ("archive", "not/listed.zip", "is not a member listed"),
    ("signatures", {"evil.sig": "x"}, "is not such a file"),
    ("signatures", [], "is not an object of file names"),
    ("extras", {"terraform_1.11.4_SHA256SUMS.pem": "x"}, "is not such a file"),
]


def test_hostile_release_entries_refuse_the_bundle_cleanly(
        tmp_path: Path, exported: Path, release_keys: Path) -> None:
    inside = _inside(tmp_path, release_keys)
    for field, value, message in HOSTILE_ENTRIES:
        members, manifest = read_bundle(exported)
        entry = next(r for r in manifest["releases"] if r["product"] == "terraform")
        entry[field] = value
        forged = write_bundle(tmp_path / "forged.tar", members, manifest)
        result = cli("import", "--config", str(inside), "--allow-unsigned-bundle",
                     str(forged), cwd=tmp_path)
        assert result.returncode == 2, (field, result.stdout)
        assert message in result.stderr and "Traceback" not in result.stderr, field
        assert not (tmp_path / "inside" / "releases").exists()
