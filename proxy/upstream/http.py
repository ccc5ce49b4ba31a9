"""Bounded, verified outbound HTTPS: timeouts, size caps, redirect limit, https only."""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import aiofiles
import aiohttp
from multidict import CIMultiDict
from yarl import URL

from proxy.config import UpstreamConfig
from proxy.core.activity import Activity
from proxy.core.errors import (
    IntegrityError,
    Offline,
    UpstreamError,
    UpstreamNotFound,
    UpstreamTimeout,
)
from proxy.core.held import keep_recent
from proxy.core.metrics import Metrics
from proxy.core.redaction import excerpt
from proxy.upstream.egress import EgressPolicy, GuardedResolver, outbound_proxy

log = logging.getLogger(__name__)

MAX_JSON_BYTES = 1 << 20  # what Terraform and OpenTofu accept for registry documents
MAX_REDIRECTS = 5
DOWNLOAD_STALL_SECONDS = 60.0  # a download with no byte for this long fails
_REDIRECTS = (301, 302, 303, 307, 308)
_CHUNK = 1 << 16
# What a download may hold in memory before it stops reading from upstream: enough for the
# network to go on while the fill hashes and writes the bytes before (aiohttp's default,
# 64 KiB, stopped the socket many times per MiB).
_DOWNLOAD_BUFFER = 1 << 20
_WRITE_SIZE = 1 << 20  # what a download to a file writes at a time
USER_AGENT = "tf-registry-proxy/0.1"
# How long an idle connection to upstream is kept for the next request (aiohttp's default,
# named here: warm_connection counts on it).
KEEPALIVE_SECONDS = 15.0
# An origin this process exchanged with this recently still has a connection in the pool
# (most likely: upstream may close idle ones sooner): warming one would add a second.
_RECENTLY_USED = KEEPALIVE_SECONDS * 2 / 3
_MOST_ORIGINS = 256  # origins whose last exchange is remembered (the oldest forgotten)


def make_ssl_context(config: UpstreamConfig) -> ssl.SSLContext:
    """System trust store plus the configured extra CA bundle; verification always on."""
    context = ssl.create_default_context()
    if config.ca_bundle is not None:
        context.load_verify_locations(cafile=str(config.ca_bundle))
    return context


def make_session(config: UpstreamConfig, egress: EgressPolicy) -> aiohttp.ClientSession:
    """The one outbound session; every name it resolves passes the egress policy. It does
    not read the environment (trust_env would send ~/.netrc credentials to any host that
    asks): each request names its HTTPS_PROXY itself (see UpstreamHTTP._open)."""
    connector = aiohttp.TCPConnector(ssl=make_ssl_context(config), limit=64,
                                     ttl_dns_cache=60, resolver=GuardedResolver(egress),
                                     keepalive_timeout=KEEPALIVE_SECONDS)
    # Bytes are verified and served exactly as published: ask for no content coding at all
    # (aiohttp would otherwise offer gzip) and refuse answers that use one anyway.
    return aiohttp.ClientSession(
        connector=connector,
        trust_env=False,
        headers={"User-Agent": USER_AGENT, "Accept-Encoding": "identity"},
        skip_auto_headers=("Accept-Encoding",),
        auto_decompress=False,
    )


@dataclass(frozen=True)
class Fetched:
    """A small upstream body with the URL it finally came from."""

    url: str
    status: int
    content_type: str
    body: bytes
    headers: CIMultiDict[str]


@dataclass(frozen=True)
class Download:
    """An open download: its chunks, and its size when upstream said it."""

    chunks: AsyncIterator[bytes]
    size: int | None


class UpstreamHTTP:
    """GET with bounded redirects and sizes; errors become ProxyErrors."""

    def __init__(self, session: aiohttp.ClientSession, config: UpstreamConfig,
                 metrics: Metrics, egress: EgressPolicy, activity: Activity) -> None:
        self._session = session
        self._config = config
        self._metrics = metrics
        self.egress = egress
        self.activity = activity
        # origin (as origin_of gives it) -> monotonic time of its last exchange
        self._last_used: OrderedDict[str, float] = OrderedDict()

    def _timeout(self, total: float) -> aiohttp.ClientTimeout:
        # sock_read catches a stalled transfer long before the total deadline; a package
        # download may take a while to start, a metadata answer may not.
        stall = self._config.metadata_timeout if total <= self._config.metadata_timeout \
            else min(total, DOWNLOAD_STALL_SECONDS)
        return aiohttp.ClientTimeout(total=total, sock_connect=self._config.connect_timeout,
                                     sock_read=stall)

    @asynccontextmanager
    async def _open(self, url: str, origin: str, total: float,
                    headers: dict[str, str] | None = None, authenticate: bool = False,
                    read_bufsize: int | None = None
                    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """Follow redirects by hand so every hop is checked (https only, bounded count).
        With `authenticate`, the proxy's token for the origin registry goes along, to the
        first URL's host only (never across a redirect to another host). Each exchange is
        recorded as the origin's success or failure (the status page)."""
        if self._config.offline:  # the one gate every outbound request passes
            raise Offline(f"not in the cache, and the proxy is offline (upstream {origin})")
        try:
            async with self._exchange(url, origin, total, headers, authenticate,
                                      read_bufsize) as response:
                yield response
        except IntegrityError:  # it answered; bytes that fail verification are listed apart
            raise
        except UpstreamError as exc:  # upstream's failure, or its answer's (a size cap)
            self.activity.upstream_failed(origin, exc.message)
            raise
        if response.status >= 500:
            self.activity.upstream_failed(origin, f"upstream {origin} answered "
                                                  f"{response.status}")
        else:
            self.activity.upstream_succeeded(origin)

    @asynccontextmanager
    async def _exchange(self, url: str, origin: str, total: float,
                        headers: dict[str, str] | None, authenticate: bool,
                        read_bufsize: int | None) -> AsyncIterator[aiohttp.ClientResponse]:
        """One request, its redirects followed (see _open), counted in the metrics."""
        started = time.monotonic()
        outcome = "error"
        token = self._config.token_for(origin) if authenticate else None
        token_netloc = urlsplit(url).netloc
        try:
            for _hop in range(MAX_REDIRECTS + 1):
                _require_https(url)
                await self.egress.check_target(url)
                hop_headers = dict(headers or {})
                hop = urlsplit(url)
                # Credentials written into the URL are the more specific ones; aiohttp refuses
                # both at once (ValueError), which reached clients as a 500.
                if token is not None and hop.netloc == token_netloc and not hop.username:
                    hop_headers["Authorization"] = f"Bearer {token}"
                proxy, proxy_headers = _proxy_for(url)
                async with self._session.get(url, allow_redirects=False, headers=hop_headers,
                                             proxy=proxy, proxy_headers=proxy_headers,
                                             timeout=self._timeout(total),
                                             read_bufsize=read_bufsize) as response:
                    if response.status in _REDIRECTS and "Location" in response.headers:
                        url = _redirect_target(url, response.headers["Location"], origin)
                        continue
                    encoding = response.headers.get("Content-Encoding", "identity").lower()
                    if encoding not in ("", "identity"):
                        raise UpstreamError(f"upstream {origin} answered with content coding "
                                            f"{encoding[:40]!r} although none was accepted")
                    outcome = _outcome(response.status)
                    yield response
                    return
            outcome = "error"
            raise UpstreamError(f"upstream {origin}: more than {MAX_REDIRECTS} redirects")
        except TimeoutError:
            outcome = "timeout"
            raise UpstreamTimeout(f"upstream {origin} did not answer in time") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"cannot reach upstream {origin}: {_describe(exc)}") from None
        finally:
            self._note_used(origin_of(url))
            self._metrics.upstream_requests.labels(origin, outcome).inc()
            self._metrics.upstream_latency.labels(origin).observe(time.monotonic() - started)

    async def warm_connection(self, origin: str) -> bool:
        """Open a connection to `origin` (https://host[:port]) and leave it idle in the pool
        for the download expected there next (see proxy.upstream.warm_connections); whether
        it did. Nothing is sent on it. Not offline, not through an outbound proxy, not when
        an exchange with origin ended moments ago (its connection is still there); the
        egress policy applies as to any request (UpstreamError when it refuses)."""
        if self._config.offline or outbound_proxy(origin) is not None:
            return False
        used = self._last_used.get(origin)
        if used is not None and time.monotonic() - used < _RECENTLY_USED:
            return False
        _require_https(origin)
        await self.egress.check_target(origin)
        connector = self._session.connector
        assert connector is not None  # the session owns one (make_session)
        # aiohttp has no public call for this: a connection is made for a request, which is
        # never sent. Released at once, it waits in the pool under the key of any GET to
        # origin (same host, port, TLS settings and no proxy).
        request = aiohttp.ClientRequest("GET", URL(origin), loop=asyncio.get_running_loop(),
                                        ssl=True)
        timeout = aiohttp.ClientTimeout(total=self._config.connect_timeout,
                                        sock_connect=self._config.connect_timeout)
        connection = await connector.connect(request, [], timeout)
        connection.release()
        self._note_used(origin)
        return True

    def _note_used(self, origin: str | None) -> None:
        if origin is not None:
            keep_recent(self._last_used, origin, time.monotonic(), _MOST_ORIGINS)

    async def get(self, url: str, origin: str, max_bytes: int,
                  accept: str = "application/json", authenticate: bool = False) -> Fetched:
        """GET a small document whatever its status; the body is capped at max_bytes."""
        async with self._open(url, origin, self._config.metadata_timeout,
                              {"Accept": accept}, authenticate) as response:
            body = await _read_capped(response, max_bytes, origin)
            self._metrics.upstream_bytes.labels("metadata").inc(len(body))
            return Fetched(str(response.url), response.status,
                           response.headers.get("Content-Type", ""), body,
                           CIMultiDict(response.headers))

    async def get_json(self, url: str, origin: str,
                       authenticate: bool = False) -> tuple[str, object]:
        """GET a JSON document that must exist: 404 -> NotFound, other non-200 -> 502."""
        fetched = await self.get(url, origin, MAX_JSON_BYTES, authenticate=authenticate)
        _require_ok(fetched, origin)
        try:
            return fetched.url, json.loads(fetched.body)
        except (ValueError, RecursionError):  # bad UTF-8 or JSON, absurd numbers or nesting
            raise UpstreamError(f"upstream {origin} answered invalid JSON for "
                                f"{excerpt(url, 200)}") from None

    async def get_bytes(self, url: str, origin: str, max_bytes: int = MAX_JSON_BYTES) -> bytes:
        """GET a small file that must exist (SHA256SUMS, signatures)."""
        fetched = await self.get(url, origin, max_bytes, accept="*/*")
        _require_ok(fetched, origin)
        return fetched.body

    @asynccontextmanager
    async def stream(self, url: str, origin: str, max_bytes: int) -> AsyncIterator[Download]:
        """Open a large download; its chunk iterator enforces max_bytes."""
        async with self._open(url, origin, self._config.download_timeout,
                              {"Accept": "*/*"}, read_bufsize=_DOWNLOAD_BUFFER) as response:
            if response.status != 200:
                raise UpstreamError(f"upstream {origin} answered {response.status} for a "
                                    "package download")
            length = response.content_length
            if length is not None and length > max_bytes:
                raise UpstreamError(f"upstream {origin} package is {length} bytes, over the "
                                    f"{max_bytes}-byte limit")
            yield Download(self._chunks(response, origin, max_bytes), length)

    async def download(self, url: str, origin: str, destination: Path, max_bytes: int) -> int:
        """Stream a file to destination (a temp path of the caller's); returns its size."""
        size = written = 0
        pending: list[bytes] = []  # pieces as they came: one write (a thread hop) per MiB
        async with self.stream(url, origin, max_bytes) as download, \
                aiofiles.open(destination, "wb") as handle:
            async for chunk in download.chunks:
                size += len(chunk)
                pending.append(chunk)
                if size - written >= _WRITE_SIZE:
                    await handle.write(b"".join(pending))
                    pending.clear()
                    written = size
            await handle.write(b"".join(pending))
        return size

    async def _chunks(self, response: aiohttp.ClientResponse, origin: str,
                      max_bytes: int) -> AsyncIterator[bytes]:
        seen = 0
        try:
            # Each piece as it came in (no joining copies); empty at a chunk's end.
            async for chunk, _end in response.content.iter_chunks():
                if not chunk:
                    continue
                seen += len(chunk)
                if seen > max_bytes:
                    raise UpstreamError(f"upstream {origin} package exceeds the "
                                        f"{max_bytes}-byte limit")
                self._metrics.upstream_bytes.labels("package").inc(len(chunk))
                yield chunk
        except TimeoutError:
            raise UpstreamTimeout(f"upstream {origin} download stalled") from None
        except aiohttp.ClientError as exc:
            raise UpstreamError(f"upstream {origin} download failed: {_describe(exc)}") from None


def _proxy_for(url: str) -> tuple[URL | None, dict[str, str] | None]:
    """The outbound proxy for url and the headers of the tunnel request (its credentials)."""
    proxy = outbound_proxy(url)
    if proxy is None:
        return None, None
    address, auth = proxy
    return address, ({"Proxy-Authorization": auth.encode()} if auth is not None else None)


def _redirect_target(url: str, location: str, origin: str) -> str:
    try:
        return urljoin(url, location)
    except ValueError:
        raise UpstreamError(f"upstream {origin} redirected to an invalid URL") from None


def origin_of(url: str) -> str | None:
    """https://host[:port] of an https URL (no credentials, path or query; the default port
    left out), else None."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # e.g. an unclosed IPv6 bracket from a hostile redirect
        return None
    host = parts.hostname
    if parts.scheme != "https" or not host or not host.isascii() or parts.username \
            or parts.password:
        return None
    if ":" in host:
        host = f"[{host}]"
    return f"https://{host}" + (f":{port}" if port is not None and port != 443 else "")


def _require_https(url: str) -> None:
    try:
        parts = urlsplit(url)
        valid = parts.scheme == "https" and bool(parts.hostname)
    except ValueError:
        valid = False
    if not valid:
        raise UpstreamError(f"refusing non-https upstream URL {excerpt(url, 200)!r}")


def _require_ok(fetched: Fetched, origin: str) -> None:
    if fetched.status == 404:
        raise UpstreamNotFound(f"upstream {origin} has no such object")
    if fetched.status != 200:
        raise UpstreamError(f"upstream {origin} answered {fetched.status}")


async def _read_capped(response: aiohttp.ClientResponse, max_bytes: int, origin: str) -> bytes:
    if response.content_length is not None and response.content_length > max_bytes:
        raise UpstreamError(f"upstream {origin} answer is larger than {max_bytes} bytes")
    body = bytearray()
    async for chunk in response.content.iter_chunked(_CHUNK):
        body += chunk
        if len(body) > max_bytes:
            raise UpstreamError(f"upstream {origin} answer is larger than {max_bytes} bytes")
    return bytes(body)


def _outcome(status: int) -> str:
    if status < 300:
        return "ok"
    if status < 500:
        return "client_error"
    return "server_error"


def _describe(exc: BaseException) -> str:
    cause = getattr(exc, "os_error", None)
    if isinstance(cause, OSError) and cause.strerror is None and cause.args:
        return excerpt(str(cause), 300)  # our own refusals (egress policy) say it best
    return excerpt(str(exc) or type(exc).__name__, 300)  # aiohttp's may quote the URL


async def close_session(session: aiohttp.ClientSession) -> None:
    """Close the session and give the transports a moment to shut down cleanly."""
    await session.close()
    await asyncio.sleep(0)
