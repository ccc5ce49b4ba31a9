"""Programs the tests run that the README's test command unpacks rather than installs
(Prometheus: installing its Debian package would start it as a service on the host)."""

from __future__ import annotations

import shutil
from pathlib import Path

# Where `apt-get download prometheus && dpkg-deb -x prometheus_*.deb prometheus` (run in
# .tools/) leaves the binaries.
UNPACKED = Path(__file__).resolve().parents[2] / ".tools" / "prometheus" / "usr" / "bin"


def prometheus_tool(name: str) -> str:
    """The path of `prometheus` or `promtool`: unpacked in .tools/, else on PATH. Fails
    (never skips) when it is in neither."""
    path = shutil.which(name, path=str(UNPACKED)) or shutil.which(name)
    assert path, f"{name} (Debian package prometheus) is needed: see README's test command"
    return path
