"""CLI release names, versions, listings and keys: what is accepted before anything names a
URL or a cache key, and the keys the proxy ships."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from proxy.app import create_app
from proxy.config import load_config
from proxy.config.settings import ReleasesConfig
from proxy.core.errors import BadRequest, IntegrityError, NotFound, ProxyError, UpstreamError
from proxy.core.releases import OPENTOFU, TERRAFORM, parse_release_version
from proxy.upstream.releases import opentofu_listing, terraform_listing
from proxy.verification.releases import (
    ReleaseKeyError,
    load_release_keys,
    parse_keys,
    signature_candidates,
    verify_release,
)
from tests.support.gpg import GpgKey

HASHICORP = "C874011F0AB405110D02105534365D9472D7468F"
OPENTOFU_KEY = "E3E6E43D84CB852EADB0051D0C0AF313E5FD9F80"


def test_the_shipped_keys_are_hashicorps_and_opentofus_release_keys() -> None:
    keys = load_release_keys(ReleasesConfig())
    assert keys["terraform"].fingerprints == (HASHICORP,)
    assert keys["opentofu"].fingerprints == (OPENTOFU_KEY,)
    # HashiCorp's keyed signature file is named after the key's last 8 hex digits.
    assert signature_candidates(TERRAFORM, "1.11.4", keys["terraform"]) == [
        "terraform_1.11.4_SHA256SUMS.72D7468F.sig", "terraform_1.11.4_SHA256SUMS.sig"]
    assert signature_candidates(OPENTOFU, "1.9.0", keys["opentofu"]) == [
        "tofu_1.9.0_SHA256SUMS.gpgsig"]


def test_a_key_file_without_a_key_is_refused_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "keys.asc"
    path.write_text("not a key\n")
    with pytest.raises(ReleaseKeyError, match=r"keys\.asc holds no armored OpenPGP public key"):
        load_release_keys(ReleasesConfig(terraform_keys=path))


def test_a_release_verifies_only_with_the_configured_keys(signer: GpgKey,
                                                          impostor: GpgKey) -> None:
    sums = b"a" * 64 + b"  terraform_1.0.0_linux_amd64.zip\n"
    keys = parse_keys(signer.armored_public_key, "test keys")
    verified = verify_release(TERRAFORM, "1.0.0", sums, {
        "terraform_1.0.0_SHA256SUMS.sig": impostor.detach_sign(sums),
        "terraform_1.0.0_SHA256SUMS.ABCDEF12.sig": signer.detach_sign(sums)}, keys)
    # Only the signature that verifies is served with it.
    assert list(verified.signatures) == ["terraform_1.0.0_SHA256SUMS.ABCDEF12.sig"]
    assert verified.checksums == {"terraform_1.0.0_linux_amd64.zip": "a" * 64}
    with pytest.raises(IntegrityError, match="the terraform release keys"):
        verify_release(TERRAFORM, "1.0.0", sums, {
            "terraform_1.0.0_SHA256SUMS.sig": impostor.detach_sign(sums)}, keys)
    with pytest.raises(IntegrityError, match="no signature"):
        verify_release(TERRAFORM, "1.0.0", sums, {}, keys)
    # Another release's SHA256SUMS, validly signed, served under this version's name.
    other = b"a" * 64 + b"  terraform_0.9.0_linux_amd64.zip\n"
    with pytest.raises(IntegrityError, match="is not that release's"):
        verify_release(TERRAFORM, "1.0.0", other,
                       {"terraform_1.0.0_SHA256SUMS.sig": signer.detach_sign(other)}, keys)


@pytest.mark.parametrize(("version", "name", "kind"), [
    ("1.11.4", "terraform_1.11.4_linux_amd64.zip", "archive"),
    ("1.11.4", "terraform_1.11.4_SHA256SUMS", "sums"),
    ("1.11.4", "terraform_1.11.4_SHA256SUMS.sig", "signature"),
    ("1.11.4", "terraform_1.11.4_SHA256SUMS.72D7468F.sig", "signature"),
    ("1.10.0-rc1", "terraform_1.10.0-rc1_darwin_arm64.zip", "archive"),
])
def test_terraform_file_kinds(version: str, name: str, kind: str) -> None:
    assert TERRAFORM.kind_of(version, name) == kind


@pytest.mark.parametrize(("version", "name", "kind"), [
    ("1.9.0", "tofu_1.9.0_linux_amd64.tar.gz", "archive"),
    ("1.9.0", "tofu_1.9.0_SHA256SUMS.gpgsig", "signature"),
    ("1.9.0", "tofu_1.9.0_SHA256SUMS.sig", "extra"),
    ("1.9.0", "tofu_1.9.0_SHA256SUMS.pem", "extra"),
])
def test_opentofu_file_kinds(version: str, name: str, kind: str) -> None:
    assert OPENTOFU.kind_of(version, name) == kind


@pytest.mark.parametrize("name", [
    "terraform_1.11.4_linux_amd64.tar.gz", "terraform_1.11.4_Linux_amd64.zip",
    "terraform_1.11.4_linux_amd64.zip/../x", "terraform_1.11.4_SHA256SUMS.72d7468f.sig",
    "terraform_1.11.4_SHA256SUMS.gpgsig", "terraform_1.11.5_linux_amd64.zip",
    "terraform_1.11.4_linux.zip", "index.json", "", "terraform_1.11.4_a_b_c.zip",
])
def test_names_terraform_does_not_publish_are_unknown(name: str) -> None:
    with pytest.raises(NotFound):
        TERRAFORM.kind_of("1.11.4", name)


@pytest.mark.parametrize("text", ["1.11", "1.11.4.5", "01.1.1", "1.1.1+build", "latest",
                                  "1.1.1-", "../1.1.1", "1.1.1\n", "1.0.0-01", "9" * 80 + ".1.1"])
def test_bad_release_versions_are_refused(text: str) -> None:
    with pytest.raises(BadRequest):
        parse_release_version(text)


def test_a_leading_v_is_dropped_as_version_managers_drop_it() -> None:
    assert parse_release_version("v1.9.0") == "1.9.0"


@given(st.text(max_size=40), st.text(max_size=80))
def test_any_name_is_a_known_kind_or_not_found(version: str, name: str) -> None:
    for product in (TERRAFORM, OPENTOFU):
        try:
            kind = product.kind_of(version, name)
        except NotFound:
            continue
        assert kind in ("archive", "sums", "signature", "extra")
        assert "/" not in name.removeprefix(product.prefix) or kind != "archive"


def test_upstream_listings_keep_only_valid_versions_and_published_names() -> None:
    terraform = terraform_listing({"versions": {
        "1.11.4": {"builds": [{"filename": "terraform_1.11.4_linux_amd64.zip"},
                              {"filename": "../../evil"}, "junk"],
                   "shasums": "terraform_1.11.4_SHA256SUMS",
                   "shasums_signatures": ["terraform_1.11.4_SHA256SUMS.72D7468F.sig", 5]},
        "not-a-version": {"builds": []}, "1.0.0": "junk"}})
    assert terraform == {"1.11.4": ["terraform_1.11.4_linux_amd64.zip",
                                    "terraform_1.11.4_SHA256SUMS",
                                    "terraform_1.11.4_SHA256SUMS.72D7468F.sig"]}
    tofu = opentofu_listing({"versions": [{"id": "1.9.0", "files": [
        "tofu_1.9.0_linux_amd64.zip", "tofu_1.9.0_amd64.deb", "tofu_1.9.0_SHA256SUMS"]},
        {"id": "<script>"}, "junk"]})
    assert tofu == {"1.9.0": ["tofu_1.9.0_linux_amd64.zip", "tofu_1.9.0_SHA256SUMS"]}
    for broken in ({}, {"versions": []}, [], "x", None):
        with pytest.raises(UpstreamError):
            terraform_listing(broken)
    with pytest.raises(UpstreamError):
        opentofu_listing({"versions": {}})


async def test_a_key_file_that_becomes_unusable_stops_the_start_naming_it(
        write_config: Callable[..., Path], tmp_path: Path) -> None:
    keys = tmp_path / "keys.asc"
    keys.write_text("placeholder")  # the config checks the file is there
    config = load_config(write_config(extra=f'[releases]\nopentofu_keys = "{keys}"\n'),
                         environ={})
    runner = web.AppRunner(create_app(config))
    with pytest.raises(ProxyError, match=re.escape(f"{keys} holds no armored OpenPGP")):
        await runner.setup()
    await runner.app.cleanup()


def test_a_key_file_may_hold_several_keys_in_one_armored_block(
        tmp_path: Path, signer: GpgKey, impostor: GpgKey) -> None:
    """`gpg --armor --export K1 K2` writes one block with both keys."""
    merged = tmp_path / "home"
    merged.mkdir(mode=0o700)
    for key in (signer, impostor):
        subprocess.run(["gpg", "--batch", "--import"], input=key.armored_public_key.encode(),
                       capture_output=True, check=True, env={"GNUPGHOME": str(merged)})
    both = subprocess.run(["gpg", "--batch", "--armor", "--export", signer.fingerprint,
                           impostor.fingerprint], capture_output=True, check=True,
                          env={"GNUPGHOME": str(merged)}).stdout
    subprocess.run(["gpgconf", "--kill", "gpg-agent"], env={"GNUPGHOME": str(merged)},
                   capture_output=True, check=False)
    assert both.decode().count("BEGIN PGP PUBLIC KEY BLOCK") == 1
    keys = parse_keys(both.decode(), "both.asc")
    assert set(keys.fingerprints) == {signer.fingerprint.upper(), impostor.fingerprint.upper()}
