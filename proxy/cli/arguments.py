"""The command line's arguments: every command, its options and their help."""

from __future__ import annotations

import argparse
from pathlib import Path

from proxy import __version__
from proxy.airgap.signing import PUBLIC_KEY_FILE, SECRET_KEY_FILE
from proxy.cli.cache import add_cache_commands
from proxy.cli.client_config import MODES as CLIENT_CONFIG_MODES
from proxy.cli.policy import add_policy_options
from proxy.cli.prune import add_prune_options

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


def build_parser() -> argparse.ArgumentParser:
    """Every command and its options."""
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
                       ("keys", "export the registry signing keys the cache holds, per "
                                "provider namespace (for review and import --trusted-keys)"),
                       ("tls", "show the generated CA, or replace it (rotate)"),
                       ("prune", "remove what the cache holds that was not used lately "
                                 "(run it from cron; the same as `cache prune`)"),
                       ("cache", "list, verify, prune or count what the cache holds"),
                       ("policy", "check which versions the version policy ([policy]) hides, "
                                  "why, and from when they will be served")):
        command = commands.add_parser(name, help=text, description=text,
                                      epilog=_EPILOGS.get(name))
        if name == "cache":  # its commands take --config themselves
            add_cache_commands(command)
        elif name != "keygen":
            command.add_argument("--config", type=Path, metavar="FILE",
                                 help="TOML config file (default: $TF_REGISTRY_PROXY_CONFIG, "
                                      "else built-in defaults)")
        if name in ("warm", "export"):
            command.add_argument("sources", nargs="*",
                                 metavar="SOURCE",
                                 help="a configuration directory, a .terraform.lock.hcl, or "
                                      "a list file (one 'ADDRESS [CONSTRAINT]' a line)")
        if name == "warm":
            command.add_argument("--cli", nargs=2, action="append", default=[],
                                 metavar=("PRODUCT", "VERSION"),
                                 help="repeatable: a Terraform or OpenTofu release "
                                      "(terraform|opentofu, a version or a constraint such "
                                      "as '~> 1.11'), for each --platform")
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
                                      "--allow-unsigned")
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
            # --allow-unsigned-bundle: the name before directories were imported (kept).
            origin.add_argument("--allow-unsigned", "--allow-unsigned-bundle",
                                dest="allow_unsigned", action="store_true",
                                help="import what nobody signed: a bundle exported "
                                     "--unsigned, or a `terraform providers mirror` "
                                     "directory (its zips are checked against the hashes "
                                     "it lists); nothing then vouches for its origin, its "
                                     "modules or the keys it carries: only for one that "
                                     "came over a path you trust")
            command.add_argument("--trusted-keys", type=Path, metavar="KEYS.asc",
                                 help="optional extra check: armored OpenPGP keys (e.g. a "
                                      "registry's release keys) that every provider "
                                      "signature must also verify with")
        if name == "keygen":
            command.add_argument("--output", type=Path, required=True, metavar="DIR",
                                 help=f"where to write {SECRET_KEY_FILE} (keep it on the "
                                      f"exporting side) and {PUBLIC_KEY_FILE} (for importers)"
                                      "; existing files are never overwritten")
        if name == "keys":
            command.add_argument("action", choices=("export",),
                                 help="export: list the keys (key ID, fingerprint, the "
                                      "providers they sign), and write them with --output")
            command.add_argument("--output", type=Path, metavar="DIR|FILE.asc",
                                 help="FILE.asc: every key in one armored file (import "
                                      "--trusted-keys takes it); a directory: "
                                      "HOST/NAMESPACE.asc per namespace and keys.json")
        if name == "tls":
            command.add_argument(
                "action", choices=("show", "rotate"),
                help="show: the CA's path, names and expiry; rotate: replace the CA (every "
                     "client must then trust the new one)")
        if name == "prune":
            add_prune_options(command)
        if name == "policy":
            add_policy_options(command)
        if name == "client-config":
            command.add_argument(
                "--mode", choices=CLIENT_CONFIG_MODES, default="mirror",
                help="mirror: providers through the network mirror (default); registry: "
                     "through host blocks, so lock files match a direct install; oci: "
                     "OpenTofu's oci_mirror, from the proxy's OCI endpoint")
    return parser
