"""The bare-aiohttp file floor: what Python on uvloop can serve from disk over TLS at best. As
many processes as the proxy's workers, each with its own SO_REUSEPORT socket on one port (as
the proxy's workers, and nginx's), serve every .zip under a directory with the proxy's
certificate by the simplest good loop: the file read into one reused 64 KiB buffer
(os.preadv), written to the transport, drained only when the transport is paused. The warm
archive figures are measured against it as well as against nginx.

    python bench/filefloor.py PORT CERT KEY ROOT PROCESSES
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parent.parent)  # `bench.x` from the checkout

from aiohttp import web  # noqa: E402

from bench.floor import serve_processes  # noqa: E402

CHUNK = 64 * 1024  # as the proxy's reads


def application(root: Path) -> web.Application:
    """GET of a .zip under root (as found at start): the file, Content-Length first."""
    files = {f"/{path.relative_to(root)}": path for path in root.rglob("*.zip")}

    async def answer(request: web.Request) -> web.StreamResponse:
        path = files.get(request.path)
        if path is None:
            raise web.HTTPNotFound()
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            response = web.StreamResponse(headers={"Content-Type": "application/zip"})
            response.content_length = size
            writer = await response.prepare(request)
            assert writer is not None  # a new response: prepare returns its writer
            transport, protocol = request.transport, request.protocol
            buffer = memoryview(bytearray(CHUNK))
            offset = 0
            while offset < size:
                if transport is None or transport.is_closing():
                    raise ConnectionResetError("the client went away")
                read = os.preadv(fd, [buffer], offset)  # a warm file: the page cache
                if not read:
                    raise OSError(f"{path} ended {size - offset} bytes early")
                # The TLS transport encrypts the bytes at once (into its memory BIO): the
                # buffer is free again when write returns.
                transport.write(buffer[:read])
                offset += read
                if protocol.writing_paused:
                    await writer.drain()
            await response.write_eof()
            return response
        finally:
            os.close(fd)

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    return app


def main(port: int, cert: str, key: str, root: Path, processes: int) -> int:
    """Serve until killed (or until a serving process dies: then exit 1)."""
    return serve_processes(application(root), cert, key, port, processes)


if __name__ == "__main__":
    raise SystemExit(main(int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4]),
                          int(sys.argv[5])))
