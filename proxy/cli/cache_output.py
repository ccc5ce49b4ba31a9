"""How the cache commands print: the listing and the stats as text or JSON, sizes and times
as people read them, and progress (a bar on a terminal, plain lines otherwise)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from proxy.store.contents import CacheStats, HeldBlob, Tally

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def size_text(size: int) -> str:
    """1536 -> "1.5 KiB"."""
    value, unit = float(size), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{size} B" if unit == 0 else f"{value:.1f} {_UNITS[unit]}"


def time_text(epoch: float | None) -> str:
    """An epoch time as UTC, to the minute ("-" for none)."""
    if epoch is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(epoch))


def _iso(epoch: float | None) -> str | None:
    return None if epoch is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch))


def listing_text(held: list[HeldBlob]) -> str:
    """What `cache list` prints: per address its versions (and platforms), sizes and last
    use, then a total line."""
    lines: list[str] = []
    for kind in ("provider", "module"):
        current = None
        for blob in sorted((b for b in held if b.kind == kind),
                           key=lambda b: (b.address, b.version, b.platform or "")):
            if blob.address != current:
                current = blob.address
                lines.append(f"{kind} {blob.address}")
            note = "" if blob.recorded else "  (no record vouches for it: not served as is)"
            lines.append(f"  {blob.version:<14} {blob.platform or '':<16} "
                         f"{size_text(blob.info.size):>10}  last used "
                         f"{time_text(blob.last_used)}{note}")
    packages = [b for b in held if b.kind == "provider"]
    modules = [b for b in held if b.kind == "module"]
    lines.append(
        f"{len(packages)} provider packages ({len({b.address for b in packages})} providers), "
        f"{len(modules)} module archives ({len({b.address for b in modules})} modules): "
        f"{size_text(sum(b.info.size for b in held))}")
    return "\n".join(lines) + "\n"


def listing_json(held: list[HeldBlob]) -> str:
    """What `cache list --json` prints."""
    def entry(blob: HeldBlob) -> dict[str, Any]:
        found: dict[str, Any] = {"address": blob.address, "version": blob.version}
        if blob.kind == "provider":
            found["platform"] = blob.platform
        found.update({"size": blob.info.size, "written": _iso(blob.info.mtime),
                      "last_used": _iso(blob.last_used), "recorded": blob.recorded,
                      "key": blob.key})
        return found

    return json.dumps({
        "providers": [entry(b) for b in held if b.kind == "provider"],
        "modules": [entry(b) for b in held if b.kind == "module"],
        "total_bytes": sum(b.info.size for b in held)}, indent=2) + "\n"


def stats_text(stats: CacheStats, where: str, limit: int | None, ledger: str | None) -> str:
    """What `cache stats` prints."""
    def tally(what: str, found: Tally) -> str:
        return f"{what}: {found.blobs} files, {size_text(found.bytes)}"

    lines = [f"store: {where}",
             f"limit: {size_text(limit) if limit else 'none'} (cache.max_size)"]
    if ledger:
        lines.append(ledger)
    lines += [tally("held", stats.total),
              tally(f"  provider packages ({stats.addresses['provider']} providers)",
                    stats.kinds["provider"]),
              tally(f"  module archives ({stats.addresses['module']} modules)",
                    stats.kinds["module"]),
              "per host:"]
    lines += [tally(f"  {host}", found) for host, found in sorted(stats.hosts.items())]
    lines += [f"oldest use: {time_text(stats.total.oldest_use)}",
              f"newest use: {time_text(stats.total.newest_use)}",
              f"without a record (fetched again when asked for): {stats.unrecorded}"]
    return "\n".join(lines) + "\n"


def stats_json(stats: CacheStats, where: str, limit: int | None) -> str:
    """What `cache stats --json` prints."""
    def tally(found: Tally) -> dict[str, Any]:
        return {"files": found.blobs, "bytes": found.bytes,
                "oldest_use": _iso(found.oldest_use), "newest_use": _iso(found.newest_use)}

    return json.dumps({
        "store": where, "limit_bytes": limit, **tally(stats.total),
        "providers": {**tally(stats.kinds["provider"]),
                      "addresses": stats.addresses["provider"]},
        "modules": {**tally(stats.kinds["module"]), "addresses": stats.addresses["module"]},
        "hosts": {host: tally(found) for host, found in sorted(stats.hosts.items())},
        "unrecorded": stats.unrecorded}, indent=2) + "\n"


class Progress:
    """Progress of a long command: on a terminal a bar on stderr (lines printed meanwhile go
    above it); otherwise nothing but the lines the command prints."""

    def __init__(self, bar: Any | None, task: Any | None) -> None:
        self._bar = bar
        self._task = task

    @property
    def on_terminal(self) -> bool:
        """Whether a bar is shown (the command may then print fewer lines)."""
        return self._bar is not None

    def update(self, done: int, total: int, text: str = "") -> None:
        """done of total, now at text."""
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total, item=text[-60:])


@contextmanager
def progress(label: str) -> Iterator[Progress]:
    """A Progress for label: a rich bar when stderr is a terminal."""
    if not sys.stderr.isatty():
        yield Progress(None, None)
        return
    # Imported on a terminal only: commands in scripts and CI do not load it.
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        TextColumn,
        TimeRemainingColumn,
    )
    from rich.progress import Progress as Bar
    with Bar(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
             TextColumn("{task.fields[item]}", markup=False),
             console=Console(stderr=True), transient=True,
             # Lines for stdout go above the bar only when stdout is that terminal too.
             redirect_stdout=sys.stdout.isatty()) as bar:
        yield Progress(bar, bar.add_task(label, total=None, item=""))
