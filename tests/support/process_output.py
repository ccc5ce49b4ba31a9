"""Reading a running process's output without blocking past a deadline."""

from __future__ import annotations

import os
import select
import subprocess
import time


def wait_for_line(process: subprocess.Popen[str], text: str, timeout: float) -> bool:
    """Whether text appears in process.stdout within timeout seconds. Reads the pipe's file
    descriptor itself: a buffered reader may hold the line while select says nothing is left."""
    assert process.stdout is not None
    fd = process.stdout.fileno()
    seen = b""
    wanted = text.encode()
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return False
        data = os.read(fd, 65536)
        if not data:  # the process closed its output
            return False
        seen += data
        if wanted in seen:
            return True
    return False
