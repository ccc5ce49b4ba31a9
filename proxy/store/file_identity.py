"""What identifies a stored file's bytes without reading them: its device, inode, size and
modification time. Writing to the file (in place or by replacing it), or restoring it from a
copy, gives it another identity; a use does not (the cache's LRU clock is the access time).
Damage that changes none of these (bit rot under an unchanged inode) is not seen here."""

from __future__ import annotations

import os
from typing import NamedTuple


class FileIdentity(NamedTuple):
    """A stored file as stat sees it."""

    device: int
    inode: int
    size: int
    mtime_ns: int


def identity_of(info: os.stat_result) -> FileIdentity:
    """The identity of the file that stat (or fstat) described."""
    return FileIdentity(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def identity_to_record(identity: FileIdentity | None) -> list[int] | None:
    """The identity as stored in an index record (plain ints: the index outlives classes)."""
    return None if identity is None else list(identity)


def identity_from_record(value: object) -> FileIdentity | None:
    """An identity read back from an index record; None for anything else (older records
    have none)."""
    if isinstance(value, (list, tuple)) and len(value) == 4 \
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return FileIdentity(*value)
    return None
