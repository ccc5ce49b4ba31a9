"""Parsing untrusted upstream provider registry documents."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.core.errors import ProxyError, UpstreamError
from proxy.core.models import Platform
from proxy.upstream.discovery import parse_discovery
from proxy.upstream.documents import parse_download, parse_sha256sums, parse_versions

LINUX = Platform("linux", "amd64")
FINAL = "https://registry.example/v1/providers/hashicorp/null/1.0.0/download/linux/amd64"
SHA = "a" * 64


def download_doc(**changes: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "os": "linux", "arch": "amd64", "filename": "terraform-provider-null_1.0.0_linux_amd64.zip",
        "download_url": "/files/x.zip", "shasums_url": "sums", "shasums_signature_url":
        "https://cdn.example/sums.sig", "shasum": SHA,
        "signing_keys": {"gpg_public_keys": [{"ascii_armor": "KEY"}, {"nope": 1}]},
    }
    doc.update(changes)
    return doc


def test_download_document_urls_resolve_against_final_url() -> None:
    info = parse_download(download_doc(), FINAL, LINUX)
    assert info.download_url == "https://registry.example/files/x.zip"
    assert info.shasums_url == ("https://registry.example/v1/providers/hashicorp/null/1.0.0/"
                                "download/linux/sums")
    assert info.shasums_signature_url == "https://cdn.example/sums.sig"
    assert info.signing_keys == ("KEY",)
    assert info.shasum == SHA


@pytest.mark.parametrize("changes", [
    {"os": "darwin"}, {"arch": None}, {"filename": "../../etc/passwd"}, {"filename": ""},
    {"filename": 7}, {"shasum": "A" * 64}, {"shasum": "abc"}, {"download_url": ""},
    {"download_url": "http://plain.example/x.zip"}, {"shasums_url": None},
    {"shasums_signature_url": "ftp://x/y"},
])
def test_download_document_rejects(changes: dict[str, Any]) -> None:
    with pytest.raises(UpstreamError):
        parse_download(download_doc(**changes), FINAL, LINUX)


def test_download_document_must_be_an_object() -> None:
    with pytest.raises(UpstreamError):
        parse_download(["x"], FINAL, LINUX)


def test_versions_keep_valid_entries_and_platforms() -> None:
    entries = parse_versions({"versions": [
        {"version": "1.0.0", "protocols": ["5.0", 6],
         "platforms": [{"os": "linux", "arch": "amd64"}, {"os": "../x", "arch": "y"},
                       {"os": "linux", "arch": "amd64"}, "junk"]},
        {"version": "1.0"}, {"version": None}, [], {"version": "2.0.0"},
    ]})
    assert [e.version for e in entries] == ["1.0.0", "2.0.0"]
    assert entries[0].platforms == (LINUX,)
    assert entries[0].protocols == ("5.0",)
    assert entries[1].platforms == ()


@pytest.mark.parametrize("doc", [None, [], {"versions": {}}, {"other": []}])
def test_malformed_versions_document_is_refused(doc: object) -> None:
    with pytest.raises(UpstreamError):
        parse_versions(doc)


def test_sha256sums_keeps_well_formed_lines_lowercased() -> None:
    text = (f"{SHA}  a.zip\n{'B' * 64} *b.zip\n\nnot a line\n{'c' * 63}  short.zip\n").encode()
    assert parse_sha256sums(text) == {"a.zip": SHA, "b.zip": "b" * 64}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20)


url_like = st.one_of(
    st.text(alphabet="htps:/[]%.@x1?#\\ ", max_size=30),
    st.sampled_from(["//[x", "https://[", "http://a/b", "https://a/b", "/rel", "../up", "",
                     "https://user@host/x", "javascript:alert(1)", "https://a:99999/"]))
versions = st.one_of(st.text(max_size=12), st.sampled_from(["1.0.0", "v1.0.0", "1.0"]),
                     json_values)
platforms = st.lists(st.one_of(
    st.fixed_dictionaries({"os": st.text(max_size=8), "arch": st.text(max_size=8)}),
    json_values), max_size=4)


@given(st.lists(st.one_of(
    st.fixed_dictionaries({"version": versions, "platforms": platforms,
                           "protocols": st.one_of(json_values, st.lists(st.text(max_size=4)))}),
    json_values), max_size=6))
def test_hostile_versions_documents_never_crash(items: list[object]) -> None:
    try:
        entries = parse_versions({"versions": items})
    except ProxyError:
        return
    for entry in entries:
        assert isinstance(entry.version, str) and "/" not in entry.version
        assert all(p.os.isalnum() and p.arch.isalnum() for p in entry.platforms)


@given(st.fixed_dictionaries({}, optional={
    "filename": st.one_of(json_values, st.text(max_size=20)),
    "shasum": st.one_of(json_values, st.just(SHA), st.text(alphabet="0123456789abcdef",
                                                           min_size=63, max_size=65)),
    "download_url": url_like, "shasums_url": url_like, "shasums_signature_url": url_like,
    "signing_keys": json_values,
}))
def test_hostile_download_documents_never_crash(changes: dict[str, Any]) -> None:
    try:
        info = parse_download(download_doc(**changes), FINAL, LINUX)
    except ProxyError:
        return
    for url in (info.download_url, info.shasums_url, info.shasums_signature_url):
        assert url.startswith("https://")
    assert "/" not in info.filename and ".." != info.filename


@given(st.binary(max_size=200), st.sampled_from(["application/json", "text/html", ""]))
def test_hostile_discovery_bodies_never_crash(body: bytes, content_type: str) -> None:
    services = parse_discovery(body, content_type, FINAL)
    assert services is None or all(u.startswith("https://") for u in services.values())


@given(st.dictionaries(st.sampled_from(["providers.v1", "modules.v1", "login.v1"]),
                       st.one_of(url_like, json_values)))
def test_hostile_discovery_documents_never_crash(document: dict[str, object]) -> None:
    services = parse_discovery(json.dumps(document).encode(), "application/json", FINAL)
    assert services is not None
    assert all(u.startswith("https://") and u.endswith("/") for u in services.values())
