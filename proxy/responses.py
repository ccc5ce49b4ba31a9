"""Response helpers: protocol JSON documents, files sent from the cache or while they are
still being downloaded, and the one way a response that fails after its headers ends."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, BinaryIO

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from prometheus_client import Counter

from proxy.access_log import CACHE_RESULT_KEY
from proxy.archives import ArchiveStore, GrowingFile
from proxy.errors import InsufficientStorage, IntegrityError, ProxyError, Unavailable
from proxy.executors import quick

log = logging.getLogger(__name__)


def json_response(document: dict[str, Any], status: int = 200) -> web.Response:
    """Serialize a protocol document as application/json."""
    return web.Response(status=status, body=json.dumps(document, separators=(",", ":")).encode(),
                        content_type="application/json")


# A stored file may leave the cache (another process evicted it) between being found and
# being opened; it is then looked up again, which fetches it anew. Never in a loop.
_FIND_ATTEMPTS = 3


async def send_file(request: web.Request, find: Callable[[], Awaitable[Path | GrowingFile]],
                    content_type: str, store: ArchiveStore,
                    served: Counter) -> web.StreamResponse:
    """What `find` returns: a stored file by sendfile, or a download under way as its bytes
    arrive. Either is sent here, inside the error middleware: a failure before the headers
    becomes a JSON error, one after them cuts the connection (see `abort_after_headers`). A
    stored file is opened, and marked in use, before anything is sent."""
    for _attempt in range(_FIND_ATTEMPTS):
        source = await find()
        request[CACHE_RESULT_KEY] = "hit" if isinstance(source, Path) else "miss"
        if isinstance(source, GrowingFile):
            if request.method != "HEAD":
                return await _stream(request, source, content_type, served)
            source = await source.wait_done()
        handle = await quick(store.open_to_send, source)
        if handle is None:
            log.info("%s left the cache before it could be sent; looking it up again",
                     source.name)
            continue
        try:
            store.touch(source)
            sent = _OpenFileResponse(handle, source, served,
                                     headers={"Content-Type": content_type})
            await sent.prepare(request)
        finally:
            handle.close()
        return sent
    raise Unavailable("the file kept leaving the cache before it could be sent (the cache "
                      "is too small for its load); try again")


async def _stream(request: web.Request, source: GrowingFile, content_type: str,
                  served: Counter) -> web.StreamResponse:
    streamed = web.StreamResponse(headers={"Content-Type": content_type})
    if source.size is not None:
        streamed.content_length = source.size
    await streamed.prepare(request)
    # A download that fails verification (or cannot be published) raises here, mid-body.
    async with contextlib.aclosing(source.chunks()) as chunks:
        async for chunk in chunks:
            await streamed.write(chunk)
            served.inc(len(chunk))
    await streamed.write_eof()
    return streamed


# --- failures after the headers were sent --------------------------------------------------

PREPARED_RESPONSE_KEY = web.RequestKey("prepared_response", web.StreamResponse)


async def remember_prepared(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: note that this request's status line and headers are committed,
    so that a later failure is not answered with a second response."""
    request[PREPARED_RESPONSE_KEY] = response


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
                        route: str) -> None:
    """A failure after the headers went out: no error answer can follow them, and ending the
    body cleanly would hand the client a short or bad file as if it were whole. Reset the
    connection, count it and log it once. A client that hung up is neither."""
    transport = request.transport
    if isinstance(exc, ConnectionError) and (transport is None or transport.is_closing()):
        log.debug("client left %s %s mid-body", request.method, request.path)
    else:
        reason = _abort_reason(exc)
        aborted.labels(route, reason).inc()
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


# FileResponse opens what it sends by name. On Linux, the name of an open descriptor names
# exactly the file that was opened (and marked in use), even once it is deleted: no bare 404
# if it leaves the cache meanwhile. Elsewhere, the mark keeps eviction away from the path.
_OPEN_FILES = Path("/proc/self/fd")
_NAMES_OPEN_FILES = _OPEN_FILES.is_dir()


class _OpenFileResponse(web.FileResponse):
    """sendfile of a stored file this request already opened; counts the bytes sent."""

    def __init__(self, handle: BinaryIO, path: Path, served: Counter,
                 headers: dict[str, str]) -> None:
        super().__init__(_OPEN_FILES / str(handle.fileno()) if _NAMES_OPEN_FILES else path,
                         headers=headers)
        self._served = served

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        if self.prepared:
            # Sent by the handler already; aiohttp calls prepare again when it finishes.
            return await web.StreamResponse.prepare(self, request)
        writer = await super().prepare(request)
        if request.method != "HEAD" and self.status == 200 and self.content_length:
            self._served.inc(self.content_length)
        return writer
