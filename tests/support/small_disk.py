"""A real, small filesystem (tmpfs) that tests fill up: writes then fail with ENOSPC exactly
as on a full disk, in this process, in SQLite and in child processes alike. Mounting needs
root (CAP_SYS_ADMIN); where that is not allowed the tests that need it are skipped."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

_PIECE = 1 << 20


@contextmanager
def small_filesystem(mount_point: Path, size: int, inodes: int = 2000) -> Iterator[SmallDisk]:
    """A tmpfs of `size` bytes and `inodes` files mounted at mount_point for the duration."""
    mount_point.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o",
                              f"size={size},nr_inodes={inodes},mode=0755", "tmpfs",
                              str(mount_point)], capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield SmallDisk(mount_point)
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=True)


class SmallDisk:
    """Fills the filesystem with a ballast file, and frees it again."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.ballast = root / "ballast"

    def free_bytes(self) -> int:
        """Bytes an unprivileged writer can still use."""
        info = os.statvfs(self.root)
        return info.f_bavail * info.f_frsize

    def fill(self, leave: int = 0) -> None:
        """Write until the filesystem is full, then give back `leave` bytes (whole pages)."""
        with open(self.ballast, "ab", buffering=0) as handle:
            piece = b"\xa5" * _PIECE
            while True:
                try:
                    written = handle.write(piece)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    if len(piece) == 1:
                        break
                    piece = piece[:len(piece) // 2]
                    continue
                if written is not None and written < len(piece):
                    piece = piece[:max(1, len(piece) // 2)]
        if leave:
            size = self.ballast.stat().st_size
            os.truncate(self.ballast, max(0, size - leave))
        assert self.free_bytes() <= leave + os.statvfs(self.root).f_frsize

    def use_all_inodes(self) -> None:
        """Create empty files until no file can be created: blocks are left, inodes not."""
        crowd = self.root / "crowd"
        crowd.mkdir(exist_ok=True)
        for number in range(1_000_000):
            try:
                (crowd / str(number)).touch()
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return

    def empty(self) -> None:
        """Remove the ballast and the empty files: the space is back."""
        self.ballast.unlink(missing_ok=True)
        crowd = self.root / "crowd"
        if crowd.is_dir():
            for child in crowd.iterdir():
                child.unlink()
            crowd.rmdir()
