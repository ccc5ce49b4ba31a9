"""A download document noted in a facts record for the host's other processes: only URLs
that may be reused and written down, read back as upstream sent them, and nothing from a
note that is stale or malformed."""

from __future__ import annotations

import time
from typing import Any

import pytest

from proxy.core.models import Platform
from proxy.upstream.documents import parse_download, without_upstream_urls
from proxy.verification.noted_downloads import NOTE_FIELD, note_download, noted_download

PLATFORM = Platform.parse("linux", "amd64")
BASE = "https://registry.example/v1/providers/acme/thing/1.0.0/download/linux/amd64"


def _document(**urls: str) -> dict[str, Any]:
    return {"os": "linux", "arch": "amd64", "filename": "thing_1.0.0_linux_amd64.zip",
            "shasum": "a" * 64, "protocols": ["5.0"],
            "download_url": "https://files.example/thing_1.0.0_linux_amd64.zip",
            "shasums_url": "https://files.example/thing_1.0.0_SHA256SUMS",
            "shasums_signature_url": "https://files.example/thing_1.0.0_SHA256SUMS.sig",
            "signing_keys": {"gpg_public_keys": [{"ascii_armor": "KEY"}]}, **urls}


def _noted(document: dict[str, Any]) -> dict[str, Any]:
    record: dict[str, Any] = {"document": without_upstream_urls(document)}
    noted = note_download(record, parse_download(document, BASE, PLATFORM))
    assert noted == (NOTE_FIELD in record)
    return record


def test_a_noted_document_reads_back_as_upstream_sent_it() -> None:
    document = _document()
    taken = noted_download(_noted(document), PLATFORM, 10)
    assert taken == parse_download(document, BASE, PLATFORM)


@pytest.mark.parametrize("url", [
    "https://files.example/thing.zip?X-Amz-Signature=abc",  # a signature: one use
    "https://user:secret@files.example/thing.zip",  # a credential
])
@pytest.mark.parametrize("field", ["download_url", "shasums_url", "shasums_signature_url"])
def test_urls_that_must_not_be_reused_or_written_are_not_noted(field: str, url: str) -> None:
    record = _noted(_document(**{field: url}))
    assert NOTE_FIELD not in record
    assert "secret" not in repr(record) and "Signature" not in repr(record)


def test_nothing_is_taken_from_a_stale_or_a_malformed_note() -> None:
    record = _noted(_document())
    assert noted_download(record, PLATFORM, -1) is None  # stale
    record[NOTE_FIELD]["at"] = time.time() + 60  # from the future (a clock set back)
    assert noted_download(record, PLATFORM, 10) is None
    for note in (None, "x", {"at": time.time()}, {"at": "now", "urls": {}},
                 {"at": time.time(), "urls": {"download_url": "http://x/a.zip"}},
                 {"at": time.time(), "urls": {"download_url": 7}}):
        assert noted_download({**record, NOTE_FIELD: note}, PLATFORM, 10) is None
    # A note whose document is for another platform is not taken either.
    record[NOTE_FIELD]["at"] = time.time()
    assert noted_download(record, PLATFORM, 10) is not None
    assert noted_download(record, Platform.parse("darwin", "arm64"), 10) is None
