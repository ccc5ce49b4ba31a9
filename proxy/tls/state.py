"""The proxy's state directory (server.state_dir): the generated CA, the server certificate and
the URL-signing key. Unlike the cache, clients depend on it (they trust the CA, they hold
signed URLs), so it lives apart from cache.dir and is never recreated behind their backs."""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


# The state files under tls/, by attribute of StatePaths. Earlier versions kept them, and the
# signing key, under <cache.dir>/tls by these same names.
_TLS_FILES = {"ca_cert": "ca.pem", "ca_key": "ca-key.pem", "server_cert": "server.pem",
              "server_key": "server-key.pem"}
_SIGNING_KEY = "url-signing.key"


@dataclass(frozen=True)
class StatePaths:
    """Where each piece of state lives under server.state_dir (root)."""

    root: Path
    tls: Path = field(init=False)  # the generated CA and server certificate's directory
    ca_cert: Path = field(init=False)  # the CA clients trust (SSL_CERT_FILE)
    ca_key: Path = field(init=False)  # the CA's private key
    server_cert: Path = field(init=False)  # the server certificate, issued by the CA
    server_key: Path = field(init=False)  # the server certificate's private key
    signing_key: Path = field(init=False)  # the HMAC key of signed URLs, for every process

    def __post_init__(self) -> None:
        # Frozen: every path is set here, once, from root.
        object.__setattr__(self, "tls", self.root / "tls")
        for attribute, name in _TLS_FILES.items():
            object.__setattr__(self, attribute, self.tls / name)
        object.__setattr__(self, "signing_key", self.root / _SIGNING_KEY)


@contextmanager
def state_lock(paths: StatePaths) -> Iterator[None]:
    """Hold an exclusive lock on the state directory (across processes: workers, a second
    instance, a `tls rotate`) while state is created or replaced."""
    paths.tls.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(paths.root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def write_atomic(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write a file whole or not at all: readers see the old content or the new one."""
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(temp, mode)
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


# Files earlier versions kept under <cache.dir>/tls, and where they live now.
_LEGACY_NAMES = {**{name: attribute for attribute, name in _TLS_FILES.items()},
                 _SIGNING_KEY: "signing_key"}


def adopt_legacy_state(cache_dir: Path, paths: StatePaths) -> list[Path]:
    """Copy the CA (with its server certificate) and the URL-signing key that earlier versions
    kept under <cache.dir>/tls into the state directory, once, so that clients keep trusting
    the CA. Copied, not moved: the old files are left for an older version to use."""
    legacy = cache_dir / "tls"
    if not (legacy / "ca.pem").is_file() and not (legacy / "url-signing.key").is_file():
        return []
    copied: list[Path] = []
    with state_lock(paths):
        has_ca = paths.ca_cert.exists() or paths.ca_key.exists()
        for name, attribute in _LEGACY_NAMES.items():
            source, target = legacy / name, getattr(paths, attribute)
            if attribute == "signing_key":
                adopt = not target.exists()
            else:  # the CA and its certificate only together, and only into an empty place
                adopt = not has_ca and (legacy / "ca.pem").is_file() \
                    and (legacy / "ca-key.pem").is_file()
            if adopt and source.is_file():
                write_atomic(target, source.read_bytes(),
                             0o600 if name.endswith("key.pem") or name.endswith(".key")
                             else 0o644)
                copied.append(target)
    if copied:
        log.info("adopted %s from %s (where earlier versions kept them) into %s; clients keep "
                 "trusting the same CA. The old copies may be deleted.",
                 ", ".join(p.name for p in copied), legacy, paths.root)
    return copied
