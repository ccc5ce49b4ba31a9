"""h1: and zh: hashes against known vectors and Go's dirhash rules."""

from __future__ import annotations

import hashlib
from pathlib import Path

from proxy.verification.hashes import h1_from_entries, h1_of_zip, zh_hash
from tests.support.fake_registry import build_zip

# Computed independently with coreutils:
#   (printf '%s  a.txt\n' $(sha256sum a); printf '%s  dir/\n' $(sha256sum empty); ...)
#   | sha256sum | xxd -r -p | base64
VECTOR_ENTRIES = [("a.txt", b"hello\n"), ("dir/", b""), ("dir/b", b"x")]
VECTOR_H1 = "h1:k2Gwmp4MKFHgdzErNYYVnTEHdpnmagb863dt8VhL3uE="


def test_h1_known_vector() -> None:
    assert h1_from_entries(VECTOR_ENTRIES) == VECTOR_H1


def test_h1_is_independent_of_entry_order() -> None:
    assert h1_from_entries(reversed(VECTOR_ENTRIES)) == VECTOR_H1


def test_h1_sorts_names_as_bytes() -> None:
    # "B" (0x42) sorts before "a" (0x61) in Go's byte order.
    lines = "".join(f"{hashlib.sha256(c).hexdigest()}  {n}\n"
                    for n, c in [("B", b"2"), ("a", b"1")]).encode()
    import base64
    expected = "h1:" + base64.b64encode(hashlib.sha256(lines).digest()).decode()
    assert h1_from_entries([("a", b"1"), ("B", b"2")]) == expected


def test_h1_of_zip_counts_directory_entries(tmp_path: Path) -> None:
    path = tmp_path / "p.zip"
    path.write_bytes(build_zip({"a.txt": (b"hello\n", 0o644), "dir/": (b"", 0o755),
                                "dir/b": (b"x", 0o644)}))
    assert h1_of_zip(path) == VECTOR_H1


def test_zh_is_lowercase_sha256() -> None:
    assert zh_hash("ABCDEF") == "zh:abcdef"
