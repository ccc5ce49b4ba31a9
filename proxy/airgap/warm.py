"""`tf-registry-proxy warm`: fill the cache ahead of time by asking a proxy (a running one, or
one started in this process on the cache directory) for everything a set of requirements
needs, exactly as clients would: the same verification as a live miss, and resumable, since
what is already cached is a hit."""

from __future__ import annotations

import asyncio
import os
import ssl
import sys
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any, TextIO
from urllib.parse import urljoin, urlsplit

import aiohttp
from aiohttp import web

from proxy.airgap.sources import CliRequirement, Requirement
from proxy.app import create_app
from proxy.config.settings import AuthConfig, Config
from proxy.core.constraints import newest_matching
from proxy.core.redaction import excerpt, mask_secrets
from proxy.core.releases import TERRAFORM, product_named
from proxy.protocols.release_documents import version_directory

_CONCURRENCY = 4
_CHUNK = 1 << 20


@dataclass
class WarmResult:
    """What warming one requirement did."""

    requirement: Requirement | CliRequirement
    version: str = ""
    items: int = 0
    bytes: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether everything asked for is now cached."""
        return bool(self.version) and not self.problems


class _Progress:
    """One line per item fetched: count, bytes, what."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.items = 0
        self.bytes = 0

    def done(self, what: str, size: int) -> None:
        self.items += 1
        self.bytes += size
        self.out.write(f"[{self.items} items, {self.bytes / 2**20:,.1f} MiB] "
                       f"{mask_secrets(what)}\n")
        self.out.flush()


async def warm(base_url: str, requirements: list[Requirement | CliRequirement],
               platforms: list[str],
               context: ssl.SSLContext | None = None, token: str | None = None,
               out: TextIO | None = None, unix_socket: str | None = None
               ) -> list[WarmResult]:
    """Warm through the proxy at base_url (over unix_socket if given); returns one result
    per requirement."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    # sys.stderr as it is now (a default argument would be the one at import time).
    progress = _Progress(sys.stderr if out is None else out)
    limit = asyncio.Semaphore(_CONCURRENCY)
    connector: aiohttp.BaseConnector = (
        aiohttp.UnixConnector(path=unix_socket) if unix_socket is not None
        else aiohttp.TCPConnector(ssl=context if context is not None else False))
    timeout = aiohttp.ClientTimeout(total=None, sock_read=300)
    async with aiohttp.ClientSession(base_url, headers=headers, connector=connector,
                                     timeout=timeout) as session:
        async def one(requirement: Requirement | CliRequirement) -> WarmResult:
            async with limit:
                result = WarmResult(requirement)
                try:
                    if isinstance(requirement, CliRequirement):
                        await _cli(session, requirement, platforms, result, progress)
                    elif requirement.kind == "provider":
                        await _provider(session, requirement, platforms, result, progress)
                    else:
                        await _module(session, requirement, result, progress)
                except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError,
                        TypeError, AssertionError) as exc:  # whatever a proxy answered
                    # Error bodies and URLs (signed ones too) are whatever a proxy answered.
                    result.problems.append(mask_secrets(str(exc) or type(exc).__name__))
                return result

        return list(await asyncio.gather(*(one(r) for r in requirements)))


async def _json(session: aiohttp.ClientSession, path: str) -> tuple[str, dict[str, object]]:
    async with session.get(path) as response:
        if response.status != 200:
            body = await response.text()
            raise ValueError(f"{path}: HTTP {response.status} {excerpt(body, 300)}")
        return str(response.url), await response.json()


async def _fetch(session: aiohttp.ClientSession, url: str) -> int:
    size = 0
    async with session.get(url) as response:
        if response.status != 200:
            raise ValueError(f"{url}: HTTP {response.status}")
        async for chunk in response.content.iter_chunked(_CHUNK):
            size += len(chunk)
    return size


def _pick(versions: list[str], requirement: Requirement | CliRequirement) -> str:
    version = newest_matching(versions, requirement.constraint)
    if version is None:
        raise ValueError(f"no version of {requirement.address} matches "
                         f"{requirement.constraint or 'any'!r}")
    return version


async def _provider(session: aiohttp.ClientSession, requirement: Requirement,
                    platforms: list[str], result: WarmResult, progress: _Progress) -> None:
    base = f"/mirror/{requirement.address}/"
    _url, index = await _json(session, base + "index.json")
    result.version = _pick(list(index["versions"]), requirement)  # type: ignore[call-overload]
    document_url, document = await _json(session, f"{base}{result.version}.json")
    archives = document["archives"]
    assert isinstance(archives, dict)
    for platform in platforms:
        if platform not in archives:
            result.problems.append(f"{result.version} is not available for {platform}")
            continue
        size = await _fetch(session, urljoin(document_url, archives[platform]["url"]))
        result.items += 1
        result.bytes += size
        progress.done(f"{requirement.address} {result.version} {platform}", size)


async def _module(session: aiohttp.ClientSession, requirement: Requirement,
                  result: WarmResult, progress: _Progress) -> None:
    base = f"/modules/{requirement.address}/"
    _url, listing = await _json(session, base + "versions")
    modules = listing["modules"]
    assert isinstance(modules, list)
    result.version = _pick([v["version"] for v in modules[0]["versions"]], requirement)
    _url, download = await _json(session, f"{base}{result.version}/download")
    # The location is on this same proxy; ask for it over this session (scheme and name of
    # the URL are what the proxy believes clients use, which need not be ours).
    location = urlsplit(str(download["location"]))
    size = await _fetch(session, location.path + (f"?{location.query}" if location.query
                                                  else ""))
    result.items += 1
    result.bytes += size
    progress.done(f"{requirement.address} {result.version}", size)


async def _cli(session: aiohttp.ClientSession, requirement: CliRequirement,
               platforms: list[str], result: WarmResult, progress: _Progress) -> None:
    """A CLI release: every archive of each platform (the SHA256SUMS and signatures are
    verified and kept with the first)."""
    product = product_named(requirement.product)
    # What a proxy answered: a wrong shape raises (KeyError, TypeError), a problem of this
    # requirement.
    versions: Any
    if product is TERRAFORM:
        _url, listing = await _json(session, "/releases/terraform/index.json")
        versions = listing["versions"]
        files = {v: [b["filename"] for b in entry["builds"]] for v, entry in versions.items()}
    else:
        _url, listing = await _json(session, "/releases/tofu/api.json")
        versions = listing["versions"]
        files = {entry["id"]: list(entry["files"]) for entry in versions}
    result.version = _pick(list(files), requirement)
    directory = urlsplit(version_directory("/", product, result.version)).path
    for platform in platforms:
        # Every archive of the platform (OpenTofu: the .zip tenv installs, the .tar.gz
        # TofuDL installs).
        names = [name for name in files[result.version]
                 if product.platform_of(result.version, name) == platform]
        if not names:
            result.problems.append(f"{result.version} is not available for {platform}")
        for name in names:
            size = await _fetch(session, directory + name)
            result.items += 1
            result.bytes += size
            progress.done(f"{product.name} {result.version} {name}", size)


async def warm_cache(config: Config, requirements: list[Requirement | CliRequirement],
                     platforms: list[str],
                     out: TextIO | None = None) -> list[WarmResult]:
    """Warm the cache directory of `config` with a proxy started in this process, which
    stops when done. It listens on a unix socket in a private directory: no other local user
    can use it (or the upstream credentials it holds) meanwhile."""
    app = create_app(replace(config, auth=AuthConfig()))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    with tempfile.TemporaryDirectory(prefix="tfproxy-warm-") as private:  # mode 0700
        socket_path = os.path.join(private, "proxy.sock")
        await web.UnixSite(runner, socket_path).start()
        try:
            return await warm("http://localhost", requirements, platforms, out=out,
                              unix_socket=socket_path)
        finally:
            await runner.cleanup()


def summary(results: list[WarmResult]) -> str:
    """A table of what was warmed."""
    rows = [("requirement", "version", "items", "MiB", "result")]
    for r in results:
        rows.append((f"{r.requirement.address} {r.requirement.constraint}".strip(),
                     r.version or "-", str(r.items), f"{r.bytes / 2**20:.1f}",
                     "ok" if r.ok else excerpt("; ".join(r.problems), 120) or "failed"))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join("  ".join(cell.ljust(widths[i]) if i < 4 else cell
                               for i, cell in enumerate(row)) for row in rows) + "\n"
