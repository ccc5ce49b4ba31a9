"""Reading a running process's output without blocking past a deadline."""

from __future__ import annotations

import select
import subprocess
import time


def wait_for_line(process: subprocess.Popen[str], text: str, timeout: float) -> bool:
    """Whether a line containing text appears on process.stdout within timeout seconds.
    Lines read on the way are consumed."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([process.stdout], [], [], left)
        if not ready:
            return False
        line = process.stdout.readline()
        if not line:  # the process closed its output
            return False
        if text in line:
            return True
    return False
