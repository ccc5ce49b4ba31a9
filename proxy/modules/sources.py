"""Parsing of module source locations (go-getter syntax), as registries return them in
`X-Terraform-Get` or `location`. Pure: no I/O.

Supported: https archives (`?archive=` or a known extension) and `git::https://...?ref=`
(plus the `github.com/owner/repo` shorthand), each with an optional `//subdir`. Everything else
(s3::, gcs::, hg::, ssh git, another registry address) is refused with a clear error.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urljoin, urlsplit, urlunsplit

from proxy.core.errors import UpstreamError
from proxy.core.redaction import excerpt

ARCHIVE_FORMATS = ("tar.gz", "tgz", "zip", "tar.xz", "txz", "tar.bz2", "tbz2", "tar")
_FORCED = re.compile(r"^([A-Za-z0-9]+)::(.+)$", re.DOTALL)
_GITHUB_SHORTHAND = re.compile(r"^github\.com/([A-Za-z0-9_.-]+)/([A-Za-z0-9_.-]+)(.*)$")
_GIT_REF = re.compile(r"^[A-Za-z0-9._/+-]{1,200}$")
_MAX_LOCATION = 4096


def _shown(text: str) -> str:
    """A location as error messages quote it: short, credentials masked."""
    return excerpt(text, 200)


class UnsupportedSource(UpstreamError):
    """The location names a source type the proxy cannot fetch itself."""


@dataclass(frozen=True)
class ModuleSource:
    """A fetchable module source."""

    kind: str            # "git" or "http"
    url: str             # https URL without getter-specific query parameters
    ref: str | None      # git ref (tag, branch or commit); None means the default branch
    subdir: str          # path inside the fetched tree ("" for its root); may hold globs
    archive: str | None  # archive format for http sources


def resolve_location(location: str, download_url: str) -> str:
    """Locations starting with `/`, `./` or `../` are relative to the download URL; anything
    else is a go-getter source string used as is."""
    if location.startswith(("/", "./", "../")):
        try:
            return urljoin(download_url, location)
        except ValueError:
            raise UpstreamError(f"invalid module location {_shown(location)!r}") from None
    return location


def parse_source(location: str) -> ModuleSource:
    """Parse a go-getter source string into something the proxy can fetch."""
    try:
        return _parse_source(location)
    except ValueError:  # urllib on malformed URLs, e.g. an invalid IPv6 literal
        raise UpstreamError(f"invalid module location {_shown(location)!r}") from None


def _parse_source(location: str) -> ModuleSource:
    if not location or len(location) > _MAX_LOCATION or not location.isprintable():
        raise UpstreamError("upstream module location is empty, too long or not printable")
    forced, rest = None, location
    match = _FORCED.match(location)
    if match:
        forced, rest = match.group(1).lower(), match.group(2)
    rest, subdir = split_subdir(rest)
    if forced is None:
        shorthand = _GITHUB_SHORTHAND.match(rest)
        if shorthand:
            owner, repo, tail = shorthand.groups()
            repo = repo if repo.endswith(".git") else repo + ".git"
            forced, rest = "git", f"https://github.com/{owner}/{repo}{tail}"
        elif rest.startswith("git@"):
            raise UnsupportedSource(f"module source over ssh is not supported: {_shown(location)}")
        elif "://" not in rest:
            raise UnsupportedSource(
                f"module source {_shown(location)!r} is not a URL (another registry address or "
                "a local path); only https archives and git over https are supported")
        else:
            forced = "http"
    if forced == "git":
        return _git_source(rest, subdir, location)
    if forced in ("http", "https"):
        return _http_source(rest, subdir, location)
    raise UnsupportedSource(f"module source type {forced!r} is not supported "
                            f"(only https archives and git over https): {_shown(location)}")


def split_subdir(source: str) -> tuple[str, str]:
    """go-getter's `//subdir` split: the first `//` after the scheme's `://` starts the
    subdirectory, which runs to the query string."""
    scheme_end = source.find("://")
    start = scheme_end + 3 if scheme_end >= 0 else 0
    index = source.find("//", start)
    if index < 0:
        return source, ""
    head, tail = source[:index], source[index + 2:]
    subdir, sep, query = tail.partition("?")
    return head + (sep + query if sep else ""), subdir


def clean_subdir(subdir: str) -> str:
    """A relative, normalized subdirectory; `..`, absolute paths and backslashes refused."""
    if not subdir:
        return ""
    if subdir.startswith("/") or "\\" in subdir or "\0" in subdir:
        raise UpstreamError(f"invalid module subdirectory {_shown(subdir)!r}")
    normalized = posixpath.normpath(subdir)
    if normalized == ".":
        return ""
    if normalized == ".." or normalized.startswith("../"):
        raise UpstreamError(f"module subdirectory escapes the source: {_shown(subdir)!r}")
    return normalized


def _git_source(url: str, subdir: str, location: str) -> ModuleSource:
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise UnsupportedSource(f"git module sources must use https: {_shown(location)}")
    query = parse_qsl(parts.query, keep_blank_values=True)
    ref = None
    kept = []
    for key, value in query:
        if key == "ref":
            if not _GIT_REF.match(value) or value.startswith("-") or ".." in value:
                raise UpstreamError(f"invalid git ref {value[:100]!r}")
            ref = value
        elif key == "depth":
            continue  # a full clone serves every ref; dumb-HTTP servers cannot go shallow
        elif key == "sshkey":
            raise UnsupportedSource("git module sources with an ssh key are not supported")
        else:
            kept.append((key, value))
    clean = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(kept), ""))
    return ModuleSource("git", clean, ref, clean_subdir(subdir), None)


def _http_source(url: str, subdir: str, location: str) -> ModuleSource:
    parts = urlsplit(url)
    if parts.scheme != "https" or not parts.hostname:
        raise UnsupportedSource(f"module archives must be fetched over https: {_shown(location)}")
    archive = None
    kept = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        if key == "archive":
            archive = value.lower()
        else:
            kept.append((key, value))
    if archive is None:
        archive = next((f for f in ARCHIVE_FORMATS if parts.path.lower().endswith("." + f)),
                       None)
    if archive is not None and archive not in ARCHIVE_FORMATS:
        raise UnsupportedSource(f"module archive format {archive!r} is not supported")
    clean = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(kept), ""))
    return ModuleSource("http", clean, None, clean_subdir(subdir), archive)
