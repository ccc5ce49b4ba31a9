"""What bundle and mirror-directory imports share: the import applied all or nothing (see
proxy.store.disk_import) with a failure told as a BundleError, room checked before copying,
the cache measured afterwards."""

from __future__ import annotations

import logging
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from proxy.airgap.manifest import BundleError
from proxy.config.settings import Config
from proxy.core.audit import AuditLog
from proxy.store.disk import DiskBlobStore
from proxy.store.disk_import import INDEX_WRITE_ERRORS, CacheChanges
from proxy.store.disk_space import free_bytes
from proxy.verification.hashes import sha256_of_path

log = logging.getLogger(__name__)


@contextmanager
def opened_audit(config: Config) -> Iterator[AuditLog]:
    """The configured audit log (server.audit_log), open for a command's lines; BundleError
    if it cannot be opened (checked before any work: nothing then goes unrecorded)."""
    audit = AuditLog(config.server.audit_log)
    try:
        audit.open()
    except OSError as exc:
        raise BundleError(f"server.audit_log {config.server.audit_log}: cannot open it: "
                          f"{exc.strerror or exc}") from None
    try:
        yield audit
    finally:
        audit.close()


def apply_changes(changes: CacheChanges) -> None:
    """changes.apply(), a failure to write reported as a BundleError (all of it undone)."""
    try:
        changes.apply()
    except INDEX_WRITE_ERRORS as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else repr(exc)
        where = f" {exc.filename}" if isinstance(exc, OSError) and exc.filename else ""
        raise BundleError(f"cannot write to the cache{where}: {reason} (nothing was "
                          "imported)") from None


def measure(store: DiskBlobStore, changes: CacheChanges) -> None:
    """Count the cache's files again after an import that added some, so that running
    proxies hold them against cache.max_size. Best effort: the import is done, and they
    rescan anyway."""
    if not changes.adds_files:
        return
    try:
        store.files.measure()
    except OSError as exc:
        log.warning("could not record the cache's new size (%s); running proxies count it "
                    "at their next rescan", exc.strerror or exc)


def check_room(cache_dir: Path, needed: int, what: str) -> None:
    """Refuse, before anything is copied, an import of `needed` bytes that the cache's
    filesystem cannot hold (it is copied there first, then moved into place)."""
    existing = cache_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    try:
        free = free_bytes(existing)
    except OSError:
        return  # unknown: writing will tell, and is undone
    if needed > free:
        raise BundleError(f"{what} add up to {needed} bytes; the filesystem of the cache "
                          f"({cache_dir}) has {free} bytes free")


def regular_sha256(path: Path) -> str | None:
    """The sha256 of the file at path (None: nothing there; "": not a regular file)."""
    try:
        if not stat.S_ISREG(path.lstat().st_mode):
            return ""
    except (FileNotFoundError, NotADirectoryError):
        return None
    return sha256_of_path(path)
