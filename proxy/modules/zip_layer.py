"""A repacked module (`.tar.gz`) as the `archive/zip` layer OpenTofu's `oci://` module source
takes (https://opentofu.org/docs/language/modules/sources/#oci-distribution-registry).
Blocking: callers run it in a thread.

The zip is a function of the tree alone: members in the archive's (sorted) order, stored
uncompressed (deflate output differs between zlib builds; stored bytes do not), every time
1980-01-01, modes 0644/0755, fixed header versions. The same module gives the same bytes and so
the same digest in every process, replica and rebuild."""

from __future__ import annotations

import gzip
import os
import shutil
import tarfile
import zipfile
import zlib
from pathlib import Path
from typing import BinaryIO

_EPOCH = (1980, 1, 1, 0, 0, 0)
_UNIX = 3
_VERSION = 20  # "2.0": stored entries and directories
_ZIP64_FROM = (1 << 31) - 1


def _entry(name: str, mode: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=_EPOCH)
    info.compress_type = zipfile.ZIP_STORED
    info.create_system = _UNIX
    info.create_version = info.extract_version = _VERSION
    info.external_attr = mode << 16
    if name.endswith("/"):
        info.external_attr |= 0x10  # MS-DOS directory flag
    return info


def zip_from_packed(packed: BinaryIO, output: Path) -> None:
    """Write the module in packed (an open `.tar.gz` the proxy made) to output as a
    reproducible zip, fsynced; ValueError if packed is not an intact `.tar.gz` of plain files
    and directories."""
    try:
        with open(output, "wb") as raw:
            with gzip.GzipFile(fileobj=packed, mode="rb") as unzipped, \
                    tarfile.open(fileobj=unzipped, mode="r|") as tar, \
                    zipfile.ZipFile(raw, "w", zipfile.ZIP_STORED) as archive:
                for member in tar:
                    if member.isdir():
                        archive.writestr(_entry(member.name.rstrip("/") + "/", 0o40755), b"")
                    elif member.isfile():
                        mode = 0o100755 if member.mode & 0o111 else 0o100644
                        data = tar.extractfile(member)
                        assert data is not None  # a regular file has data
                        # Sizes past 2 GiB need zip64 headers, chosen by size: the same
                        # tree still gives the same bytes.
                        with archive.open(_entry(member.name, mode), "w",
                                          force_zip64=member.size >= _ZIP64_FROM) as sink:
                            shutil.copyfileobj(data, sink, 1 << 20)
                    else:
                        raise ValueError(f"not a plain file or directory: {member.name!r}")
            raw.flush()
            os.fsync(raw.fileno())
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise ValueError(f"not an intact .tar.gz ({exc or type(exc).__name__})") from None
