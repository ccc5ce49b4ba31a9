"""What `cache verify` tells monitoring about the damaged files it drops (or, --dry-run,
finds): a line in the server's audit log (server.audit_log), and an entry among the
integrity failures the status page of the servers on the same cache.dir shows (the
commands' shared file beside their snapshots). The server's Prometheus counter stays its
own: a command that ends exports none."""

from __future__ import annotations

import logging
from types import TracebackType

from proxy.cli.cache_store import CacheUnusable
from proxy.config import Config
from proxy.core.activity import RECENT_FAILURES, Activity
from proxy.core.activity_share import SnapshotShare
from proxy.core.audit import Artifact, AuditLog, Requester, local_user
from proxy.protocols.status import snapshot_directory
from proxy.store.contents import HeldBlob
from proxy.store.damage import DamagedFile, Dropped
from proxy.verification.stored_drops import integrity_kind, what_went

log = logging.getLogger(__name__)


class DamageReports:
    """Reports each damaged blob as it is found; shares them with the status page when the
    verify ends (a context manager: opened from the config)."""

    def __init__(self, config: Config, dry_run: bool) -> None:
        self._audit = AuditLog(config.server.audit_log)
        self._share = SnapshotShare(snapshot_directory(config))
        self._activity = Activity()
        self._dry_run = dry_run
        self._user = local_user()
        self._found = 0

    def __enter__(self) -> DamageReports:
        try:
            self._audit.open()
        except OSError as exc:  # before anything is checked: no drop goes unrecorded
            raise CacheUnusable(f"server.audit_log {self._audit.target}: cannot open it: "
                                f"{exc.strerror or exc}") from None
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self._audit.close()
        if not self._found:
            return
        try:
            self._share.add_failures(self._activity.snapshot()["integrity_failures"],
                                     RECENT_FAILURES)
        except OSError as exc:  # the audit log and the output still tell
            log.warning("cannot share the integrity failures with the status page in %s: %s",
                        self._share.directory, exc)

    def damaged(self, blob: HeldBlob, damage: DamagedFile, recorded_sha256: str,
                dropped: Dropped) -> None:
        """A damaged blob this verify dropped (or, dry run, found): `dropped` says which
        copy held the damage."""
        self._found += 1
        fate = "kept (--dry-run)" if self._dry_run else what_went(dropped)
        reason = f"{'the stored file' if self._dry_run else dropped.where()} {damage.message}"
        self._audit.record("damaged" if self._dry_run else "dropped", _artifact(blob),
                           outcome="integrity", requester=Requester(), user=self._user,
                           reason=reason, sha256_found=damage.sha256,
                           sha256_recorded=recorded_sha256,
                           copy="local" if dropped is Dropped.LOCAL_COPY else "stored")
        self._activity.integrity_failure(_name(blob), integrity_kind(dropped, damage),
                                         f"{reason}; {fate}")


def _artifact(blob: HeldBlob) -> Artifact:
    """The audit identity of a stored package or module archive."""
    host, namespace, name, *system = blob.address.split("/")
    if blob.kind == "provider":
        os_, _, arch = (blob.platform or "").partition("_")
        return Artifact("provider", host, namespace, name, blob.version, os_ or None,
                        arch or None)
    return Artifact("module", host, namespace, name, blob.version,
                    system=system[0] if system else None)


def _name(blob: HeldBlob) -> str:
    """The artifact as the server's status page names it."""
    if blob.kind == "provider":
        return f"{blob.address} {blob.version} {blob.platform}"
    return f"module {blob.address} {blob.version}"
