"""One serving process: the app behind TLS listeners until a stop signal, on the chosen
event loop."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import signal
import socket
import sqlite3
import ssl
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from proxy.app import create_app
from proxy.cli.logs import close_access_lines, flush_access_lines
from proxy.cli.messages import fail
from proxy.cli.policy_reload import reload_policy
from proxy.config import Config
from proxy.core.errors import ProxyError
from proxy.store.disk_space import describe_start_failure
from proxy.web.access_log import ACCESS_LOGGER, JsonAccessLogger, PlainAccessLogger
from proxy.web.auth import SigningKeyError
from proxy.web.http_server import ProxyRunner
from proxy.web.routes import AUDIT_KEY, METRICS_KEY, POLICY_KEY
from proxy.web.shutdown import StopSignals, stop_serving
from proxy.web.tls_server import HandshakeFailures, TlsSite, open_connections

log = logging.getLogger("proxy")
T = TypeVar("T")


def listen_hosts(host: str) -> list[str]:
    """The addresses server.listen's host binds: "::" alone is IPv6-only in asyncio, and
    "[::]:PORT" means every interface, so IPv4's too."""
    return [host, "0.0.0.0"] if host == "::" else [host]


def port_taken(host: str, port: int) -> str | None:
    """Why the proxy cannot listen on host:port (a message), or None. Bound once without
    SO_REUSEPORT, as nothing else may share the port: another program, or another proxy
    (whose workers share it with SO_REUSEPORT, which would let this one's join them and
    take half of their clients), holding it is refused here, before any worker starts."""
    for address in listen_hosts(host):
        try:
            infos = socket.getaddrinfo(address or None, port, type=socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            return f"server.listen: cannot listen on {host}:{port}: {exc.strerror}"
        for family, kind, proto, _name, where in infos:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio does
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                try:
                    probe.bind(where)
                except OSError as exc:
                    return _cannot_listen(host, port, exc)
    return None


def _cannot_listen(host: str, port: int, exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return (f"server.listen: cannot listen on {host}:{port}: already in use (another "
                "program, or another tf-registry-proxy, listens there)")
    return f"server.listen: cannot listen on {host}:{port}: {exc.strerror or exc}"


def _hangup(config: Config, app: web.Application) -> None:
    flush_access_lines()
    app[AUDIT_KEY].reopen()
    reload_policy(config, app[POLICY_KEY])


def run_loop(main: Coroutine[Any, Any, T], event_loop: str) -> T:
    """Run on uvloop (faster sockets and TLS) when asked for and installed, else on
    asyncio's default loop."""
    if event_loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.warning("uvloop is not installed; using asyncio's event loop")
        else:
            return uvloop.run(main)
    return asyncio.run(main)


async def run_server(config: Config, context: ssl.SSLContext, generated_ca: Path | None,
                     reuse_port: bool = False) -> int:
    """Serve until SIGTERM (or SIGINT, unless a worker), then stop gracefully; the exit
    status. The start-up log is the caller's (proxy.cli.startup): once, not per worker."""
    server = config.server
    access_class: type[PlainAccessLogger | JsonAccessLogger] = (
        JsonAccessLogger if server.access_log == "json" else PlainAccessLogger)
    access_logger = None if server.access_log == "off" else logging.getLogger(ACCESS_LOGGER)
    runner = ProxyRunner(create_app(config), handle_signals=False, access_log=access_logger,
                         access_log_class=access_class,
                         keepalive_timeout=server.keepalive_timeout)
    try:
        await runner.setup()  # opens the cache: its directories, the index
    except (SigningKeyError, ProxyError, OSError, sqlite3.Error) as exc:
        with contextlib.suppress(Exception):  # close what started before the failure
            await runner.app.cleanup()
        # A damaged signing key, or a store that refuses (e.g. no such bucket).
        if isinstance(exc, SigningKeyError | ProxyError):
            return fail(f"cannot start: {exc}")
        return fail(describe_start_failure(config.cache.dir, exc))  # e.g. a full disk
    trust_hint = (f"clients must trust the CA {generated_ca} (SSL_CERT_FILE)" if generated_ca
                  else "clients must trust the CA that issued server.tls_cert")
    failures = HandshakeFailures(runner.app[METRICS_KEY].tls_handshake_failures, trust_hint)
    connections = open_connections(server, runner.app[METRICS_KEY])
    try:
        for host in listen_hosts(server.host):
            await TlsSite(runner, host, server.port, context, failures, connections,
                          reuse_port=reuse_port or None).start()
    except OSError as exc:
        await runner.cleanup()
        return fail(_cannot_listen(server.host, server.port, exc))
    # One line per serving process, once its port is bound (the summary came before).
    log.info("listening on %s port %d", server.host, server.port)
    signals = StopSignals()
    # A worker (reuse_port) ignores SIGINT: its parent takes Ctrl-C and forwards SIGTERM.
    signals.install((signal.SIGTERM,) if reuse_port else (signal.SIGTERM, signal.SIGINT))
    # SIGHUP: logrotate's way (rename the file, then SIGHUP; the next audit line opens a new
    # one), and the version policy read again from the configuration file.
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, _hangup, config, runner.app)
    await signals.stop.wait()
    log.info("shutting down: no new connections; responses under way get %g s to finish",
             server.shutdown_timeout)
    await stop_serving(runner, server.shutdown_timeout, signals.cut)
    close_access_lines()  # every line of a clean stop is written
    return 0
