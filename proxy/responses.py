"""Response helpers: protocol JSON documents, and files sent from the cache or while they
are still being downloaded."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from prometheus_client import Counter

from proxy.access_log import CACHE_RESULT_KEY
from proxy.archives import ArchiveStore, GrowingFile
from proxy.errors import ProxyError

log = logging.getLogger(__name__)


def json_response(document: dict[str, Any], status: int = 200) -> web.Response:
    """Serialize a protocol document as application/json."""
    return web.Response(status=status, body=json.dumps(document, separators=(",", ":")).encode(),
                        content_type="application/json")


async def send_file(request: web.Request, source: Path | GrowingFile, content_type: str,
                    store: ArchiveStore, served: Counter) -> web.StreamResponse:
    """A stored file by sendfile, or a download under way as its bytes arrive. A download
    that fails verification ends the connection mid-body: never a clean end of bad bytes."""
    request[CACHE_RESULT_KEY] = "hit" if isinstance(source, Path) else "miss"
    if isinstance(source, GrowingFile) and request.method == "HEAD":
        source = await source.wait_done()  # noqa: ASYNC240 - not a pathlib call
    if isinstance(source, Path):
        store.touch(source)
        return _InUseFileResponse(source, store, served,
                                  headers={"Content-Type": content_type})
    streamed = web.StreamResponse(headers={"Content-Type": content_type})
    if source.size is not None:
        streamed.content_length = source.size
    await streamed.prepare(request)
    try:
        async with contextlib.aclosing(source.chunks()) as chunks:
            async for chunk in chunks:
                await streamed.write(chunk)
                served.inc(len(chunk))
    except ProxyError as exc:
        log.warning("aborting %s mid-body: %s", request.path, exc.message)
        if request.transport is not None:
            request.transport.close()
        return streamed
    await streamed.write_eof()
    return streamed


class _InUseFileResponse(web.FileResponse):
    """sendfile, with the file marked in use while it is sent (eviction leaves it alone)."""

    def __init__(self, path: Path, store: ArchiveStore, served: Counter,
                 headers: dict[str, str]) -> None:
        super().__init__(path, headers=headers)
        self._in_use_path = path
        self._store = store
        self._served = served

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        with self._store.using(self._in_use_path):
            writer = await super().prepare(request)
        if request.method != "HEAD" and self.status == 200 and self.content_length:
            self._served.inc(self.content_length)
        return writer
