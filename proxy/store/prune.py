"""Bounding a store by use (`cache prune`): blobs not used for a while (or those an address
pattern selects, or the least recently used beyond a size) go, with the record that vouches
for each, and so does what a crash or a deletion left behind.

Order matters to readers: a blob is served only while its record vouches for it, so the
record goes first (the blob becomes invisible: a request fills it again from upstream), then
the blob. A blob's last use is the latest of its write time and the use its store recorded
(disk: the access time; S3: the hourly last-use marks)."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from proxy.store import layout
from proxy.store.contents import AddressPattern, HeldBlob, describe
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
    # Blobs removed by why: unused, selected (by the pattern), least recently used (size).
    reasons: Counter[str] = field(default_factory=Counter)

    def summary(self, dry_run: bool) -> str:
        """One line for the operator."""
        verb = "would remove" if dry_run else "removed"
        gone = ", ".join(f"{count} {reason} blobs" for reason, count in self.reasons.items()
                         if count) or "0 unused blobs"
        return (f"prune: {verb} {gone} and {self.records} records "
                f"({self.freed} bytes freed), {self.orphaned_blobs} blobs without a record, "
                f"{self.orphaned_records} records without a blob, {self.marks} stale "
                f"last-use marks, {self.leases} expired leases; {self.kept} blobs kept")


@dataclass(frozen=True)
class PruneRules:
    """What goes besides what crashes left: blobs unused for unused_for seconds; every blob
    pattern selects (with unused_for or to_size: only those of them that rule takes); then
    the least recently used (of those pattern selects) until the store's packages and
    module archives take at most to_size bytes."""

    unused_for: float | None = None
    pattern: AddressPattern | None = None
    to_size: int | None = None


@dataclass(frozen=True)
class _Plan:
    chosen: list[tuple[BlobInfo, str | None, str]]  # blob, its record key if any, why
    orphaned_blobs: list[BlobInfo]
    orphaned_records: list[str]
    stale_marks: list[str]
    kept: int


async def prune(storage: Storage, unused_for: float | None, now: float, dry_run: bool = False,
                report: Callable[[str], None] | None = None, *,
                rules: PruneRules | None = None,
                progress: Callable[[int, int], None] | None = None) -> PruneReport:
    """Remove what was not used for unused_for seconds before now (or what rules say; see
    PruneRules and the module's docstring), and what a crash left: provider packages
    without a record, module archive records without an archive, last-use marks of blobs
    that are gone, leases long expired. report: told each key removed; progress: told
    (blobs done, blobs to go through) as it goes."""
    rules = rules or PruneRules(unused_for=unused_for)
    if rules == PruneRules():
        raise ValueError("a prune needs a rule: an age, a pattern or a size")
    plan = await _plan(storage, rules, now, now - SETTLE_SECONDS)
    done = PruneReport(kept=plan.kept)
    tell = report or (lambda _line: None)
    step = progress or (lambda _done, _total: None)
    total = len(plan.chosen) + len(plan.orphaned_blobs)
    step(0, total)
    for number, (info, record, reason) in enumerate(plan.chosen, 1):
        step(number, total)
        if not dry_run:
            if record is not None:
                await storage.index.delete(record)  # first: the blob is no longer vouched for
            if not await storage.blobs.delete(info.key, info.identity):
                continue  # replaced since it was listed: a fill's, not the one chosen
        done.blobs += 1
        done.records += record is not None
        done.freed += info.size
        done.reasons[reason] += 1
        tell(f"{info.key} ({info.size} bytes, {reason})")
    for number, info in enumerate(plan.orphaned_blobs, len(plan.chosen) + 1):
        step(number, total)
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


async def _plan(storage: Storage, rules: PruneRules, now: float,
                settled_before: float) -> _Plan:
    # Records are listed before blobs: a fill publishes its blob before its record, so a
    # record listed here whose blob is not listed next is one whose blob went.
    records = set(await storage.index.keys(layout.PACKAGE_RECORDS))
    module_records = await storage.index.keys(layout.MODULE_ARCHIVE_RECORDS)
    records.update(module_records)
    zip_records = await storage.index.keys(layout.MODULE_ZIP_RECORDS)
    listed = [info for area in layout.AREAS for info in await storage.blobs.list(f"{area}/")]
    uses = await storage.blobs.last_uses("")
    held = {info.key for info in listed}
    chosen: list[tuple[BlobInfo, str | None, str]] = []
    orphaned: list[BlobInfo] = []
    candidates: list[HeldBlob] = []
    described = [blob for info in listed
                 if (blob := describe(info, uses.get(info.key, 0.0), records)) is not None]
    for blob in described:  # keys this layout does not name are left alone
        if rules.pattern is not None and not rules.pattern.matches(blob.address):
            continue
        reason = _reason(rules, blob, now)
        if reason is not None:
            chosen.append((blob.info, blob.record if blob.recorded else None, reason))
        elif not blob.recorded and blob.kind == "provider" and blob.info.mtime < settled_before:
            # Never served (a package is fetched again without its record). Module archives
            # without one are adopted when asked for: left to the other rules.
            orphaned.append(blob.info)
        else:
            candidates.append(blob)
    # A module's OCI zip is made from its archive: it goes with the archive, counts with it
    # against to_size, and goes when the archive is gone (made again after it is fetched).
    zips = {layout.module_archive(*named): info for info in listed
            if (named := layout.parse_module_zip(info.key)) is not None}

    def with_zip(key: str) -> int:
        return zips[key].size if key in zips else 0

    if rules.to_size is not None:
        left = sum(blob.info.size + with_zip(blob.info.key) for blob in described) \
            - sum(info.size + with_zip(info.key) for info, _record, _why in chosen) \
            - sum(i.size for i in orphaned)
        for blob in sorted(candidates, key=lambda blob: blob.last_used):
            if left <= rules.to_size:
                break
            chosen.append((blob.info, blob.record if blob.recorded else None,
                           "least recently used"))
            left -= blob.info.size + with_zip(blob.info.key)
    kept = len(described) - len(chosen) - len(orphaned)
    going = {info.key for info, _record, _why in chosen}
    for made_from, info in zips.items():
        if made_from in going or (made_from not in held and info.mtime < settled_before):
            named = layout.parse_module_zip(info.key)
            assert named is not None
            chosen.append((info, layout.module_zip_record(*named), "module zip"))
    gone_records = [record for record in [*module_records, *zip_records]
                    if (archive := layout.blob_of_record(record)) is not None
                    and archive not in held]
    stale_marks = [key for key, used in uses.items()
                   if key not in held and used < settled_before]
    return _Plan(chosen, orphaned, gone_records, stale_marks, kept)


def _reason(rules: PruneRules, blob: HeldBlob, now: float) -> str | None:
    """Why the age and pattern rules take this (selected) blob; None: they do not."""
    if rules.unused_for is not None:
        return "unused" if blob.last_used < now - rules.unused_for else None
    return "selected" if rules.to_size is None else None


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
