"""The bare-aiohttp floor: what one Python process on uvloop can answer over TLS at best. It
serves every .json file under a directory (the proxy's own documents, copied) from memory,
with the proxy's certificate; the JSON figures at one worker are measured against it.

    python bench/floor.py PORT CERT KEY ROOT
"""

from __future__ import annotations

import socket
import ssl
import sys
from pathlib import Path

import uvloop
from aiohttp import web


def serve(app: web.Application, cert: str, key: str, *, port: int | None = None,
          sock: socket.socket | None = None) -> None:
    """Run app over TLS with the proxy's certificate, on uvloop, on 127.0.0.1:port or on a
    listening socket, until killed."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2  # as the proxy's context
    context.load_cert_chain(cert, key)
    uvloop.install()
    web.run_app(app, host=None if sock else "127.0.0.1", port=port, sock=sock,
                ssl_context=context, access_log=None, print=None, shutdown_timeout=1)


def main(port: int, cert: str, key: str, root: Path) -> None:
    """Serve until killed."""
    bodies = {f"/{path.relative_to(root)}": path.read_bytes() for path in root.rglob("*.json")}

    async def answer(request: web.Request) -> web.Response:
        body = bodies.get(request.path)
        if body is None:
            raise web.HTTPNotFound()
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    serve(app, cert, key, port=port)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4]))
