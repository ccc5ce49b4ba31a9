"""A download document noted with the facts verified from it, for the host's other processes.

Building the VERSION.json a client asks for just before the zip, a process fetches each
platform's download document and verifies its facts. Terraform then fetches the zip on a new
connection, which another worker (or a replica on the same index) may accept: that process
would ask upstream for the document again, a round trip before the first byte. So the facts'
record notes the document's URLs and when; another process's fill takes them within a few
seconds instead of asking, once (the process that noted them holds the document in memory
and counts that as its one use).
Only documents whose URLs hold no query and no user info are noted: a query may carry a
signature that is short-lived or good for one use, user info a credential (such documents are
always asked for anew, and never written to the index)."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import urlsplit

from proxy.core.errors import UpstreamError
from proxy.core.models import Platform
from proxy.upstream.documents import UPSTREAM_URL_FIELDS, DownloadInfo, parse_download

# The field of a package's facts record that holds the note.
NOTE_FIELD = "noted_download"


def note_download(record: dict[str, Any], info: DownloadInfo) -> bool:
    """Note info's URLs in record (the facts about to be saved), unless one of them must not
    be reused or written down; whether it was noted."""
    urls = {name: getattr(info, name) for name in UPSTREAM_URL_FIELDS}
    if not all(reusable_url(url) for url in urls.values()):
        return False
    record[NOTE_FIELD] = {"at": time.time(), "urls": urls}
    return True


def noted_download(record: dict[str, Any], platform: Platform,
                   seconds: float) -> DownloadInfo | None:
    """The download document noted in record at most `seconds` ago, as upstream sent it;
    None if there is none (or it cannot be read back). (Its own note is the noting
    process's to skip: it holds the document in memory.)"""
    note, document = record.get(NOTE_FIELD), record.get("document")
    if not isinstance(note, dict) or not isinstance(document, dict):
        return None
    at, urls = note.get("at"), note.get("urls")
    if not isinstance(at, (int, float)) or not 0 <= time.time() - at <= seconds \
            or not isinstance(urls, dict) or not isinstance(urls.get("download_url"), str):
        return None
    try:  # (only note_download writes a note: its URLs were found reusable then)
        return parse_download({**document, **urls}, urls["download_url"], platform)
    except UpstreamError:
        return None


def reusable_url(url: str) -> bool:
    """Whether a download document's URL may be used again moments later: no query (a
    signature may be short-lived or good for one use), no user info (a credential)."""
    try:
        parts = urlsplit(url)
        return not parts.query and parts.username is None and parts.password is None
    except ValueError:
        return False
