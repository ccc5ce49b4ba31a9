"""Clients that connect and then stall, the way a slow-loris does, and a way to see how (and
whether) the server ended each connection. Blocking sockets: TLS ones never answer the
server's TLS close (close_notify), as a stalled client would not."""

from __future__ import annotations

import socket
import ssl
import time
from pathlib import Path


def tls_context(ca_file: Path) -> ssl.SSLContext:
    """A client context that trusts ca_file."""
    return ssl.create_default_context(cafile=str(ca_file))


def connect(port: int) -> socket.socket:
    """A TCP connection to the proxy on 127.0.0.1 that has sent nothing."""
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def connect_tls(port: int, context: ssl.SSLContext, timeout: float = 10) -> ssl.SSLSocket:
    """A connection with its TLS handshake done, nothing sent over it yet."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    return context.wrap_socket(sock, server_hostname="localhost")


def request_head(path: str, port: int) -> bytes:
    """A complete keep-alive GET head, as Terraform sends one."""
    return (f"GET {path} HTTP/1.1\r\nHost: localhost:{port}\r\nUser-Agent: stalled-client\r\n"
            "Accept-Encoding: identity\r\n\r\n").encode()


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """(head, body) of one response with a Content-Length; the connection stays open."""
    received = b""
    while b"\r\n\r\n" not in received:
        chunk = sock.recv(65536)
        assert chunk, f"the connection ended after {received!r}"
        received += chunk
    head, _, body = received.partition(b"\r\n\r\n")
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")[1:]
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, f"the connection ended after {len(body)} of {length} body bytes"
        body += chunk
    return head, body


def ending(sock: socket.socket, deadline: float) -> tuple[str, bytes]:
    """How the server ended the connection by deadline (time.monotonic): "eof", "reset",
    or "open" when it did not; with any bytes it sent first."""
    received = b""
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError):
            return "eof", received  # closed without (or with) a TLS close_notify
        except ConnectionResetError:
            return "reset", received
        if not chunk:
            return "eof", received
        received += chunk
    return "open", received
