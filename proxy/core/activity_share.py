"""Snapshots shared by the processes of one proxy (its workers): each writes its own as
`<directory>/<pid>.json`, whole (a temp file renamed over it), every few seconds; a reader
takes those written recently and ignores the rest (a process that ended). Commands that run
and end (`cache verify`) leave their integrity failures in `<directory>/FAILURES_FILE`
instead, the newest few, for the page to show beside the servers'. Blocking I/O: run it off
the event loop."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

# How often each process writes its snapshot, and after how long without a write a snapshot
# is taken to be a dead process's (several missed writes: a busy process is not dropped).
WRITE_SECONDS = 2.0
LIVE_SECONDS = 10.0
# Snapshots older than this are deleted by whoever reads them (a killed process's).
FORGOTTEN_SECONDS = 600.0
# The integrity failures commands found (a list of the entries Activity records).
FAILURES_FILE = "command-failures.json"


class SnapshotShare:
    """One process's place among the snapshots in directory."""

    def __init__(self, directory: Path, pid: int | None = None) -> None:
        self.directory = directory
        self.pid = os.getpid() if pid is None else pid
        self._path = directory / f"{self.pid}.json"

    def write(self, snapshot: dict[str, Any]) -> None:
        """Replace this process's snapshot (readers see the old one or the new one whole)."""
        self._replace(self._path, snapshot)

    def add_failures(self, failures: list[dict[str, Any]], keep: int) -> None:
        """Add failures (entries as Activity records them) to the commands' shared ones,
        keeping the newest keep (a damaged file is started afresh). Two commands that add
        at the same moment may lose one's: the page is a view, the audit log the record."""
        merged = sorted([*failures, *self.command_failures()],
                        key=lambda failure: failure["time"], reverse=True)
        self._replace(self.directory / FAILURES_FILE, merged[:keep])

    def command_failures(self) -> list[dict[str, Any]]:
        """The integrity failures commands shared (none if the file is missing or damaged;
        entries of another shape are skipped)."""
        try:
            with open(self.directory / FAILURES_FILE) as handle:
                found = json.load(handle)
        except (OSError, ValueError):
            return []
        if not isinstance(found, list):
            return []
        return [entry for entry in found if _failure_entry(entry)]

    def _replace(self, path: Path, content: object) -> None:
        # A temp file renamed over path: readers see the old content or the new one whole.
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=self.directory, prefix=f".{self.pid}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(content, handle, separators=(",", ":"))
            os.replace(temp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise

    def others(self) -> list[dict[str, Any]]:
        """The snapshots the other live processes wrote (unreadable ones are skipped)."""
        found = []
        now = time.time()
        try:
            entries = list(os.scandir(self.directory))
        except FileNotFoundError:
            return []
        for entry in entries:
            if entry.name in (self._path.name, FAILURES_FILE):
                continue
            try:
                age = now - entry.stat().st_mtime
                if age > FORGOTTEN_SECONDS:
                    os.unlink(entry.path)  # a killed process's, or a temp file it left
                    continue
                if age > LIVE_SECONDS or not entry.name.endswith(".json") \
                        or entry.name.startswith("."):
                    continue
                with open(entry.path) as handle:
                    snapshot = json.load(handle)
            except (OSError, ValueError):  # gone meanwhile, or not ours
                continue
            if isinstance(snapshot, dict):
                found.append(snapshot)
        return found

    def remove(self) -> None:
        """Withdraw this process's snapshot (a clean shutdown)."""
        with contextlib.suppress(FileNotFoundError):
            self._path.unlink()


def _failure_entry(entry: object) -> bool:
    """Whether entry has the shape of a failure Activity records."""
    return isinstance(entry, dict) and isinstance(entry.get("time"), int | float) \
        and not isinstance(entry.get("time"), bool) \
        and all(isinstance(entry.get(key), str) for key in ("artifact", "kind", "reason"))
