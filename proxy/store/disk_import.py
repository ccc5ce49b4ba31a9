"""Commands that work on a cache directory while proxies may be serving it (import, export):
the disk store opened without leaving traces when the work fails, the index read without
creating it, and an import applied all or nothing. Verified files are moved into place, then
the index records that vouch for them are written in one transaction; a failure at any step
undoes every step before it (files removed or put back, directories made removed), so that
a refused import leaves nothing published and nothing served."""

from __future__ import annotations

import os
import shutil
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import diskcache

from proxy.store.archives import ArchiveStore
from proxy.store.disk import DiskBlobStore, index_dir

# What writing the index may raise besides OSError.
INDEX_WRITE_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
# diskcache's own files in the index directory; value files are anything else.
_DATABASE = ("cache.db", "cache.db-wal", "cache.db-shm")


class IndexReader:
    """The index of a cache directory, read by a command (blocking calls)."""

    def __init__(self, directory: Path) -> None:
        self._cache = diskcache.Cache(str(directory))

    def get(self, key: str) -> Any:
        """The record at key, or None."""
        return self._cache.get(key)

    def keys(self, prefix: str) -> list[str]:
        """Every key that starts with prefix, in order."""
        return sorted(key for key in self._cache.iterkeys()
                      if isinstance(key, str) and key.startswith(prefix))

    def close(self) -> None:
        """Release the SQLite handles."""
        self._cache.close()


def open_index(cache_dir: Path) -> IndexReader:
    """The cache directory's index (made if there is none yet); the caller closes it."""
    return IndexReader(index_dir(cache_dir))


@contextmanager
def existing_index(cache_dir: Path) -> Iterator[IndexReader | None]:
    """The cache index, if there is one (None: no records yet; none is created here)."""
    if not index_dir(cache_dir).is_dir():
        yield None
        return
    index = open_index(cache_dir)
    try:
        yield index
    finally:
        index.close()


@contextmanager
def cache_work(cache_dir: Path) -> Iterator[DiskBlobStore]:
    """The cache's file store, for an import; when the import fails, the directories that
    opening it made (the cache's own, its temp area) are removed again."""
    made = []
    directory = ArchiveStore.temp_root(cache_dir)
    while not directory.exists():
        made.append(directory)
        directory = directory.parent
    store = DiskBlobStore.at(cache_dir)
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


class CacheChanges:
    """The files and index records one import adds to a store, applied together by
    apply()."""

    def __init__(self, store: DiskBlobStore) -> None:
        self._store = store
        self._files: list[tuple[Path, Path]] = []
        self._records: dict[str, Any] = {}

    def put_file(self, staged: Path, key: str) -> None:
        """Move staged (in the cache's temp area) into place as the blob at key when
        applied."""
        self._files.append((staged, self._store.path_of(key)))

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
        re-raise (one of INDEX_WRITE_ERRORS)."""
        undo: list[Callable[[], None]] = []
        try:
            for staged, final in self._files:
                _publish(staged, final, undo)
            if self._records:
                _write_records(index_dir(self._store.files.cache_dir), self._records, undo)
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


def _write_records(directory: Path, records: dict[str, Any],
                   undo: list[Callable[[], None]]) -> None:
    existed = directory.exists()
    before = _entries(directory) if existed else set()
    # A failed transaction rolls the database back, but not the value files diskcache wrote
    # for large records beside it: those go, as does an index this import created.
    undo.append(lambda: _remove_new(directory, existed, before))
    index = diskcache.Cache(str(directory))
    try:
        with index.transact():
            for key, value in records.items():
                index.set(key, value)
    finally:
        index.close()


def _entries(directory: Path) -> set[Path]:
    """Every file and directory under directory but the database's own files."""
    found: set[Path] = set()
    for root, dirs, files in os.walk(directory):
        found.update(Path(root) / name for name in dirs)
        found.update(Path(root) / name for name in files if name not in _DATABASE)
    return found


def _remove_new(directory: Path, existed: bool, before: set[Path]) -> None:
    if not existed:
        shutil.rmtree(directory, ignore_errors=True)
        return
    # Deepest first: files, then the directories they were in.
    for path in sorted(_entries(directory) - before, key=lambda p: len(p.parts), reverse=True):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
