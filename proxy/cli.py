"""Command line: `serve` and `client-config`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from aiohttp import web

from proxy import __version__
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
                       ("client-config", "print a Terraform CLI config that uses this proxy")):
        command = commands.add_parser(name, help=text, description=text)
        command.add_argument("--config", type=Path, metavar="FILE",
                             help="TOML config file (default: $TF_REGISTRY_PROXY_CONFIG, "
                                  "else built-in defaults)")
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
        sys.stdout.write(render_client_config(config, generated_ca))
        return 0
    return _serve(config)


def _serve(config: Config) -> int:
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config.cache.dir.mkdir(parents=True, exist_ok=True)
        certificate = ensure_certificate(config.server, config.cache.dir)
        context = ssl_context(certificate)
    except (OSError, ValueError) as exc:
        print(f"tf-registry-proxy: cannot set up TLS or the cache directory: {exc}",
              file=sys.stderr)
        return 2
    if certificate.ca is not None:
        log.info("serving with a generated certificate; clients trust it with "
                 "SSL_CERT_FILE=%s", certificate.ca)
    log.info("network mirror at %smirror/ (cache: %s)", config.server.base_url,
             config.cache.dir)
    web.run_app(create_app(config), host=config.server.host, port=config.server.port,
                ssl_context=context, print=None, handle_signals=True,
                access_log_format='%a "%r" %s %b %Tfs')
    return 0
