"""The air-gap commands: `warm` (fill a cache ahead of time), `export` (write it as a
signed bundle) and `import` (verify a bundle or a mirror directory, then add it)."""

from __future__ import annotations

import argparse
import logging
import ssl
import sys
from pathlib import Path

from proxy.airgap.export import export_bundle
from proxy.airgap.import_bundle import (
    import_bundle,
    import_mirror_directory,
    split_armored_keys,
)
from proxy.airgap.manifest import BundleError
from proxy.airgap.signing import SigningError, load_public_keys, load_signer
from proxy.airgap.sources import CliRequirement, Requirement, SourceError, read_sources
from proxy.airgap.warm import summary as warm_summary
from proxy.airgap.warm import warm, warm_cache
from proxy.cli.logs import COMMAND_FORMAT, configure_logging
from proxy.cli.messages import fail
from proxy.cli.server import run_loop
from proxy.config import Config
from proxy.core.errors import BadRequest
from proxy.core.models import Platform
from proxy.core.releases import PRODUCTS


def warm_command(config: Config, args: argparse.Namespace) -> int:
    """`warm`: fetch what the sources name through a running proxy or into the cache."""
    configure_logging(logging.WARNING, COMMAND_FORMAT)
    requirements: list[Requirement | CliRequirement] = []
    try:
        requirements += read_sources(args.sources) if args.sources else []
        for product, version in args.cli:
            if product not in PRODUCTS:
                return fail(f"--cli {product!r}: expected one of {', '.join(PRODUCTS)}")
            requirements.append(CliRequirement(product, version))
    except SourceError as exc:
        return fail(str(exc))
    if not requirements:
        return fail("nothing to warm: give SOURCE arguments, --cli PRODUCT VERSION, or both")
    platforms = args.platform or [p for p in config.filters.platforms
                                  if not any(c in p for c in "*?[")] or ["linux_amd64"]
    for platform in platforms:
        try:
            Platform.from_key(platform)
        except BadRequest:
            return fail(f"--platform {platform!r}: expected OS_ARCH, e.g. linux_amd64")
    if args.proxy and not args.proxy.startswith("https://"):
        return fail("--proxy: the proxy's https:// URL, e.g. https://127.0.0.1:8443/")
    if args.proxy:
        context = ssl.create_default_context(
            cafile=str(args.ca_file) if args.ca_file else None)
        results = run_loop(warm(args.proxy, requirements, platforms, context, args.token),
                           config.server.event_loop)
    else:
        results = run_loop(warm_cache(config, requirements, platforms),
                           config.server.event_loop)
    sys.stdout.write(warm_summary(results))
    return 0 if all(r.ok for r in results) else 1


def export_command(config: Config, args: argparse.Namespace) -> int:
    """`export`: the cache, or what the sources select from it, as one tar bundle."""
    if args.passphrase_file is not None and args.signing_key is None:
        return fail("--passphrase-file goes with --signing-key")
    try:
        # The key first: a wrong key or passphrase fails before any work is done.
        signer = None if args.unsigned else load_signer(args.signing_key,
                                                        args.passphrase_file)
        requirements = read_sources(args.sources) if args.sources else None
        if requirements is not None and not requirements:
            return fail("the SOURCE arguments name no provider or registry module")
        counts = export_bundle(config, args.output, requirements, signer)
    except (SourceError, BundleError, SigningError) as exc:
        return fail(str(exc))
    if counts.unmatched:
        args.output.unlink(missing_ok=True)
        return fail("not in the cache (warm it first): " + ", ".join(counts.unmatched))
    if counts.providers + counts.modules + counts.releases == 0:
        args.output.unlink(missing_ok=True)
        return fail("the cache holds nothing to export")
    signed = f"signed with key {counts.signed_by}" if counts.signed_by else "UNSIGNED"
    releases = f", {counts.releases} CLI release archives" if counts.releases else ""
    print(f"wrote {args.output}: {counts.providers} provider packages, {counts.modules} "
          f"module archives{releases}, {signed}")
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


def import_command(config: Config, args: argparse.Namespace) -> int:
    """`import`: verify a bundle (or a mirror directory) and add it to the cache."""
    directory = args.bundle.is_dir()
    if directory and (args.bundle / "manifest.json").exists():
        return fail(f"{args.bundle} looks like an unpacked bundle: import the .tar that "
                    "`export` wrote")
    if directory and (not args.allow_unsigned or args.trusted_keys is not None
                      or args.bundle_key is not None):
        return fail(f"{args.bundle} is a `terraform providers mirror` directory: nothing in "
                    "it is signed, so no key can vouch for it (--bundle-key and "
                    "--trusted-keys have nothing to check); each zip is checked against the "
                    "hashes its VERSION.json lists. Import it with --allow-unsigned if it "
                    "came over a path you trust")
    if args.bundle_key is None and not args.allow_unsigned:
        return fail("import needs --bundle-key FILE (the exporter's public key, from "
                    "`keygen`), or --allow-unsigned for a bundle that came over a path you "
                    "trust")
    try:
        trusted = None if args.trusted_keys is None else _trusted_keys(args.trusted_keys)
        if directory:
            counts = import_mirror_directory(config, args.bundle)
            if counts.providers + counts.present == 0:
                return fail(f"{args.bundle} holds no `terraform providers mirror` packages "
                            "(HOST/NAMESPACE/TYPE/terraform-provider-*.zip)")
        else:
            keys = None if args.bundle_key is None else [
                cert for path in args.bundle_key for cert in load_public_keys(path)]
            counts = import_bundle(config, args.bundle, keys, trusted)
    except OSError as exc:
        return fail(f"cannot read {exc.filename}: {exc.strerror}")
    except SigningError as exc:
        return fail(str(exc))
    except BundleError as exc:
        return fail(f"refused {args.bundle}: {exc}")
    origin = f"bundle signed by {counts.signed_by}" if counts.signed_by \
        else "origin not checked: --allow-unsigned"
    present = f"; {counts.present} already in the cache" if counts.present else ""
    releases = f", {counts.releases} CLI release archives" if counts.releases else ""
    print(f"imported {counts.providers} provider packages, {counts.modules} module archives"
          f"{releases} ({origin}){present}")
    return 0
