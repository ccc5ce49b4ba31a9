"""Snapshots shared by the processes of one proxy (its workers): each writes its own as
`<directory>/<pid>.json`, whole (a temp file renamed over it), every few seconds; a reader
takes those written recently and ignores the rest (a process that ended). Blocking I/O: run
it off the event loop."""

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


class SnapshotShare:
    """One process's place among the snapshots in directory."""

    def __init__(self, directory: Path, pid: int | None = None) -> None:
        self.directory = directory
        self.pid = os.getpid() if pid is None else pid
        self._path = directory / f"{self.pid}.json"

    def write(self, snapshot: dict[str, Any]) -> None:
        """Replace this process's snapshot (readers see the old one or the new one whole)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=self.directory, prefix=f".{self.pid}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(snapshot, handle, separators=(",", ":"))
            os.replace(temp, self._path)
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
            if entry.name == self._path.name:
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
