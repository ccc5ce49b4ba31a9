"""Debian's Chromium, headless, as a child process with a timeout: the DOM a page renders to
(--dump-dom) and a screenshot of it. It is kept off every network but loopback."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
from pathlib import Path

# No traffic but to the page under test: every name but 127.0.0.1 fails to resolve, anything
# else would go through a proxy that does not exist, and the background services are off.
_ISOLATED = (
    "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
    "--no-default-browser-check", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--disable-extensions",
    "--disable-default-apps", "--disable-domain-reliability", "--disable-breakpad",
    "--no-pings", "--ignore-certificate-errors", "--hide-scrollbars",
    "--proxy-server=http://127.0.0.1:9",
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
)


def chromium() -> str:
    """The browser's path; fails (never skips) without it: CI installs it."""
    path = shutil.which("chromium")
    assert path, "chromium (Debian package chromium) is needed: see README"
    return path


TIMEOUT_SECONDS = 90.0


async def run_chromium(home: Path, *args: str) -> bytes:
    """Run the browser with its own profile under home; its standard output."""
    home.mkdir(parents=True, exist_ok=True)
    process = await asyncio.create_subprocess_exec(
        chromium(), *_ISOLATED, f"--user-data-dir={home / 'profile'}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        start_new_session=True)  # its helper processes go with it on a timeout
    try:
        out, err = await asyncio.wait_for(process.communicate(), TIMEOUT_SECONDS)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        await process.wait()
        raise AssertionError(f"chromium did not finish within {TIMEOUT_SECONDS} s") from None
    assert process.returncode == 0, err.decode(errors="replace")[-3000:]
    return out


async def dump_dom(url: str, home: Path) -> str:
    """The page's DOM once loaded, serialized as HTML."""
    return (await run_chromium(home, "--dump-dom", url)).decode()


async def screenshot(url: str, path: Path, home: Path, width: int, height: int) -> None:
    """A PNG of the page in a window of that size."""
    await run_chromium(home, f"--screenshot={path}", f"--window-size={width},{height}", url)
    assert path.is_file(), f"chromium wrote no screenshot to {path}"
