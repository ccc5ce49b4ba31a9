"""Damage to stored bytes, as every backend and every checker reports it: the error a read of
damaged bytes raises, and what dropping them took away (a replica's local copy only, or the
blob that every replica shares)."""

from __future__ import annotations

import enum

from proxy.core.errors import IntegrityError
from proxy.store.file_identity import FileIdentity


class DamagedFile(IntegrityError):
    """A stored file whose bytes are not the signed package, or cannot be read: it must be
    dropped and fetched again."""

    def __init__(self, message: str, identity: FileIdentity | None,
                 sha256: str | None = None, expected: str | None = None) -> None:
        super().__init__("stored", message)
        self.identity = identity  # of the file that was read, if known
        self.sha256 = sha256  # of the bytes read, when they were read whole
        self.expected = expected  # the sha256 its record vouches for, when it was checked


class Dropped(enum.Enum):
    """What a drop of damaged bytes removed."""

    NOTHING = "nothing"  # gone, or replaced since it was read: not the bytes judged
    LOCAL_COPY = "local copy"  # this replica's copy only: the shared blob read back intact
    BLOB = "blob"  # the blob itself (on a shared store: for every replica)

    def where(self) -> str:
        """Which copy held the damaged bytes, for messages."""
        return "the local hot copy" if self is Dropped.LOCAL_COPY else "the stored file"
