"""Bounding a store by use (the `prune` command): blobs not used for a while go, with the
record that vouches for each, and so does what a crash or a deletion left behind.

Order matters to readers: a blob is served only while its record vouches for it, so the
record goes first (the blob becomes invisible: a request fills it again from upstream), then
the blob. A blob's last use is the latest of its write time and the use its store recorded
(disk: the access time; S3: the hourly last-use marks)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from proxy.store import layout
from proxy.store.protocol import BlobInfo, Storage

log = logging.getLogger(__name__)
# A blob without its record this young may be a fill between its two writes; a lease that
# expired this recently may be about to be taken over.
SETTLE_SECONDS = 3600.0


@dataclass
class PruneReport:
    """What a prune removed (or, dry, would remove)."""

    blobs: int = 0
    records: int = 0
    freed: int = 0
    orphaned_blobs: int = 0
    orphaned_records: int = 0
    marks: int = 0
    leases: int = 0
    kept: int = 0
    removed: list[str] = field(default_factory=list)

    def summary(self, dry_run: bool) -> str:
        """One line for the operator."""
        verb = "would remove" if dry_run else "removed"
        return (f"prune: {verb} {self.blobs} unused blobs and {self.records} records "
                f"({self.freed} bytes freed), {self.orphaned_blobs} blobs without a record, "
                f"{self.orphaned_records} records without a blob, {self.marks} stale "
                f"last-use marks, {self.leases} expired leases; {self.kept} blobs kept")


@dataclass(frozen=True)
class _Plan:
    unused: list[tuple[BlobInfo, str | None]]  # blob, its record key if it has one
    orphaned_blobs: list[BlobInfo]
    orphaned_records: list[str]
    stale_marks: list[str]
    kept: int


async def prune(storage: Storage, unused_for: float, now: float, dry_run: bool = False,
                report: Callable[[str], None] | None = None) -> PruneReport:
    """Remove what was not used for unused_for seconds before now (see the module's
    docstring), and what a crash left: provider packages without a record, module archive
    records without an archive, last-use marks of blobs that are gone, leases long expired.
    report: told each key removed."""
    plan = await _plan(storage, now - unused_for, now - SETTLE_SECONDS)
    done = PruneReport(kept=plan.kept)
    tell = report or (lambda _line: None)
    for info, record in plan.unused:
        if not dry_run:
            if record is not None:
                await storage.index.delete(record)  # first: the blob is no longer vouched for
            if not await storage.blobs.delete(info.key, info.identity):
                continue  # replaced since it was listed: a fill's, not unused
        done.blobs += 1
        done.records += record is not None
        done.freed += info.size
        tell(f"{info.key} ({info.size} bytes, unused)")
    for info in plan.orphaned_blobs:
        if dry_run or await storage.blobs.delete(info.key, info.identity):
            done.orphaned_blobs += 1
            done.freed += info.size
            tell(f"{info.key} ({info.size} bytes, no record vouches for it)")
    for record in plan.orphaned_records:
        blob = layout.blob_of_record(record)
        # Checked again: a fill publishes the blob before its record, so one found now is
        # that fill's.
        if blob is not None and (dry_run or await storage.blobs.stat(blob) is None):
            if not dry_run:
                await storage.index.delete(record)
            done.orphaned_records += 1
            tell(f"{record} (a record of a blob that is gone)")
    for key in plan.stale_marks:
        if not dry_run:
            await storage.blobs.delete(key)  # gone already: removes what is kept about it
        done.marks += 1
    done.leases = await _expired_leases(storage, now - SETTLE_SECONDS, dry_run, tell)
    return done


async def _plan(storage: Storage, unused_before: float, settled_before: float) -> _Plan:
    # Records are listed before blobs: a fill publishes its blob before its record, so a
    # record listed here whose blob is not listed next is one whose blob went.
    records = set(await storage.index.keys(layout.PACKAGE_RECORDS))
    module_records = await storage.index.keys(layout.MODULE_ARCHIVE_RECORDS)
    records.update(module_records)
    listed = [info for area in layout.AREAS for info in await storage.blobs.list(f"{area}/")]
    uses = await storage.blobs.last_uses("")
    held = {info.key for info in listed}
    unused: list[tuple[BlobInfo, str | None]] = []
    orphaned: list[BlobInfo] = []
    for info in listed:
        record = layout.record_of_blob(info.key)
        if record is None:
            continue  # not a blob this layout names: left alone
        has_record = record in records
        if max(info.mtime, uses.get(info.key, 0.0)) < unused_before:
            unused.append((info, record if has_record else None))
        elif not has_record and layout.parse_provider_archive(info.key) is not None \
                and info.mtime < settled_before:
            # Never served (a package is fetched again without its record). Module archives
            # without one are adopted when asked for: left to the unused rule.
            orphaned.append(info)
    gone_records = [record for record in module_records
                    if (blob := layout.blob_of_record(record)) is not None and blob not in held]
    stale_marks = [key for key, used in uses.items()
                   if key not in held and used < settled_before]
    return _Plan(unused, orphaned, gone_records, stale_marks,
                 len(listed) - len(unused) - len(orphaned))


async def _expired_leases(storage: Storage, expired_before: float, dry_run: bool,
                          tell: Callable[[str], None]) -> int:
    """Remove the fill leases that expired before expired_before (their holders died)."""
    removed = 0
    for key in await storage.index.keys(layout.LEASE_RECORDS):
        lease = await storage.index.get(key)
        expires = None if lease is None else lease.get("expires_at")
        if isinstance(expires, int | float) and expires < expired_before:
            if not dry_run:
                await storage.index.delete(key)
            removed += 1
            tell(f"{key} (a fill lease that expired)")
    return removed
