"""`prune`: bound the store by use. Removes the blobs (and their records) that no replica
used for --unused-for, and what crashes left behind (see proxy.store.prune); run it from
cron or a Kubernetes CronJob, on the disk backend or the S3 one."""

from __future__ import annotations

import argparse
import contextlib
import logging
import re
import time

from proxy.app import configured_storage
from proxy.cli.logs import COMMAND_FORMAT, configure_logging
from proxy.cli.messages import fail
from proxy.cli.server import run_loop
from proxy.config import Config
from proxy.core.errors import ProxyError
from proxy.core.executors import serving
from proxy.core.metrics import Metrics
from proxy.store.prune import PruneReport, prune

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_DURATION = re.compile(r"(\d+)([smhdw])")
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


def prune_command(config: Config, args: argparse.Namespace) -> int:
    """`prune`: print what goes, then a summary line; exit 0 (1 if the store fails on the
    way: what was removed until then stays removed, a second run goes on)."""
    configure_logging(logging.WARNING, COMMAND_FORMAT)
    try:
        report = run_loop(_prune(config, args.unused_for, args.dry_run),
                          config.server.event_loop)
    except (ProxyError, OSError) as exc:
        fail(f"prune stopped: {exc.message if isinstance(exc, ProxyError) else exc}")
        return 1
    print(report.summary(args.dry_run))
    return 0


async def _prune(config: Config, unused_for: float, dry_run: bool) -> PruneReport:
    prefix = "would remove" if dry_run else "removed"
    async with serving(), contextlib.AsyncExitStack() as opened:
        storage = await configured_storage(config.cache)(config.cache, Metrics(), opened)
        return await prune(storage, unused_for, time.time(), dry_run,
                           report=lambda line: print(f"{prefix} {line}"))
