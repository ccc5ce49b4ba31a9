"""Programs the tests run that the README's test command unpacks rather than installs
(Prometheus and Distribution's registry: installing their Debian packages would start them
as services on the host)."""

from __future__ import annotations

import shutil
from pathlib import Path

# Where `apt-get download PACKAGE && dpkg-deb -x PACKAGE_*.deb PACKAGE` (run in .tools/)
# leaves each package's files.
TOOLS = Path(__file__).resolve().parents[2] / ".tools"


def unpacked_tool(package: str, name: str) -> str:
    """The path of program name from Debian package package: unpacked in .tools/, else on
    PATH. Fails (never skips) when it is in neither."""
    path = shutil.which(name, path=str(TOOLS / package / "usr" / "bin")) or shutil.which(name)
    assert path, f"{name} (Debian package {package}) is needed: see README's test command"
    return path


def prometheus_tool(name: str) -> str:
    """The path of `prometheus` or `promtool`."""
    return unpacked_tool("prometheus", name)
