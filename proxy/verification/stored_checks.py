"""`cache verify`: every stored package and module archive read again and checked against the
record that vouches for it (a package: the signed sha256 and, where recorded, its h1; a module
archive: the sha256 recorded when it was packed). One that fails is dropped as the server
drops a damaged file (proxy.verification.stored_drops, under the artifact's fill lock), to
be fetched again on the next request. Safe beside a running server: a file replaced by a fill
meanwhile is not the one judged, and stays. Reading a blob here is no use of it: its last use
(what prune goes by) stays as it was."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from proxy.store import layout
from proxy.store.contents import HeldBlob
from proxy.store.damage import DamagedFile, Dropped
from proxy.store.protocol import MetadataIndex, Storage
from proxy.verification.stored_drops import drop_damaged, forget_package_file, what_went
from proxy.verification.stored_hashes import h1_of_stored, verify_stored


@dataclass
class VerifyReport:
    """What a verify found."""

    good: int = 0
    bytes_read: int = 0
    bad: list[str] = field(default_factory=list)  # "KEY: why"
    dropped: int = 0
    unrecorded: int = 0  # no record vouches for it: nothing to check against (prune's)
    gone: int = 0  # removed (evicted, pruned) since it was listed


# Told each blob's outcome: the blob, "good" | "bad" | "unrecorded" | "gone", and for a bad
# one why.
Outcome = Callable[[HeldBlob, str, str], None]
# Told each damaged blob this verify dropped (or, dry_run, would drop): the blob, the damage,
# the sha256 its record vouches for, and what went (NOTHING on a dry run).
Damaged = Callable[[HeldBlob, DamagedFile, str, Dropped], None]


async def verify_held(storage: Storage, held: list[HeldBlob], dry_run: bool = False,
                      outcome: Outcome | None = None, damaged: Damaged | None = None,
                      shared: bool = False) -> VerifyReport:
    """Check every blob in held (see the module's docstring); dry_run: report bad ones,
    drop nothing. shared: read the blobs the shared store holds (S3: the bucket's objects),
    not this replica's local copies of them."""
    report = VerifyReport()
    tell = outcome or (lambda _blob, _what, _why: None)
    for blob in held:
        record = await storage.index.get(blob.record)
        sha256 = _recorded_sha256(blob, record)
        if sha256 is None:
            report.unrecorded += 1
            tell(blob, "unrecorded", "")
            continue
        h1 = record.get("h1") if blob.kind == "provider" and record is not None else None
        try:
            found = await _check(storage, blob, sha256, h1 if isinstance(h1, str) else None,
                                 shared)
        except DamagedFile as damage:
            dropped = Dropped.NOTHING if dry_run else await _drop(storage, blob, damage)
            # Which copy held the damage is known once the drop told them apart.
            where = "the stored file" if dry_run else dropped.where()
            fate = "" if dry_run or dropped is Dropped.NOTHING else f"; {what_went(dropped)}"
            report.bad.append(f"{blob.key}: {where} {damage.message}{fate}")
            tell(blob, "bad", f"{where} {damage.message}{fate}")
            report.dropped += dropped is not Dropped.NOTHING
            # Gone or replaced meanwhile: whoever dropped it first reported it.
            if damaged is not None and (dry_run or dropped is not Dropped.NOTHING):
                damaged(blob, damage, sha256, dropped)
            continue
        if not found:
            report.gone += 1
            tell(blob, "gone", "")
            continue
        report.good += 1
        report.bytes_read += blob.info.size
        tell(blob, "good", "")
    return report


def _recorded_sha256(blob: HeldBlob, record: dict[str, object] | None) -> str | None:
    if record is None:
        return None
    sha256 = record.get("shasum" if blob.kind == "provider" else "sha256")
    return sha256 if isinstance(sha256, str) and sha256 else None


async def _check(storage: Storage, blob: HeldBlob, sha256: str, h1: str | None,
                 shared: bool) -> bool:
    """Whether the blob is there and good; raises DamagedFile."""
    if h1 is None:
        return await verify_stored(storage.blobs, blob.key, sha256, use=False,
                                   shared=shared) is not None
    before = await storage.blobs.stat(blob.key)
    # One read: the bytes are checked against sha256 first, then unzipped for the h1.
    computed = await h1_of_stored(storage.blobs, blob.key, sha256, use=False, shared=shared)
    now = await storage.blobs.stat(blob.key)
    if now is None or before is None or now.identity != before.identity:
        return False  # gone, or replaced by a fill meanwhile: not the file judged
    if computed is not None and computed != h1:
        raise DamagedFile(f"has the right sha256 but h1 {computed}, not the recorded {h1}",
                          now.identity)
    return True


async def _drop(storage: Storage, blob: HeldBlob, damage: DamagedFile) -> Dropped:
    """Drop it under its fill lock, as the server would; what this call dropped."""
    unvouch: Callable[[], Awaitable[None]]
    if blob.kind == "provider":
        package = layout.parse_provider_archive(blob.key)
        assert package is not None
        name, what = layout.provider_fill(*package), "package"
        unvouch = _forgetting(storage.index, blob.record)
    else:
        module = layout.parse_module_archive(blob.key)
        assert module is not None
        name, what = layout.module_fill(*module), "module"
        unvouch = _deleting(storage.index, blob.record)
    async with storage.blobs.fill_lock(name, what):
        return await drop_damaged(storage.blobs, blob.key, damage, unvouch)


def _forgetting(index: MetadataIndex, record: str) -> Callable[[], Awaitable[None]]:
    return lambda: forget_package_file(index, record)


def _deleting(index: MetadataIndex, record: str) -> Callable[[], Awaitable[None]]:
    return lambda: index.delete(record)
