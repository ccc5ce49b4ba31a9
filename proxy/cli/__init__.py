"""Command line: `serve`, `client-config`, `healthcheck`, `tls`, and the air-gap commands
`warm`, `export`, `import` and `keygen`."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import signal
import socket
import sqlite3
import ssl
import sys
import time
import urllib.request
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from proxy import __version__
from proxy.airgap.export import export_bundle
from proxy.airgap.import_bundle import (
    import_bundle,
    import_mirror_directory,
    split_armored_keys,
)
from proxy.airgap.manifest import BundleError
from proxy.airgap.signing import (
    PUBLIC_KEY_FILE,
    SECRET_KEY_FILE,
    SigningError,
    generate_key_pair,
    load_public_keys,
    load_signer,
)
from proxy.airgap.sources import SourceError, read_sources
from proxy.airgap.warm import summary as warm_summary
from proxy.airgap.warm import warm, warm_cache
from proxy.app import create_app
from proxy.cli.client_config import render_client_config
from proxy.config import Config, ConfigError, load_config
from proxy.core.errors import BadRequest
from proxy.core.models import Platform
from proxy.core.redaction import install_log_masking, mask_secrets
from proxy.store.disk_space import describe_start_failure
from proxy.tls.certificates import (
    TlsStateError,
    describe,
    ensure_certificate,
    generated_ca_path,
    rotate_ca,
    ssl_context,
)
from proxy.tls.state import StatePaths, adopt_legacy_state
from proxy.web.access_log import JsonAccessLogger, PlainAccessLogger
from proxy.web.auth import SigningKeyError, load_signing_key
from proxy.web.http_server import ProxyRunner
from proxy.web.routes import METRICS_KEY
from proxy.web.shutdown import EXIT_MARGIN, StopSignals, die_with_parent, stop_serving
from proxy.web.tls_server import HandshakeFailures, TlsSite, open_connections

log = logging.getLogger("proxy")
T = TypeVar("T")


_EPILOGS = {
    "import": "Trust: a bundle imports only if its manifest signature verifies with one of the "
              "--bundle-key keys and the tar holds exactly the members the signed manifest "
              "lists (size and sha256). The signed manifest vouches for the module archives "
              "and for the registry signing keys the bundle carries; every provider's "
              "SHA256SUMS signature must still verify with those keys (and with "
              "--trusted-keys, if given). Nothing enters the cache unless every check passes.",
    "export": "The manifest lists every member's size and sha256; its signature "
              "(manifest.json.sig) vouches for all of them. Importers verify it with the "
              "public half of the key (import --bundle-key).",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tf-registry-proxy",
        description="Caching, verifying proxy for Terraform and OpenTofu registries.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, text in (("serve", "run the proxy (HTTPS)"),
                       ("client-config", "print a Terraform CLI config that uses this proxy"),
                       ("healthcheck", "exit 0 if the proxy on this machine answers /healthz"),
                       ("warm", "fill the cache ahead of time from configurations, lock "
                                "files or lists"),
                       ("export", "write the cache, or part of it, as one tar bundle"),
                       ("import", "verify a bundle (or a `terraform providers mirror` "
                                  "directory) and add it to the cache"),
                       ("keygen", "write a key pair that signs bundles (export "
                                  "--signing-key) and verifies them (import --bundle-key)"),
                       ("tls", "show the generated CA, or replace it (rotate)")):
        command = commands.add_parser(name, help=text, description=text,
                                      epilog=_EPILOGS.get(name))
        if name != "keygen":
            command.add_argument("--config", type=Path, metavar="FILE",
                                 help="TOML config file (default: $TF_REGISTRY_PROXY_CONFIG, "
                                      "else built-in defaults)")
        if name in ("warm", "export"):
            command.add_argument("sources", nargs="*" if name == "export" else "+",
                                 metavar="SOURCE",
                                 help="a configuration directory, a .terraform.lock.hcl, or "
                                      "a list file (one 'ADDRESS [CONSTRAINT]' a line)")
        if name == "warm":
            command.add_argument("--platform", action="append", default=[],
                                 metavar="OS_ARCH", help="repeatable (default: the "
                                 "configured platform filter, else linux_amd64)")
            command.add_argument("--proxy", metavar="URL",
                                 help="warm a running proxy (default: the cache directory, "
                                      "with a proxy started in this process)")
            command.add_argument("--ca-file", type=Path, metavar="FILE",
                                 help="CA to trust for --proxy (default: the system's)")
            command.add_argument("--token", help="client token for --proxy, if it needs one")
        if name == "export":
            command.add_argument("--output", type=Path, required=True, metavar="BUNDLE.tar")
            signing = command.add_mutually_exclusive_group(required=True)
            signing.add_argument("--signing-key", type=Path, metavar="FILE",
                                 help="OpenPGP secret key that signs the bundle's manifest "
                                      "(from `keygen`, or `gpg --armor "
                                      "--export-secret-keys`)")
            signing.add_argument("--unsigned", action="store_true",
                                 help="write an unsigned bundle: importers will need "
                                      "--allow-unsigned-bundle")
            command.add_argument("--passphrase-file", type=Path, metavar="FILE",
                                 help="first line: the passphrase of --signing-key, if it "
                                      "has one")
        if name == "import":
            command.add_argument("bundle", type=Path, metavar="BUNDLE",
                                 help="a bundle from `export`, or a directory written by "
                                      "`terraform providers mirror`")
            origin = command.add_mutually_exclusive_group()
            origin.add_argument("--bundle-key", type=Path, action="append", metavar="FILE",
                                help="repeatable: public key of an exporter you trust; the "
                                     "bundle's signature must verify with one of them, and "
                                     "then the registry signing keys it carries are trusted "
                                     "for the provider signatures")
            origin.add_argument("--allow-unsigned-bundle", action="store_true",
                                help="import without checking who made the bundle (or a "
                                     "mirror directory, which carries no signature): "
                                     "nothing then vouches for its modules or the keys it "
                                     "carries; only for one that came over a path you trust")
            command.add_argument("--trusted-keys", type=Path, metavar="KEYS.asc",
                                 help="optional extra check: armored OpenPGP keys (e.g. a "
                                      "registry's release keys) that every provider "
                                      "signature must also verify with")
        if name == "keygen":
            command.add_argument("--output", type=Path, required=True, metavar="DIR",
                                 help=f"where to write {SECRET_KEY_FILE} (keep it on the "
                                      f"exporting side) and {PUBLIC_KEY_FILE} (for importers)"
                                      "; existing files are never overwritten")
        if name == "tls":
            command.add_argument(
                "action", choices=("show", "rotate"),
                help="show: the CA's path, names and expiry; rotate: replace the CA (every "
                     "client must then trust the new one)")
        if name == "client-config":
            command.add_argument(
                "--mode", choices=("mirror", "registry"), default="mirror",
                help="mirror: providers through the network mirror (default); registry: "
                     "through host blocks, so lock files match a direct install")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tf-registry-proxy` script and `python -m proxy`."""
    args = _parser().parse_args(argv)
    if args.command == "keygen":
        return _keygen(args.output)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print("tf-registry-proxy: invalid configuration:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  - {mask_secrets(problem)}", file=sys.stderr)
        return 2
    if args.command == "client-config":
        sys.stdout.write(render_client_config(config, generated_ca_path(config.server),
                                              args.mode))
        return 0
    if args.command == "tls":
        return _tls(config, args.action)
    if args.command == "healthcheck":
        return _healthcheck(config)
    if args.command == "warm":
        return _warm(config, args)
    if args.command == "export":
        return _export(config, args)
    if args.command == "import":
        return _import(config, args)
    return _serve(config)


def _warm(config: Config, args: argparse.Namespace) -> int:
    configure_logging(logging.WARNING, "%(levelname)s %(name)s: %(message)s")
    try:
        requirements = read_sources(args.sources)
    except SourceError as exc:
        return _fail(str(exc))
    platforms = args.platform or [p for p in config.filters.platforms
                                  if not any(c in p for c in "*?[")] or ["linux_amd64"]
    for platform in platforms:
        try:
            Platform.from_key(platform)
        except BadRequest:
            return _fail(f"--platform {platform!r}: expected OS_ARCH, e.g. linux_amd64")
    if args.proxy and not args.proxy.startswith("https://"):
        return _fail("--proxy: the proxy's https:// URL, e.g. https://127.0.0.1:8443/")
    if args.proxy:
        context = ssl.create_default_context(
            cafile=str(args.ca_file) if args.ca_file else None)
        results = _run_loop(warm(args.proxy, requirements, platforms, context, args.token),
                            config.server.event_loop)
    else:
        results = _run_loop(warm_cache(config, requirements, platforms),
                            config.server.event_loop)
    sys.stdout.write(warm_summary(results))
    return 0 if all(r.ok for r in results) else 1


def _keygen(directory: Path) -> int:
    try:
        pair = generate_key_pair(directory)
    except SigningError as exc:
        return _fail(str(exc))
    print(f"wrote {pair.secret} (secret: it signs bundles; keep it on the exporting side)\n"
          f"wrote {pair.public} (public: importers verify with it, import --bundle-key)\n"
          f"fingerprint {pair.fingerprint} (compare it with the importers' copy)")
    return 0


def _export(config: Config, args: argparse.Namespace) -> int:
    if args.passphrase_file is not None and args.signing_key is None:
        return _fail("--passphrase-file goes with --signing-key")
    try:
        # The key first: a wrong key or passphrase fails before any work is done.
        signer = None if args.unsigned else load_signer(args.signing_key,
                                                        args.passphrase_file)
        requirements = read_sources(args.sources) if args.sources else None
        if requirements is not None and not requirements:
            return _fail("the SOURCE arguments name no provider or registry module")
        counts = export_bundle(config, args.output, requirements, signer)
    except (SourceError, BundleError, SigningError) as exc:
        return _fail(str(exc))
    if counts.unmatched:
        args.output.unlink(missing_ok=True)
        return _fail("not in the cache (warm it first): " + ", ".join(counts.unmatched))
    if counts.providers + counts.modules == 0:
        args.output.unlink(missing_ok=True)
        return _fail("the cache holds nothing to export")
    signed = f"signed with key {counts.signed_by}" if counts.signed_by else "UNSIGNED"
    print(f"wrote {args.output}: {counts.providers} provider packages, {counts.modules} "
          f"module archives, {signed}")
    return 0


def _trusted_keys(path: Path) -> list[str]:
    try:
        text = path.read_bytes().decode("ascii")
    except UnicodeDecodeError:
        raise BundleError(f"{path} is not ASCII-armored: export keys with "
                          "`gpg --armor --export`") from None
    try:
        return split_armored_keys(text)
    except BundleError:
        raise BundleError(f"{path} holds no armored OpenPGP public key") from None


def _import(config: Config, args: argparse.Namespace) -> int:
    if args.bundle_key is None and not args.allow_unsigned_bundle:
        return _fail("import needs --bundle-key FILE (the public key of the exporter, from "
                     "`keygen`), or --allow-unsigned-bundle for one that came over a path "
                     "you trust")
    try:
        trusted = None if args.trusted_keys is None else _trusted_keys(args.trusted_keys)
        if args.bundle.is_dir():
            if (args.bundle / "manifest.json").exists():
                return _fail(f"{args.bundle} looks like an unpacked bundle: import the .tar "
                             "that `export` wrote")
            if not args.allow_unsigned_bundle or trusted is not None:
                return _fail(f"{args.bundle} is a `terraform providers mirror` directory: it "
                             "carries no signatures (nothing for --bundle-key or "
                             "--trusted-keys to check), so only --allow-unsigned-bundle "
                             "imports it")
            counts = import_mirror_directory(config, args.bundle)
            if counts.providers + counts.present == 0:
                return _fail(f"{args.bundle} holds no `terraform providers mirror` packages "
                             "(HOST/NAMESPACE/TYPE/terraform-provider-*.zip)")
        else:
            keys = None if args.bundle_key is None else [
                cert for path in args.bundle_key for cert in load_public_keys(path)]
            counts = import_bundle(config, args.bundle, keys, trusted)
    except OSError as exc:
        return _fail(f"cannot read {exc.filename}: {exc.strerror}")
    except SigningError as exc:
        return _fail(str(exc))
    except BundleError as exc:
        return _fail(f"refused {args.bundle}: {exc}")
    origin = f"bundle signed by {counts.signed_by}" if counts.signed_by \
        else "origin not checked: --allow-unsigned-bundle"
    present = f"; {counts.present} already in the cache" if counts.present else ""
    print(f"imported {counts.providers} provider packages, {counts.modules} module archives "
          f"({origin}){present}")
    return 0


def _fail(message: str) -> int:
    print(f"tf-registry-proxy: {_printable(mask_secrets(message))}", file=sys.stderr)
    return 2


def _printable(text: str) -> str:
    # Messages may quote what a file or a peer sent: no control sequence reaches the
    # operator's terminal, each is shown escaped.
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def configure_logging(level: int | str, line_format: str) -> None:
    """Log to stderr with secrets masked in every record, whoever logs it (our modules,
    aiohttp, tracebacks)."""
    logging.basicConfig(level=level, format=line_format)
    install_log_masking()


def _tls(config: Config, action: str) -> int:
    configure_logging(logging.WARNING, "%(levelname)s %(name)s: %(message)s")
    server = config.server
    if server.tls_cert is not None:
        return _fail(f"the proxy serves with server.tls_cert {server.tls_cert}, not a "
                     "generated CA: renew that certificate where it was issued")
    try:
        adopt_legacy_state(config.cache.dir, StatePaths(server.state_dir))
        if action == "rotate":
            ca = rotate_ca(server)
            print(f"created a new CA: {ca}\nRestart the proxy to serve with it, and make every "
                  f"client trust {ca} (SSL_CERT_FILE) instead of the old CA.")
            return 0
        ca = StatePaths(server.state_dir).ca_cert
        if not ca.exists():
            return _fail(f"no CA yet: `serve` creates one at {ca} on first start")
        sys.stdout.write(describe(server))
    except (OSError, ValueError) as exc:
        return _fail(f"generated certificate under {server.state_dir}: {exc}")
    return 0


def _serve(config: Config) -> int:
    configure_logging(config.server.log_level.upper(),
                      "%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = config.server
    for key, directory in (("cache.dir", config.cache.dir), ("server.state_dir",
                                                             server.state_dir)):
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return _fail(f"{key} {directory}: {exc.strerror}")
    try:
        adopt_legacy_state(config.cache.dir, StatePaths(server.state_dir))
        certificate = ensure_certificate(server)
        context = ssl_context(certificate)
    except TlsStateError as exc:
        return _fail(str(exc))
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        where = (f"server.tls_cert {server.tls_cert} / server.tls_key {server.tls_key}"
                 if server.tls_cert else f"generated certificate under {server.state_dir}/tls")
        return _fail(f"cannot load the serving certificate ({where}): {exc}")
    if config.auth.enabled:
        try:  # once, here: workers would each fail on a bad key, each with its own message
            load_signing_key(StatePaths(server.state_dir).signing_key)
        except SigningKeyError as exc:
            return _fail(f"cannot start: {exc}")
    if server.workers > 1:
        return _serve_workers(config, certificate.ca)
    return _run_loop(_run(config, context, certificate.ca), server.event_loop)


def _run_loop(main: Coroutine[Any, Any, T], event_loop: str) -> T:
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
    """N processes on one port (SO_REUSEPORT) sharing the disk cache. The parent forwards
    SIGTERM/SIGINT and waits for the workers' graceful stop (killing any still there after
    the grace period and a margin); when one worker dies, it stops the others and exits with
    its status. Workers watch the parent and stop when it dies, however it dies."""
    spawn = multiprocessing.get_context("spawn")
    workers = [spawn.Process(target=_worker_main, args=(config, generated_ca, index),
                             name=f"worker-{index}") for index in range(config.server.workers)]
    deadline: float | None = None

    def stop(_signum: int = signal.SIGTERM, _frame: object = None) -> None:
        nonlocal deadline
        if deadline is None:
            deadline = time.monotonic() + config.server.shutdown_timeout + EXIT_MARGIN
        for worker in workers:  # a second signal is forwarded too: the workers cut at once
            if worker.is_alive():
                worker.terminate()

    # A signal interrupts the wait below (its handler alone would not: the wait resumes).
    wake_read, wake_write = socket.socketpair()
    wake_write.setblocking(False)
    signal.set_wakeup_fd(wake_write.fileno(), warn_on_full_buffer=False)
    signal.signal(signal.SIGTERM, stop)  # before any worker exists: none is ever orphaned
    signal.signal(signal.SIGINT, stop)
    running = []
    for worker in workers:
        if deadline is None:  # not if a signal came meanwhile: it could not reach this one
            worker.start()
            running.append(worker)
    log.info("started %d worker processes", len(running))
    code = 0
    while running:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = multiprocessing.connection.wait([wake_read, *(w.sentinel for w in running)],
                                                timeout)
        if wake_read in ready:
            wake_read.recv(512)
        for worker in [w for w in running if not w.is_alive()]:
            running.remove(worker)
            worker.join()
            if deadline is None:
                log.error("%s exited (%s); stopping the others", worker.name, worker.exitcode)
                code = worker.exitcode or 1
                stop()
        if running and deadline is not None and time.monotonic() >= deadline:
            for worker in running:
                log.error("%s did not stop within %.0f s; killing it", worker.name,
                          config.server.shutdown_timeout + EXIT_MARGIN)
                worker.kill()
                worker.join()
            running, code = [], code or 1
    return code if code >= 0 else 1


def _worker_main(config: Config, generated_ca: Path | None, index: int) -> None:
    configure_logging(config.server.log_level.upper(),
                      f"%(asctime)s %(levelname)s w{index} %(name)s: %(message)s")
    # Ctrl-C reaches the whole process group: the parent alone decides, and forwards SIGTERM.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(config.server.shutdown_timeout)
    certificate = ensure_certificate(config.server)
    raise SystemExit(_run_loop(_run(config, ssl_context(certificate), generated_ca,
                                    reuse_port=True, announce=index == 0),
                               config.server.event_loop))


async def _run(config: Config, context: ssl.SSLContext, generated_ca: Path | None,
               reuse_port: bool = False, announce: bool = True) -> int:
    server = config.server
    access_class: type[PlainAccessLogger | JsonAccessLogger] = (
        JsonAccessLogger if server.access_log == "json" else PlainAccessLogger)
    access_logger = None if server.access_log == "off" else logging.getLogger("proxy.access")
    runner = ProxyRunner(create_app(config), handle_signals=False, access_log=access_logger,
                         access_log_class=access_class,
                         keepalive_timeout=server.keepalive_timeout)
    try:
        await runner.setup()  # opens the cache: its directories, the index
    except (SigningKeyError, OSError, sqlite3.Error) as exc:
        with contextlib.suppress(Exception):  # close what started before the failure
            await runner.app.cleanup()
        if isinstance(exc, SigningKeyError):  # damaged, or the state directory not writable
            return _fail(f"cannot start: {exc}")
        return _fail(describe_start_failure(config.cache.dir, exc))  # e.g. a full disk
    trust_hint = (f"clients must trust the CA {generated_ca} (SSL_CERT_FILE)" if generated_ca
                  else "clients must trust the CA that issued server.tls_cert")
    failures = HandshakeFailures(runner.app[METRICS_KEY].tls_handshake_failures, trust_hint)
    connections = open_connections(server, runner.app[METRICS_KEY])
    # "::" alone is IPv6-only in asyncio; "[::]:PORT" means every interface, so add IPv4.
    hosts = [server.host, "0.0.0.0"] if server.host == "::" else [server.host]
    try:
        for host in hosts:
            await TlsSite(runner, host, server.port, context, failures, connections,
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
    signals = StopSignals()
    # A worker (reuse_port) ignores SIGINT: its parent takes Ctrl-C and forwards SIGTERM.
    signals.install((signal.SIGTERM,) if reuse_port else (signal.SIGTERM, signal.SIGINT))
    await signals.stop.wait()
    log.info("shutting down: no new connections; responses under way get %g s to finish",
             server.shutdown_timeout)
    await stop_serving(runner, server.shutdown_timeout, signals.cut)
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
    # Straight to this machine: an egress proxy from HTTPS_PROXY could not reach it.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=context))
    try:
        with opener.open(f"https://{host}:{config.server.port}/healthz",
                         timeout=5) as response:
            return 0 if response.status == 200 else 1
    except OSError as exc:
        print(f"tf-registry-proxy: unhealthy: {exc}", file=sys.stderr)
        return 1
