"""`cache list|verify|prune|stats`: what the cache holds, checked again, bounded and counted,
on the disk backend or S3, safe beside running servers (proxy.store.contents,
proxy.verification.stored_checks, proxy.store.prune). Exit status: 0; 1 when verify found
damaged files (or the store failed on the way); 2 for bad input or an unusable cache."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from proxy.cli.cache_output import (
    listing_json,
    listing_text,
    progress,
    size_text,
    stats_json,
    stats_text,
)
from proxy.cli.cache_store import opened_store, run_on_store, where
from proxy.cli.logs import COMMAND_FORMAT, configure_logging
from proxy.cli.prune import add_prune_options, pattern, prune_command
from proxy.cli.verify_reports import DamageReports
from proxy.config import Config
from proxy.store.contents import AddressPattern, HeldBlob, held_blobs, stats_of
from proxy.verification.stored_checks import VerifyReport, verify_held

_COMMANDS = {
    "list": "what the cache holds: providers (versions, platforms) and modules (versions), "
            "with sizes and last use",
    "verify": "read every stored file again and check it against its verified record "
              "(sha256, and h1 where recorded); drop the bad ones (fetched again when next "
              "asked for); exit 1 if any was bad",
    "prune": "remove what was not used lately, what FILTER selects, or the least recently "
             "used beyond a size (the `prune` command)",
    "stats": "counts and bytes per kind and per host, the limit, the oldest and newest use",
}
# Files found damaged: verify's exit status.
DAMAGED = 1


def add_cache_commands(cache: argparse.ArgumentParser) -> None:
    """`cache`'s own commands and their options."""
    commands = cache.add_subparsers(dest="cache_command", required=True, metavar="COMMAND")
    for name, text in _COMMANDS.items():
        command = commands.add_parser(name, help=text, description=text)
        # Here, not on `cache`: after the command, where the other commands take it.
        command.add_argument("--config", type=Path, metavar="FILE",
                             help="TOML config file (default: $TF_REGISTRY_PROXY_CONFIG, "
                                  "else built-in defaults)")
        if name == "prune":
            add_prune_options(command)
            continue
        if name in ("list", "verify"):
            command.add_argument("filter", nargs="?", type=pattern, metavar="FILTER",
                                 help="only what this address pattern selects, e.g. "
                                      "registry.terraform.io/hashicorp/*, hashicorp/aws or "
                                      "a module address prefix")
        if name in ("list", "stats"):
            command.add_argument("--json", action="store_true",
                                 help="print JSON (for scripts)")
        if name == "verify":
            command.add_argument("--dry-run", action="store_true",
                                 help="report bad files; drop none")
            command.add_argument("--objects", action="store_true",
                                 help="with cache.s3: read the bucket's objects themselves "
                                      "(every byte, from the bucket), not this replica's hot "
                                      "copies of them")


def cache_command(config: Config, args: argparse.Namespace) -> int:
    """Run `cache COMMAND`."""
    configure_logging(logging.WARNING, COMMAND_FORMAT)
    if args.cache_command == "prune":
        return prune_command(config, args)
    if args.cache_command == "verify":
        return run_on_store(_verify(config, args.filter, args.dry_run, args.objects), config,
                            "verify")
    if args.cache_command == "stats":
        return run_on_store(_stats(config, args.json), config, "stats")
    return run_on_store(_list(config, args.filter, args.json), config, "list")


async def _list(config: Config, selected: AddressPattern | None, as_json: bool) -> int:
    async with opened_store(config) as storage:
        held = await held_blobs(storage, selected)
    print(listing_json(held) if as_json else listing_text(held), end="")
    return 0


async def _stats(config: Config, as_json: bool) -> int:
    async with opened_store(config) as storage:
        stats = stats_of(await held_blobs(storage))
        blobs = storage.blobs
        blobs.reread_usage()
        what = "usage record" if config.cache.s3 is None else "hot copies"
        ledger = f"{what}: {blobs.file_count} files, {size_text(blobs.used_bytes)}"
    limit = config.cache.max_size
    print(stats_json(stats, where(config), limit) if as_json
          else stats_text(stats, where(config), limit, ledger), end="")
    return 0


async def _verify(config: Config, selected: AddressPattern | None, dry_run: bool,
                  objects: bool) -> int:
    async with opened_store(config) as storage:
        held = await held_blobs(storage, selected)
        with DamageReports(config, dry_run) as reports, progress("verify") as shown:
            done = 0

            def outcome(blob: HeldBlob, what: str, why: str) -> None:
                nonlocal done
                done += 1
                shown.update(done, len(held), blob.key)
                if what == "bad":
                    print(f"BAD {blob.key}: {why}")
                elif not shown.on_terminal:  # the plain progress: one line per file
                    print(f"{_OUTCOMES[what]} {blob.key}")

            shown.update(0, len(held))
            report = await verify_held(storage, held, dry_run, outcome, reports.damaged,
                                       shared=objects)
    print(_summary(report, dry_run))
    return DAMAGED if report.bad else 0


_OUTCOMES = {"good": "ok", "unrecorded": "not checked (no record vouches for it)",
             "gone": "gone meanwhile"}


def _summary(report: VerifyReport, dry_run: bool) -> str:
    dropped = "none dropped (--dry-run)" if dry_run else f"{report.dropped} dropped, to be " \
        "fetched again when next asked for"
    return (f"verify: {report.good} good ({size_text(report.bytes_read)} read), "
            f"{len(report.bad)} bad ({dropped}), {report.unrecorded} without a record, "
            f"{report.gone} gone meanwhile")
