"""The bare-aiohttp floor: what Python on uvloop can answer over TLS at best. It serves every
.json file under a directory (the proxy's own documents, copied) from memory, with the
proxy's certificate, in as many processes as asked (each with its own SO_REUSEPORT socket on
one port, as the proxy's workers); the JSON figures are measured against it at the proxy's
process count.

    python bench/floor.py PORT CERT KEY ROOT [PROCESSES]
"""

from __future__ import annotations

import signal
import socket
import ssl
import sys
from multiprocessing import get_context
from multiprocessing.connection import wait
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


def listening(port: int) -> socket.socket:
    """A socket on 127.0.0.1:port that other processes may listen on too."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    return listener


def serve_processes(app: web.Application, cert: str, key: str, port: int,
                    processes: int) -> int:
    """Serve app in `processes` forked processes on one port until killed (or until one
    dies: then 1)."""
    # Every socket listens before any process serves: no connection meets a partial set.
    sockets = [listening(port) for _ in range(processes)]
    # On SIGTERM the parent exits, and multiprocessing ends its daemon children on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    fork = get_context("fork")
    children = [fork.Process(target=serve, args=(app, cert, key), kwargs={"sock": listener},
                             daemon=True) for listener in sockets]
    for child in children:
        child.start()
    for listener in sockets:
        listener.close()
    wait([child.sentinel for child in children])
    return 1


def main(port: int, cert: str, key: str, root: Path, processes: int = 1) -> int:
    """Serve until killed."""
    bodies = {f"/{path.relative_to(root)}": path.read_bytes() for path in root.rglob("*.json")}

    async def answer(request: web.Request) -> web.Response:
        body = bodies.get(request.path)
        if body is None:
            raise web.HTTPNotFound()
        return web.Response(body=body, content_type="application/json")

    app = web.Application()
    app.router.add_get("/{tail:.*}", answer)
    if processes == 1:
        serve(app, cert, key, port=port)
        return 0
    return serve_processes(app, cert, key, port, processes)


if __name__ == "__main__":
    raise SystemExit(main(int(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4]),
                          int(sys.argv[5]) if len(sys.argv) > 5 else 1))
