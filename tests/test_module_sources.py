"""go-getter source strings as registries return them."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.errors import ProxyError, UpstreamError
from proxy.modules.sources import (
    ModuleSource,
    UnsupportedSource,
    parse_source,
    resolve_location,
    split_subdir,
)

DOWNLOAD = "https://registry.example/v1/modules/acme/net/aws/1.2.0/download"


@pytest.mark.parametrize(("location", "expected"), [
    ("git::https://github.com/acme/terraform-aws-net?ref=v1.2.0",
     ModuleSource("git", "https://github.com/acme/terraform-aws-net", "v1.2.0", "", None)),
    ("git::https://example.com/repo.git//modules/vpc?ref=v1&depth=1",
     ModuleSource("git", "https://example.com/repo.git", "v1", "modules/vpc", None)),
    ("github.com/acme/terraform-aws-net?ref=v1.2.0",
     ModuleSource("git", "https://github.com/acme/terraform-aws-net.git", "v1.2.0", "", None)),
    ("github.com/acme/net//sub",
     ModuleSource("git", "https://github.com/acme/net.git", None, "sub", None)),
    ("https://codeload.github.com/acme/net/tar.gz/v1?archive=tar.gz",
     ModuleSource("http", "https://codeload.github.com/acme/net/tar.gz/v1", None, "", "tar.gz")),
    ("https://cdn.example/m.tgz//*/modules/x?token=abc",
     ModuleSource("http", "https://cdn.example/m.tgz?token=abc", None, "*/modules/x", "tgz")),
    ("https://cdn.example/m.ZIP", ModuleSource("http", "https://cdn.example/m.ZIP", None, "",
                                                "zip")),
    ("https://cdn.example/m.tar.xz//a/./b/",
     ModuleSource("http", "https://cdn.example/m.tar.xz", None, "a/b", "tar.xz")),
])
def test_supported_sources(location: str, expected: ModuleSource) -> None:
    assert parse_source(location) == expected


@pytest.mark.parametrize(("location", "message"), [
    ("s3::https://s3.amazonaws.com/bucket/m.zip", "'s3'"),
    ("gcs::https://www.googleapis.com/storage/v1/b/m.zip", "'gcs'"),
    ("hg::https://example.com/repo", "'hg'"),
    ("git@github.com:acme/net.git", "ssh"),
    ("git::ssh://git@github.com/acme/net.git", "https"),
    ("git::https://example.com/r.git?sshkey=abc", "ssh key"),
    ("acme/other/aws", "not a URL"),
    ("./local/path", "not a URL"),
    ("http://plain.example/m.zip", "https"),
    ("https://cdn.example/m.rar?archive=rar", "'rar'"),
])
def test_unsupported_sources(location: str, message: str) -> None:
    with pytest.raises(UnsupportedSource, match=message):
        parse_source(location)


@pytest.mark.parametrize("location", [
    "https://cdn.example/m.zip//../../etc", "https://cdn.example/m.zip///etc",
    "git::https://e.example/r.git?ref=--upload-pack=x", "git::https://e.example/r.git?ref=a..b",
    "", "x" * 5000, "https://cdn.example/m.zip\n",
])
def test_hostile_sources(location: str) -> None:
    with pytest.raises(UpstreamError):
        parse_source(location)


def test_split_subdir() -> None:
    assert split_subdir("https://h/p.zip//sub/dir?x=1") == ("https://h/p.zip?x=1", "sub/dir")
    assert split_subdir("https://h/p.zip") == ("https://h/p.zip", "")
    assert split_subdir("github.com/a/b//c") == ("github.com/a/b", "c")


@pytest.mark.parametrize(("location", "expected"), [
    ("/archives/m.tgz", "https://registry.example/archives/m.tgz"),
    ("./m.tgz", "https://registry.example/v1/modules/acme/net/aws/1.2.0/m.tgz"),
    ("../m.tgz", "https://registry.example/v1/modules/acme/net/aws/m.tgz"),
    ("git::https://x.example/r.git", "git::https://x.example/r.git"),
])
def test_resolve_location(location: str, expected: str) -> None:
    assert resolve_location(location, DOWNLOAD) == expected


@given(st.text(max_size=200))
def test_any_location_parses_or_is_refused_cleanly(location: str) -> None:
    try:
        source = parse_source(location)
    except ProxyError:
        return
    assert source.url.startswith("https://")
    assert ".." not in source.subdir.split("/") and not source.subdir.startswith("/")
