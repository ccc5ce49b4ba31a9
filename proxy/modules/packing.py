"""Module trees on disk: safe unpacking of upstream archives, checks, and the repacked
`.tar.gz` the proxy serves. Blocking functions: callers run them in a thread.

Nothing is extracted that could land outside the destination: absolute names, `..`, links
that leave the tree, devices and FIFOs make the whole archive refused.
"""

from __future__ import annotations

import fnmatch
import gzip
import os
import posixpath
import shutil
import stat
import tarfile
import zipfile
import zlib
from pathlib import Path
from typing import BinaryIO

from proxy.core.errors import UpstreamError
from proxy.store.disk_space import is_out_of_space

_TAR_MODES = {"tar.gz": "r:gz", "tgz": "r:gz", "tar.xz": "r:xz", "txz": "r:xz",
              "tar.bz2": "r:bz2", "tbz2": "r:bz2", "tar": "r:"}
_SKIPPED_NAMES = (".git",)


class UnsafeArchive(UpstreamError):
    """An upstream archive or tree that would escape its root or is too large."""


def unpack(archive: Path, archive_format: str, destination: Path, max_bytes: int) -> None:
    """Extract a tar or zip archive into destination after checking every member."""
    destination.mkdir(parents=True, exist_ok=True)
    try:
        if archive_format == "zip":
            _unpack_zip(archive, destination, max_bytes)
        elif archive_format in _TAR_MODES:
            _unpack_tar(archive, _TAR_MODES[archive_format], destination, max_bytes)
        else:
            raise UnsafeArchive(f"unsupported module archive format {archive_format!r}")
    except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError, gzip.BadGzipFile) as exc:
        if is_out_of_space(exc):
            raise  # our disk, not upstream's archive
        raise UpstreamError(f"module archive cannot be unpacked as {archive_format}: "
                            f"{exc}") from None


def _check_name(name: str) -> str:
    if not name or name.startswith("/") or "\\" in name or "\0" in name \
            or (len(name) > 1 and name[1] == ":"):
        raise UnsafeArchive(f"module archive member with an absolute or odd name: {name[:200]!r}")
    normalized = posixpath.normpath(name)
    if normalized == ".." or normalized.startswith("../"):
        raise UnsafeArchive(f"module archive member escapes the root: {name[:200]!r}")
    return normalized


def _check_link(name: str, target: str) -> None:
    if target.startswith("/"):
        raise UnsafeArchive(f"module archive link to an absolute path: {name[:200]!r}")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(name), target))
    if resolved == ".." or resolved.startswith("../"):
        raise UnsafeArchive(f"module archive link escapes the root: {name[:200]!r}")


def _unpack_tar(archive: Path, mode: str, destination: Path, max_bytes: int) -> None:
    with tarfile.open(archive, mode) as tar:  # type: ignore[call-overload]
        members = tar.getmembers()
        total = 0
        for member in members:
            name = _check_name(member.name)
            if member.issym():
                _check_link(name, member.linkname)
            elif member.islnk():
                _check_name(member.linkname)  # hard link targets are archive-root relative
            elif not (member.isfile() or member.isdir()):
                raise UnsafeArchive(f"module archive member is not a file or directory: "
                                    f"{member.name[:200]!r}")
            total += max(member.size, 0)
            if total > max_bytes:
                raise UnsafeArchive(f"module archive unpacks to more than {max_bytes} bytes")
        if hasattr(tarfile, "data_filter"):
            # The standard library's "data" filter re-checks all of the above.
            tar.extractall(destination, members=members, filter="data")
        else:  # Python builds without PEP 706: the checks above are the guard
            tar.extractall(destination, members=members)


def _unpack_zip(archive: Path, destination: Path, max_bytes: int) -> None:
    with zipfile.ZipFile(archive) as zipped:
        infos = zipped.infolist()
        total = 0
        for info in infos:
            _check_name(info.filename)
            if stat.S_ISLNK(info.external_attr >> 16):
                raise UnsafeArchive(f"symlink in a zip module archive: {info.filename[:200]!r}")
            total += info.file_size
            if total > max_bytes:
                raise UnsafeArchive(f"module archive unpacks to more than {max_bytes} bytes")
        for info in infos:
            target = destination / _check_name(info.filename)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            with zipped.open(info) as source, open(target, "wb") as sink:
                shutil.copyfileobj(source, sink, 1 << 20)
            if (info.external_attr >> 16) & 0o111:
                target.chmod(0o755)


def select_subdir(root: Path, subdir: str) -> Path:
    """The module root inside a fetched tree: `subdir` with go-getter's glob support (each
    pattern must match exactly one directory)."""
    current = root
    for pattern in [p for p in subdir.split("/") if p] if subdir else []:
        if any(c in pattern for c in "*?["):
            matches = sorted(p for p in current.iterdir()
                             if p.is_dir() and fnmatch.fnmatchcase(p.name, pattern))
            if len(matches) != 1:
                raise UpstreamError(f"module subdirectory {subdir!r} matches {len(matches)} "
                                    "directories, not one")
            current = matches[0]
        else:
            current = current / pattern
    resolved = current.resolve()
    if not resolved.is_relative_to(root.resolve()) or not resolved.is_dir():
        raise UpstreamError(f"module subdirectory {subdir!r} does not exist in the source")
    return current


def pack(module_root: Path, output: Path, max_bytes: int) -> None:
    """Write module_root as a reproducible `.tar.gz` whose root is the module root.

    `.git` is left out; symlinks to files inside the tree are stored as the files they point
    to; a symlink that leaves the tree, or one to a directory, refuses the module."""
    root = module_root.resolve()
    with open(output, "wb") as raw:
        _pack_into(raw, module_root, root, max_bytes)
        raw.flush()
        os.fsync(raw.fileno())  # durable before it is renamed into place


def _pack_into(raw: BinaryIO, module_root: Path, root: Path, max_bytes: int) -> None:
    total = 0
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as zipped, \
            tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _walk(module_root):
            relative = path.relative_to(module_root).as_posix()
            info = tarfile.TarInfo(relative)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            if path.is_symlink():
                target = path.resolve()
                if not target.is_relative_to(root):
                    raise UnsafeArchive(f"module symlink leaves the module: {relative}")
                if target.is_dir():
                    raise UnsafeArchive(f"module symlink to a directory: {relative}")
            mode = path.stat().st_mode
            if stat.S_ISDIR(mode):
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            elif stat.S_ISREG(mode):
                info.size = path.stat().st_size
                info.mode = 0o755 if mode & 0o111 else 0o644
                total += info.size
                if total > max_bytes:
                    raise UnsafeArchive(f"module is larger than {max_bytes} bytes")
                with open(path, "rb") as handle:
                    tar.addfile(info, handle)
            else:
                raise UnsafeArchive(f"module holds a special file: {relative}")


def read_packed(handle: BinaryIO) -> None:
    """Read a packed module archive (an open file) through to its end, member data too, so
    that gzip checks its CRC; raises ValueError if it is not an intact `.tar.gz`."""
    try:
        with gzip.GzipFile(fileobj=handle, mode="rb") as unzipped:
            with tarfile.open(fileobj=unzipped, mode="r|") as tar:
                for member in tar:
                    data = tar.extractfile(member) if member.isfile() else None
                    if data is not None:
                        while data.read(1 << 20):
                            pass
            # tar stops at its end marker; gzip checks its CRC and length only at the end.
            while unzipped.read(1 << 20):
                pass
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ValueError(f"not an intact .tar.gz ({exc or type(exc).__name__})") from None


def _walk(top: Path) -> list[Path]:
    """Every path below top in a stable order, without .git, not following symlinks."""
    found: list[Path] = []
    for directory, dirnames, filenames in os.walk(top, followlinks=False):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_NAMES)
        base = Path(directory)
        for name in dirnames:
            found.append(base / name)
        found.extend(base / name for name in sorted(filenames) if name not in _SKIPPED_NAMES)
    return sorted(found, key=lambda p: p.relative_to(top).as_posix())
