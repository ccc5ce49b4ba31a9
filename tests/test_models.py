"""Addresses, versions, platforms and hostnames."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from proxy.core.errors import BadRequest
from proxy.core.models import (
    Platform,
    ProviderAddress,
    is_valid_module_version,
    is_valid_version,
    normalize_hostname,
    parse_version,
    version_sort_key,
)


@pytest.mark.parametrize(("given_name", "expected"), [
    ("registry.terraform.io", "registry.terraform.io"),
    ("Registry.Terraform.IO", "registry.terraform.io"),
    ("registry.terraform.io:443", "registry.terraform.io"),
    ("example.com:8443", "example.com:8443"),
    ("bücher.example", "xn--bcher-kva.example"),
    ("xn--bcher-kva.example", "xn--bcher-kva.example"),
    ("localhost", "localhost"),
])
def test_normalize_hostname(given_name: str, expected: str) -> None:
    assert normalize_hostname(given_name) == expected


@pytest.mark.parametrize("bad", [
    "", "a..b", ".a", "a.", "user@host", "host/path", "host:0", "host:99999", "host:x",
    "127.0.0.1", "::1", "[::1]", "169.254.169.254", "a" * 300, "bad host", "xn--zz.example",
    "host\x00.example", "exa%6dple.com", "host:01",
    "host:\u00b9", "host:\u0663",  # digits to str.isdigit: "¹" (int() refuses it), Arabic-Indic 3
])
def test_normalize_hostname_rejects(bad: str) -> None:
    with pytest.raises(BadRequest):
        normalize_hostname(bad)


@given(st.text(max_size=80))
@example(":\u00b9")  # found by this test: "¹".isdigit(), and int() raised
def test_normalize_hostname_never_crashes(text: str) -> None:
    try:
        result = normalize_hostname(text)
    except BadRequest:
        return
    assert result == result.lower() and result.isascii()
    assert "/" not in result and ".." not in result and "@" not in result


@pytest.mark.parametrize("version", ["1.0.0", "0.0.1", "10.20.30", "1.0.0-beta.1",
                                     "1.0.0-rc.1+build.5", "2.0.0+20240101"])
def test_valid_versions(version: str) -> None:
    assert parse_version(version) == version


@pytest.mark.parametrize("version", ["1.0", "v1.0.0", "1.02.0", "01.0.0", "1.0.0-", "latest",
                                     "1.0.0-01", "1.0.0/../x", "", "1.0.0\n",
                                     "1\u0663.0.0", "1.0.0-rc.1\u0663"])  # a Unicode digit
def test_invalid_versions(version: str) -> None:
    assert not is_valid_version(version)
    with pytest.raises(BadRequest):
        parse_version(version)


@pytest.mark.parametrize(("version", "valid"), [
    ("v1.2", True), ("1.2.0.1", True), ("1.0.0-beta", True), ("v1\u0663.0", False),
    ("1.0/../x", False), ("", False),
])
def test_module_versions_are_go_version_shaped_and_ascii(version: str, valid: bool) -> None:
    assert is_valid_module_version(version) is valid


def test_version_ordering_follows_semver() -> None:
    versions = ["1.0.0", "1.0.0-rc.1", "1.0.0-beta.11", "1.0.0-beta.2", "0.9.0", "1.10.0",
                "1.2.0"]
    assert sorted(versions, key=version_sort_key) == [
        "0.9.0", "1.0.0-beta.2", "1.0.0-beta.11", "1.0.0-rc.1", "1.0.0", "1.2.0", "1.10.0"]


def test_provider_address_normalizes() -> None:
    address = ProviderAddress.parse("Registry.Terraform.io", "HashiCorp", "AWS")
    assert str(address) == "registry.terraform.io/hashicorp/aws"


@pytest.mark.parametrize(("namespace", "type_"), [
    ("hashi_corp", "aws"), ("-x", "aws"), ("x-", "aws"), ("a--b", "aws"), ("..", "aws"),
    ("ok", ""), ("ok", "a/b"), ("ok", "x" * 65),
])
def test_provider_address_rejects(namespace: str, type_: str) -> None:
    with pytest.raises(BadRequest):
        ProviderAddress.parse("registry.terraform.io", namespace, type_)


def test_archive_filename_round_trip() -> None:
    address = ProviderAddress.parse("registry.terraform.io", "hashicorp", "google-beta")
    platform = Platform("linux", "amd64")
    name = address.archive_filename("5.0.0-beta.1", platform)
    assert name == "terraform-provider-google-beta_5.0.0-beta.1_linux_amd64.zip"
    assert address.parse_archive_filename(name) == ("5.0.0-beta.1", platform)


@pytest.mark.parametrize("name", [
    "terraform-provider-aws_5.0.0_linux_amd64.tar.gz",
    "terraform-provider-null_5.0.0_linux_amd64.zip",
    "terraform-provider-aws_5.0.0_linux.zip",
    "terraform-provider-aws_5.0_linux_amd64.zip",
    "terraform-provider-aws_5.0.0_linux_AMD64.zip",
    "terraform-provider-aws_5.0.0_linux_../x.zip",
])
def test_archive_filename_rejects(name: str) -> None:
    address = ProviderAddress.parse("registry.terraform.io", "hashicorp", "aws")
    with pytest.raises(BadRequest):
        address.parse_archive_filename(name)


def test_platform_from_key() -> None:
    assert Platform.from_key("darwin_arm64") == Platform("darwin", "arm64")
    for bad in ("linux", "linux_", "_amd64", "Linux_amd64", "linux_amd64_x"):
        with pytest.raises(BadRequest):
            Platform.from_key(bad)
