"""`prune` and `cache prune`: bound the store by use. Removes the blobs (and their records)
that no replica used for --unused-for, those a FILTER selects, or the least recently used
beyond --to-size, and what crashes left behind (see proxy.store.prune); run it from cron or
a Kubernetes CronJob, on the disk backend or the S3 one."""

from __future__ import annotations

import argparse
import logging
import re
import time

from proxy.cli.cache_output import progress
from proxy.cli.cache_store import opened_store, run_on_store
from proxy.cli.logs import COMMAND_FORMAT, configure_logging
from proxy.config import Config
from proxy.config.settings import parse_size
from proxy.store.contents import AddressPattern, BadPattern
from proxy.store.prune import PruneRules, prune

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"(\d+)([smhdw])", re.ASCII)
# Uses are recorded at most hourly (S3 marks): a shorter period would take blobs in use.
MIN_UNUSED_FOR = 3600


def duration(text: str) -> float:
    """--unused-for: a number and a unit (s, m, h, d, w), at least an hour."""
    found = _DURATION.fullmatch(text.strip())
    if found is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: a number and a unit, e.g. 30d, 12h, 2w")
    seconds = int(found.group(1)) * _UNITS[found.group(2)]
    if seconds < MIN_UNUSED_FOR:
        raise argparse.ArgumentTypeError(
            f"{text!r} is shorter than an hour: uses are recorded at most hourly, so blobs "
            "in use would be taken")
    return float(seconds)


def size(text: str) -> int:
    """--to-size: bytes, or a number and a unit (e.g. 10GiB, 500MB)."""
    found = parse_size(text.strip())
    if found is None or found < 0:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: a number of bytes, or with a unit, e.g. 10GiB, 500MB")
    return found


def pattern(text: str) -> AddressPattern:
    """FILTER: an address pattern (see proxy.store.contents.AddressPattern)."""
    try:
        return AddressPattern.parse(text)
    except BadPattern as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_prune_options(command: argparse.ArgumentParser) -> None:
    """The options of `prune` and `cache prune` (the same command)."""
    command.add_argument("filter", nargs="?", type=pattern, metavar="FILTER",
                         help="only what this address pattern selects, e.g. "
                              "registry.terraform.io/hashicorp/* or hashicorp/aws; alone, "
                              "all of it goes")
    command.add_argument("--unused-for", type=duration, metavar="DURATION",
                         help="remove packages and modules no replica used for this "
                              "long (e.g. 30d, 12h, 2w; at least 1h), with their records")
    command.add_argument("--to-size", type=size, metavar="SIZE",
                         help="then remove the least recently used until the packages and "
                              "modules take at most SIZE (e.g. 10GiB)")
    command.add_argument("--dry-run", action="store_true",
                         help="print what would be removed; remove nothing")
    command.set_defaults(parser=command)  # to refuse a prune without a rule


def prune_command(config: Config, args: argparse.Namespace) -> int:
    """`prune`: print what goes, then a summary line; exit 0 (1 if the store fails on the
    way: what was removed until then stays removed, a second run goes on; 2 for bad
    input)."""
    configure_logging(logging.WARNING, COMMAND_FORMAT)
    rules = PruneRules(args.unused_for, args.filter, args.to_size)
    if rules == PruneRules():
        args.parser.error("give what to remove: --unused-for, FILTER or --to-size")
    return run_on_store(_prune(config, rules, args.dry_run), config, "prune")


async def _prune(config: Config, rules: PruneRules, dry_run: bool) -> int:
    prefix = "would remove" if dry_run else "removed"
    async with opened_store(config) as storage:
        with progress("prune") as shown:
            report = await prune(storage, rules.unused_for, time.time(), dry_run,
                                 report=lambda line: print(f"{prefix} {line}"), rules=rules,
                                 progress=shown.update)
    print(report.summary(dry_run))
    return 0
