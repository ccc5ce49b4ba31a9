"""Applying an import to the cache all or nothing: verified files are moved into place,
then the index records that vouch for them are written in one transaction. A failure at any
step undoes every step before it (files removed or put back, directories made removed), so
that a refused import leaves nothing published and nothing served. Also what bundle and
mirror-directory imports share: the cache's store and index opened without leaving traces,
room checked before copying, version lists merged."""

from __future__ import annotations

import logging
import os
import shutil
import sqlite3
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from copy import deepcopy
from pathlib import Path
from typing import Any

import diskcache

from proxy.airgap.manifest import BundleError
from proxy.store.archives import ArchiveStore
from proxy.store.disk_space import free_bytes
from proxy.verification.hashes import sha256_of_path

# diskcache's own files in the index directory; value files are anything else.
_DATABASE = ("cache.db", "cache.db-wal", "cache.db-shm")
log = logging.getLogger(__name__)


class CacheChanges:
    """The files and index records one import adds, applied together by apply()."""

    def __init__(self, index_dir: Path) -> None:
        self.index_dir = index_dir
        self._files: list[tuple[Path, Path]] = []
        self._records: dict[str, Any] = {}

    def put_file(self, staged: Path, final: Path) -> None:
        """Move staged (in the cache's temp area) to final when applied."""
        self._files.append((staged, final))

    def set_record(self, key: str, value: Any) -> None:
        """Write the index record key when applied."""
        self._records[key] = value

    @property
    def adds_files(self) -> bool:
        """Whether applying moves any file into the cache."""
        return bool(self._files)

    def record(self, key: str) -> Any:
        """The value planned for record key (None: none planned)."""
        return self._records.get(key)

    def apply(self) -> None:
        """Publish every file, then write every record; on any failure undo all of it and
        re-raise (OSError, sqlite3.Error, diskcache.Timeout)."""
        undo: list[Callable[[], None]] = []
        try:
            for staged, final in self._files:
                _publish(staged, final, undo)
            if self._records:
                _write_records(self.index_dir, self._records, undo)
        except BaseException:
            for step in reversed(undo):
                try:
                    step()
                except OSError:
                    pass  # best effort: keep undoing the rest
            raise


def _publish(staged: Path, final: Path, undo: list[Callable[[], None]]) -> None:
    for directory in _make_parents(final.parent):
        undo.append(directory.rmdir)
    with open(staged, "rb") as handle:
        os.fsync(handle.fileno())
    if os.path.lexists(final):
        # Only a file the index does not vouch for, or the same bytes again, is replaced:
        # kept aside until the whole import went through.
        backup = staged.with_name(staged.name + ".replaced")
        os.replace(final, backup)
        undo.append(lambda: os.replace(backup, final))
        os.replace(staged, final)
    else:
        os.replace(staged, final)
        undo.append(final.unlink)


def _make_parents(directory: Path) -> list[Path]:
    """Make directory and its missing parents; returns those made, outermost first."""
    missing = []
    while not directory.exists():
        missing.append(directory)
        directory = directory.parent
    for path in reversed(missing):
        path.mkdir()
    return list(reversed(missing))


def _write_records(index_dir: Path, records: dict[str, Any],
                   undo: list[Callable[[], None]]) -> None:
    existed = index_dir.exists()
    before = _entries(index_dir) if existed else set()
    # A failed transaction rolls the database back, but not the value files diskcache wrote
    # for large records beside it: those go, as does an index this import created.
    undo.append(lambda: _remove_new(index_dir, existed, before))
    index = diskcache.Cache(str(index_dir))
    try:
        with index.transact():
            for key, value in records.items():
                index.set(key, value)
    finally:
        index.close()


def _entries(index_dir: Path) -> set[Path]:
    """Every file and directory under index_dir but the database's own files."""
    found: set[Path] = set()
    for root, dirs, files in os.walk(index_dir):
        found.update(Path(root) / name for name in dirs)
        found.update(Path(root) / name for name in files if name not in _DATABASE)
    return found


def _remove_new(index_dir: Path, existed: bool, before: set[Path]) -> None:
    if not existed:
        shutil.rmtree(index_dir, ignore_errors=True)
        return
    # Deepest first: files, then the directories they were in.
    for path in sorted(_entries(index_dir) - before, key=lambda p: len(p.parts), reverse=True):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def apply_changes(changes: CacheChanges) -> None:
    """changes.apply(), a failure to write reported as a BundleError (all of it undone)."""
    try:
        changes.apply()
    except (OSError, sqlite3.Error, diskcache.Timeout) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else repr(exc)
        where = f" {exc.filename}" if isinstance(exc, OSError) and exc.filename else ""
        raise BundleError(f"cannot write to the cache{where}: {reason} (nothing was "
                          "imported)") from None


@contextmanager
def cache_work(cache_dir: Path) -> Iterator[ArchiveStore]:
    """The cache's file store, for an import; when the import fails, the directories that
    opening it made (the cache's own, its temp area) are removed again."""
    made = []
    directory = cache_dir / "tmp"
    while not directory.exists():
        made.append(directory)
        directory = directory.parent
    store = ArchiveStore(cache_dir)
    try:
        yield store
    except BaseException:
        store.close()
        for path in made:  # innermost first
            _remove_empty_tree(path)
        raise
    else:
        store.close()


def _remove_empty_tree(directory: Path) -> None:
    """Remove directory if nothing but empty directories is in it (what opening the store
    made: its temp area, its lock directory); a file anywhere keeps it."""
    for root, _dirs, _files in os.walk(directory, topdown=False):
        try:
            os.rmdir(root)
        except OSError:
            pass


@contextmanager
def existing_index(cache_dir: Path) -> Iterator[diskcache.Cache | None]:
    """The cache index, if there is one (None: no records yet; none is created here)."""
    if not (cache_dir / "index").is_dir():
        yield None
        return
    index = diskcache.Cache(str(cache_dir / "index"))
    try:
        yield index
    finally:
        index.close()


def measure(store: ArchiveStore, changes: CacheChanges) -> None:
    """Count the cache's files again after an import that added some, so that running
    proxies hold them against cache.max_size. Best effort: the import is done, and they
    rescan anyway."""
    if not changes.adds_files:
        return
    try:
        store.measure()
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


def plan_list(changes: CacheChanges, index: diskcache.Cache | None, record_key: str,
              entries: list[Any], identity: Callable[[Any], str]) -> None:
    """Add entries to a cached list (version lists), keeping what is there; entries for the
    same version merge their platforms. A new list is dated 0, so that an online proxy
    refreshes it soon; offline, age does not matter."""
    record = changes.record(record_key)
    if record is None and index is not None:
        record = index.get(record_key)
    current: list[Any] = deepcopy(list(record["value"])) if isinstance(record, dict) else []
    for entry in entries:
        same = next((c for c in current if identity(c) == identity(entry)), None)
        if same is None:
            current.append(entry)
        elif isinstance(same, dict) and isinstance(entry, dict):
            same["platforms"] = list(dict.fromkeys([*same.get("platforms", []),
                                                     *entry.get("platforms", [])]))
    if not isinstance(record, dict) or current != record["value"]:
        changes.set_record(record_key, {
            "fetched_at": record.get("fetched_at", 0) if isinstance(record, dict) else 0,
            "value": current})
