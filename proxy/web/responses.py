"""Response helpers: protocol JSON documents, files sent from the cache or while they are
still being downloaded, and the one way a response that fails after its headers ends."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import IO, Any

from aiohttp import hdrs, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.web_fileresponse import NOSENDFILE, _FileResponseResult
from prometheus_client import Counter

from proxy.core.errors import InsufficientStorage, IntegrityError, ProxyError, Unavailable
from proxy.core.executors import quick_soon
from proxy.core.file_reads import ChunkReader
from proxy.core.json_bodies import JsonBody
from proxy.core.redaction import mask_secrets
from proxy.core.spool import GrowingFile
from proxy.core.waits import watching_waits
from proxy.store.damage import DamagedFile
from proxy.store.protocol import BlobInfo, BlobStore, OpenBlob
from proxy.web.access_log import ABORTED_KEY, CACHE_RESULT_KEY
from proxy.web.quick_answers import holds

log = logging.getLogger(__name__)


def json_response(document: dict[str, Any], status: int = 200) -> web.Response:
    """Serialize a protocol document as application/json."""
    return web.Response(status=status, body=json.dumps(document, separators=(",", ":")).encode(),
                        content_type="application/json")


def json_body_response(request: web.Request, document: JsonBody) -> web.Response:
    """Send a serialized document as is, with its strong ETag; 304 when the client holds it."""
    if_none_match = request.headers.get(hdrs.IF_NONE_MATCH)
    if if_none_match and holds(if_none_match, document.etag):
        return web.Response(status=304, headers={hdrs.ETAG: document.etag})
    # Every header in one dict with aiohttp's own names: its cheapest way in (a hot path).
    return web.Response(body=document.body, headers={hdrs.ETAG: document.etag,
                                                     hdrs.CONTENT_TYPE: "application/json"})


def error_body(message: str) -> bytes:
    """The one error shape, `{"errors": ["..."]}`, secrets masked."""
    return json.dumps({"errors": [mask_secrets(message)]}).encode()


# A file sent through the event loop (under TLS, which rules out sendfile) goes in chunks of
# this size: a chunk, its ciphertext and the TLS buffers stay in the CPU's cache. Measured
# with 8 and 100 clients, 64 KiB cost less CPU per byte than 256 KiB (and 1 MiB more still);
# the per-chunk Python work is the smaller part.
_CHUNK = 64 << 10
# A response sending this much without waiting for its client lets the loop run other work.
_TURN_BYTES = 1 << 20


class _Turns:
    """Counts what a response sends and gives other work on the loop a turn every
    _TURN_BYTES: a client that takes every write at once (its socket never full) would
    otherwise hold the loop until its whole file is sent."""

    def __init__(self) -> None:
        self._since = 0

    async def sent(self, count: int) -> None:
        """count more bytes went out."""
        self._since += count
        if self._since >= _TURN_BYTES:
            self._since = 0
            await asyncio.sleep(0)

# A stored blob may leave the cache (another process evicted it) between being found and
# being opened; it is then looked up again, which fetches it anew. Never in a loop.
_FIND_ATTEMPTS = 3


async def send_file(request: web.Request,
                    find: Callable[[], Awaitable[BlobInfo | GrowingFile[BlobInfo]]],
                    content_type: str, store: BlobStore, served: Counter,
                    headers: Mapping[str, str] | None = None) -> web.StreamResponse:
    """What `find` returns: a stored blob (by sendfile when it is a local file), or a
    download under way as its bytes arrive. Either is sent here, inside the error middleware:
    a failure before the headers becomes a JSON error, one after them cuts the connection
    (see `abort_after_headers`). A stored blob is opened, and so kept from eviction, before
    anything is sent. headers: more headers for the answer."""
    answer_headers = {"Content-Type": content_type, **(headers or {})}
    for _attempt in range(_FIND_ATTEMPTS):
        with watching_waits() as waited:
            source = await find()
        # A stored file the request had to wait for (a fill published meanwhile) is a miss.
        missed = waited[0] or not isinstance(source, BlobInfo) \
            or request.get(CACHE_RESULT_KEY) == "miss"  # an earlier look at it waited
        request[CACHE_RESULT_KEY] = "miss" if missed else "hit"
        if isinstance(source, GrowingFile):
            if request.method != "HEAD":
                return await _stream(request, source, answer_headers, served)
            source = await source.wait_done()
        elif request.method == "GET" and (url := await store.direct_url(source.key)):
            # The operator asked for it: the client fetches the stored object itself.
            return web.Response(status=302, headers={"Location": url})
        try:
            blob = await store.open(source.key)
        except DamagedFile as damage:
            # The bytes failed their check as they were fetched (an object in a shared store
            # that is not what its record vouches for): the store now says it changed, so
            # the lookup checks it again, drops it and fetches it anew.
            log.warning("%s: %s; looking it up again", source.key.rpartition("/")[2],
                        damage.message)
            continue
        if blob is None:
            log.info("%s left the cache before it could be sent; looking it up again",
                     source.key.rpartition("/")[2])
            continue
        try:
            local = blob.local_path
            sent: web.StreamResponse = _BlobResponse(blob, served, answer_headers) \
                if local is None else _OpenFileResponse(local, served, answer_headers)
            await sent.prepare(request)
        finally:
            # On the loop: a hop to a thread, even one not waited for, cost a small hit
            # about half its CPU (wake-ups and GIL hand-overs: 570 against 285 us).
            if blob.quick_to_close():
                blob.close()
            else:
                quick_soon(blob.close)
        return sent
    raise Unavailable("the file kept leaving the cache before it could be sent (the cache "
                      "is too small for its load); try again")


async def _stream(request: web.Request, source: GrowingFile[BlobInfo],
                  headers: dict[str, str], served: Counter) -> web.StreamResponse:
    streamed = web.StreamResponse(headers=headers)
    if source.size is not None:
        streamed.content_length = source.size
    await streamed.prepare(request)
    # A download that fails verification (or cannot be published) raises here, mid-body.
    turns = _Turns()
    async with contextlib.aclosing(source.chunks()) as chunks:
        async for chunk in chunks:
            await streamed.write(chunk)
            served.inc(len(chunk))
            await turns.sent(len(chunk))
    await streamed.write_eof()
    return streamed


# --- failures after the headers were sent --------------------------------------------------

# Set when a response's status line and headers are committed (on_response_prepare), so that a
# later failure is not answered with a second response.
PREPARED_RESPONSE_KEY = web.RequestKey("prepared_response", web.StreamResponse)


def _abort_reason(exc: BaseException) -> str:
    """A bounded label for why a response was cut off."""
    if isinstance(exc, IntegrityError):
        return "integrity"
    if isinstance(exc, InsufficientStorage):
        return "io"  # the cache disk filled up under a download
    if isinstance(exc, ProxyError):
        return "upstream"
    if isinstance(exc, OSError):
        return "io"
    return "internal"


def abort_after_headers(request: web.Request, exc: BaseException, aborted: Counter,
                        route: str, *, explained: bool = False) -> None:
    """A failure after the headers went out: no error answer can follow them, and ending the
    body cleanly would hand the client a short or bad file as if it were whole. Reset the
    connection, count it and log it once (unless the caller explained it already). A client
    that hung up is neither."""
    transport = request.transport
    if isinstance(exc, ConnectionError) and (transport is None or transport.is_closing()):
        log.debug("client left %s %s mid-body", request.method, request.path)
    else:
        reason = _abort_reason(exc)
        aborted.labels(route, reason).inc()
        request[ABORTED_KEY] = reason
        if explained:
            _reset_connection(request)
            return
        message = exc.message if isinstance(exc, ProxyError) else str(exc) or type(exc).__name__
        log.log(logging.WARNING if isinstance(exc, ProxyError) else logging.ERROR,
                "%s %s cut off mid-body (%s): %s", request.method, request.path, reason,
                message, exc_info=exc if reason == "internal" else None)
    _reset_connection(request)


def _reset_connection(request: web.Request) -> None:
    """Drop the connection with a TCP reset, discarding anything not yet sent: a clean close
    (FIN) would end a body that has no Content-Length as if it were complete."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class _JsonErrors(web.StreamResponse):
    """The error answers FileResponse makes itself (416 for a range outside the file, 412 for
    a failed precondition) get the proxy's JSON error body, their headers kept (a 416's
    `Content-Range: bytes */SIZE`). FileResponse prepares them through this class."""

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        if self.prepared or self.status < 400:
            return await super().prepare(request)
        message = self.reason
        if self.status == 416:
            size = self.headers.get(hdrs.CONTENT_RANGE, "").rpartition("/")[2]
            message = f"range not satisfiable: the file has {size} bytes"
        body = error_body(message)
        self.content_type = "application/json"
        self.content_length = len(body)
        writer = await super().prepare(request)
        if request.method != "HEAD":
            await self.write(body)
        return writer


class _OpenFileResponse(web.FileResponse, _JsonErrors):
    """sendfile of a stored file this request already opened (by the name its store gives
    the open file: the blob's local_path); counts the bytes sent. Reads that may wait for
    the disk run on the quick pool, never on the loop's default executor, where libraries'
    calls (aiofiles, name lookups outside the proxy's own) may queue."""

    def __init__(self, path: Path, served: Counter, headers: dict[str, str]) -> None:
        super().__init__(path, headers=headers)
        self._served = served

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        if self.prepared:
            # Sent by the handler already; aiohttp calls prepare again when it finishes.
            return await web.StreamResponse.prepare(self, request)
        writer = await self._prepare_file(request)
        if request.method != "HEAD" and self.status == 200 and self.content_length:
            self._served.inc(self.content_length)
        return writer

    async def _prepare_file(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        """FileResponse.prepare, its stats and open on the event loop: the file is open
        already (its /proc/self/fd name), so they take microseconds, where a hop to the
        quick pool and back took 0.1-0.25 ms before a hit's first byte."""
        accept_encoding = request.headers.get(hdrs.ACCEPT_ENCODING, "").lower()
        try:
            result, fobj, st, encoding = self._make_response(request, accept_encoding)
        except OSError as exc:  # gone, or unreadable: FileResponse's answers, as JSON
            self.set_status(403 if isinstance(exc, PermissionError) else 404)
            return await _JsonErrors.prepare(self, request)
        if result is _FileResponseResult.NOT_ACCEPTABLE:
            self.set_status(403)
            return await _JsonErrors.prepare(self, request)
        if result is _FileResponseResult.PRE_CONDITION_FAILED:
            return await self._precondition_failed(request)
        if result is _FileResponseResult.NOT_MODIFIED:
            return await self._not_modified(request, f"{st.st_mtime_ns:x}-{st.st_size:x}",
                                            st.st_mtime)
        assert fobj is not None
        try:
            return await self._prepare_open_file(request, fobj, st, encoding)
        finally:
            fobj.close()  # quick: the blob still holds the file open (see send_file)

    async def _sendfile(self, request: web.BaseRequest, fobj: IO[Any], offset: int,
                        count: int) -> AbstractStreamWriter:
        writer = await _JsonErrors.prepare(self, request)
        assert writer is not None
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("Connection lost")
        # sendfile(2) where the loop has it and nothing transforms the bytes: not through TLS
        # (the loop encrypts in user space: there is no kernel TLS here) or compression, and
        # not on uvloop (NotImplementedError).
        if not (NOSENDFILE or self.compression
                or transport.get_extra_info("sslcontext") is not None):
            try:
                await asyncio.get_running_loop().sendfile(transport, fobj, offset, count,
                                                          fallback=False)
            except (NotImplementedError, asyncio.SendfileNotAvailableError):
                pass
            else:
                await self.write_eof()
                return writer
        # Read from the page cache on the loop where the bytes are there (a hot file), on the
        # quick pool where they are not (see ChunkReader).
        reader = ChunkReader(fobj.fileno(), _CHUNK)
        turns = _Turns()
        while count > 0:
            chunk = await reader.read(offset, min(reader.chunk_size, count))
            if not chunk:  # cut short: the headers promised more, so this cannot end well
                raise OSError(f"{self._path.name} ended {count} bytes early")
            size = len(chunk)
            await writer.write(chunk)
            del chunk  # taken by the transport: its buffer can hold the next one
            offset += size
            count -= size
            await turns.sent(size)
        await writer.drain()
        return writer


class _BlobResponse(_JsonErrors):
    """A stored blob that is not a local file, streamed from its store: the whole of it, or
    the one byte range the request asks for (206; 416 outside the blob), as FileResponse
    answers for a file. Counts the bytes sent."""

    def __init__(self, blob: OpenBlob, served: Counter, headers: dict[str, str]) -> None:
        super().__init__(headers=headers)
        self._blob = blob
        self._served = served

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        if self.prepared:
            return await super().prepare(request)
        size = self._blob.info.size
        self.headers[hdrs.ACCEPT_RANGES] = "bytes"
        self.last_modified = self._blob.info.mtime
        start, end = 0, size
        try:
            wanted = request.http_range
        except ValueError:
            wanted = slice(None)  # a malformed Range is ignored, as FileResponse does
        if wanted.start is not None or wanted.stop is not None:
            start, end = _range_in(wanted, size)
            if start >= end:
                self.set_status(416)
                self.headers[hdrs.CONTENT_RANGE] = f"bytes */{size}"
                return await super().prepare(request)
            self.set_status(206)
            self.headers[hdrs.CONTENT_RANGE] = f"bytes {start}-{end - 1}/{size}"
        self.content_length = end - start
        writer = await super().prepare(request)
        if request.method == "HEAD":
            return writer
        async with contextlib.aclosing(self._blob.chunks(start, end)) as chunks:
            async for chunk in chunks:
                await self.write(chunk)
                self._served.inc(len(chunk))
        await self.write_eof()
        return writer


def _range_in(wanted: slice, size: int) -> tuple[int, int]:
    """The bytes [start, end) of a blob of size that request.http_range names (a suffix
    range when only stop is negative)."""
    if wanted.start is None:  # bytes=-N: the last N
        assert wanted.stop is not None
        return max(0, size + wanted.stop), size
    if wanted.start < 0:
        return max(0, size + wanted.start), size
    end = size if wanted.stop is None else min(wanted.stop, size)
    return wanted.start, end
