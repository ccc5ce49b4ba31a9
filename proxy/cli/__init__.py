"""Command line: `serve`, `client-config`, `healthcheck`, `tls`, and the air-gap commands
`warm`, `export`, `import`, `keygen` and `keys`, `prune` and `cache`, and `policy`; one module per
command group."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from proxy.cli.arguments import build_parser
from proxy.cli.cache import cache_command
from proxy.cli.client_config import ClientConfigError, render_client_config
from proxy.cli.healthcheck import healthcheck
from proxy.cli.keys import keygen, keys_export, tls
from proxy.cli.logs import configure_logging
from proxy.cli.policy import policy_command
from proxy.cli.prune import prune_command
from proxy.cli.serve import serve
from proxy.config import ConfigError, load_config
from proxy.core.redaction import mask_secrets
from proxy.tls.certificates import generated_ca_path

__all__ = ["configure_logging", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `tf-registry-proxy` script and `python -m proxy`."""
    args = build_parser().parse_args(argv)
    if args.command == "keygen":
        return keygen(args.output)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print("tf-registry-proxy: invalid configuration:", file=sys.stderr)
        for problem in exc.problems:
            print(f"  - {mask_secrets(problem)}", file=sys.stderr)
        return 2
    if args.command == "client-config":
        try:
            text = render_client_config(config, generated_ca_path(config.server), args.mode)
        except ClientConfigError as exc:
            print(f"tf-registry-proxy client-config: {exc}", file=sys.stderr)
            return 2
        sys.stdout.write(text)
        return 0
    if args.command == "tls":
        return tls(config, args.action)
    if args.command == "keys":
        return keys_export(config, args.output)
    if args.command == "healthcheck":
        return healthcheck(config)
    if args.command in ("warm", "export", "import"):
        # Imported for these commands only: with the bundle code comes the S3 client
        # library (botocore), about 15 MiB of memory a serving process need not carry.
        from proxy.cli import airgap
        command = {"warm": airgap.warm_command, "export": airgap.export_command,
                   "import": airgap.import_command}[args.command]
        return command(config, args)
    if args.command == "prune":
        return prune_command(config, args)
    if args.command == "cache":
        return cache_command(config, args)
    if args.command == "policy":
        return policy_command(config, args)
    return serve(config)
