"""Command line: `serve`, `client-config` and `healthcheck`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import signal
import ssl
import sys
import urllib.request
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy import __version__
from proxy.access_log import JsonAccessLogger, PlainAccessLogger
from proxy.app import create_app
from proxy.client_config import render_client_config
from proxy.config import Config, ConfigError, load_config
from proxy.tls import ensure_certificate, ssl_context

log = logging.getLogger("proxy")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tf-registry-proxy",
        description="Caching, verifying proxy for Terraform and OpenTofu registries.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in (("serve", "run the proxy (HTTPS)"),
                       ("client-config", "print a Terraform CLI config that uses this proxy"),
                       ("healthcheck", "exit 0 if the proxy on this machine answers /healthz")):
        command = commands.add_parser(name, help=text, description=text)
        command.add_argument("--config", type=Path, metavar="FILE",
                             help="TOML config file (default: $TF_REGISTRY_PROXY_CONFIG, "
                                  "else built-in defaults)")
        if name == "client-config":
            command.add_argument(
                "--mode", choices=("mirror", "registry"), default="mirror",
                help="mirror: providers through the network mirror (default); registry: "
                     "through host blocks, so lock files match a direct install")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tf-registry-proxy` script and `python -m proxy`."""
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print("tf-registry-proxy: invalid configuration:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 2
    if args.command == "client-config":
        generated_ca = None if config.server.tls_cert else config.cache.dir / "tls" / "ca.pem"
        sys.stdout.write(render_client_config(config, generated_ca, args.mode))
        return 0
    if args.command == "healthcheck":
        return _healthcheck(config)
    return _serve(config)


def _fail(message: str) -> int:
    print(f"tf-registry-proxy: {message}", file=sys.stderr)
    return 2


def _serve(config: Config) -> int:
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = config.server
    try:
        config.cache.dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return _fail(f"cache.dir {config.cache.dir}: {exc.strerror}")
    try:
        certificate = ensure_certificate(server, config.cache.dir)
        context = ssl_context(certificate)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        where = (f"server.tls_cert {server.tls_cert} / server.tls_key {server.tls_key}"
                 if server.tls_cert else f"generated certificate under {config.cache.dir}/tls")
        return _fail(f"cannot load the serving certificate ({where}): {exc}")
    if server.workers > 1:
        return _serve_workers(config, certificate.ca)
    return _run_loop(_run(config, context, certificate.ca), server.event_loop)


def _run_loop(main: Coroutine[Any, Any, int], event_loop: str) -> int:
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


def _serve_workers(config: Config, generated_ca: Path | None) -> int:
    """N processes on one port (SO_REUSEPORT) sharing the disk cache; the parent forwards
    SIGTERM/SIGINT and exits when they do."""
    spawn = multiprocessing.get_context("spawn")
    workers = [spawn.Process(target=_worker_main, args=(config, generated_ca, index),
                             name=f"worker-{index}") for index in range(config.server.workers)]
    for worker in workers:
        worker.start()

    def stop(_signum: int, _frame: object) -> None:
        for worker in workers:
            if worker.is_alive():
                worker.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    log.info("started %d worker processes", len(workers))
    code = 0
    for worker in workers:
        worker.join()
        if worker.exitcode not in (0, -signal.SIGTERM):
            code = code or (worker.exitcode or 1)
            stop(signal.SIGTERM, None)  # one failed: stop the others too
    return code


def _worker_main(config: Config, generated_ca: Path | None, index: int) -> None:
    logging.basicConfig(level=config.server.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s w{index} %(name)s: %(message)s")
    certificate = ensure_certificate(config.server, config.cache.dir)
    raise SystemExit(_run_loop(_run(config, ssl_context(certificate), generated_ca,
                                    reuse_port=True, announce=index == 0),
                               config.server.event_loop))


async def _run(config: Config, context: ssl.SSLContext, generated_ca: Path | None,
               reuse_port: bool = False, announce: bool = True) -> int:
    server = config.server
    access_class: type[PlainAccessLogger | JsonAccessLogger] = (
        JsonAccessLogger if server.access_log == "json" else PlainAccessLogger)
    access_logger = None if server.access_log == "off" else logging.getLogger("proxy.access")
    runner = web.AppRunner(create_app(config), handle_signals=False, access_log=access_logger,
                           access_log_class=access_class)
    await runner.setup()
    # "::" alone is IPv6-only in asyncio; "[::]:PORT" means every interface, so add IPv4.
    hosts = [server.host, "0.0.0.0"] if server.host == "::" else [server.host]
    try:
        for host in hosts:
            await web.TCPSite(runner, host, server.port, ssl_context=context,
                              reuse_port=reuse_port or None).start()
    except OSError as exc:
        await runner.cleanup()
        return _fail(f"server.listen: cannot listen on {server.host}:{server.port}: "
                     f"{exc.strerror or exc}")
    if generated_ca is not None and announce:
        log.info("serving with a generated certificate; clients trust it with "
                 "SSL_CERT_FILE=%s", generated_ca)
    if announce:
        log.info("listening on %s:%d; network mirror at %smirror/ (cache: %s)", server.host,
                 server.port, server.base_url, config.cache.dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("shutting down")
    await runner.cleanup()
    return 0


def _healthcheck(config: Config) -> int:
    host = config.server.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    # A liveness probe on this machine only: the certificate may be an operator's whose CA
    # this process does not know, so this one request does not verify it.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(f"https://{host}:{config.server.port}/healthz",
                                    context=context, timeout=5) as response:
            return 0 if response.status == 200 else 1
    except OSError as exc:
        print(f"tf-registry-proxy: unhealthy: {exc}", file=sys.stderr)
        return 1
