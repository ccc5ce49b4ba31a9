"""`keygen` (the key pair that signs and verifies bundles), `keys export` (the registry
signing keys the cache holds) and `tls` (show or rotate the generated CA)."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from proxy.airgap.signing import SigningError, generate_key_pair
from proxy.cli.logs import COMMAND_FORMAT, configure_logging
from proxy.cli.messages import fail
from proxy.config import Config
from proxy.tls.certificates import describe, rotate_ca
from proxy.tls.state import StatePaths, adopt_legacy_state


def keygen(directory: Path) -> int:
    """Write a bundle-signing key pair into directory and say what each half is for."""
    try:
        pair = generate_key_pair(directory)
    except SigningError as exc:
        return fail(str(exc))
    print(f"wrote {pair.secret} (secret: it signs bundles; keep it on the exporting side)\n"
          f"wrote {pair.public} (public: importers verify with it, import --bundle-key)\n"
          f"fingerprint {pair.fingerprint} (compare it with the importers' copy)")
    return 0


def keys_export(config: Config, output: Path | None) -> int:
    """`keys export`: list the registry signing keys the cache holds, per provider
    namespace, and write them to output (a .asc file, or a directory) if given."""
    configure_logging(logging.WARNING, COMMAND_FORMAT)
    # Imported here: with it comes the S3 client library (see proxy.cli.main).
    from proxy.airgap.keys_export import describe, held_keys, write_keys
    from proxy.airgap.manifest import BundleError
    try:
        found = held_keys(config)
        if not found:
            return fail("the cache holds no verified provider package with signing keys")
        written = write_keys(found, output) if output is not None else []
    except BundleError as exc:
        return fail(str(exc))
    sys.stdout.write(describe(found))
    for path in written:
        print(f"wrote {path}")
    return 0


def tls(config: Config, action: str) -> int:
    """`tls show`: the generated CA's path, names and expiry; `tls rotate`: a new CA."""
    configure_logging(logging.WARNING, COMMAND_FORMAT)
    server = config.server
    if server.tls_cert is not None:
        return fail(f"the proxy serves with server.tls_cert {server.tls_cert}, not a "
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
            return fail(f"no CA yet: `serve` creates one at {ca} on first start")
        sys.stdout.write(describe(server))
    except (OSError, ValueError) as exc:
        return fail(f"generated certificate under {server.state_dir}: {exc}")
    return 0
