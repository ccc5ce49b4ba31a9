"""Module trees: safe unpacking, subdirectory selection, the repacked archive."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from proxy.core.errors import UpstreamError
from proxy.modules.packing import UnsafeArchive, pack, select_subdir, unpack
from tests.conftest import tar_gz
from tests.support.fake_registry import build_zip

LIMIT = 1 << 20


def members(path: Path) -> dict[str, tuple[int, bytes | None]]:
    with tarfile.open(path, "r:gz") as tar:
        return {m.name: (m.mode, tar.extractfile(m).read() if m.isfile() else None)  # type: ignore[union-attr]
                for m in tar.getmembers()}


def test_pack_is_rooted_reproducible_and_skips_git(tmp_path: Path) -> None:
    root = tmp_path / "m"
    (root / ".git").mkdir(parents=True)
    (root / ".git/config").write_text("x")
    (root / "sub").mkdir()
    (root / "sub/.git").write_text("gitdir: ../.git/modules/sub")
    (root / "main.tf").write_text("a")
    (root / "run.sh").write_text("#!/bin/sh")
    (root / "run.sh").chmod(0o755)
    (root / "alias.tf").symlink_to("main.tf")
    pack(root, tmp_path / "a.tar.gz", LIMIT)
    os.utime(root / "main.tf", (1, 1))
    pack(root, tmp_path / "b.tar.gz", LIMIT)
    assert (tmp_path / "a.tar.gz").read_bytes() == (tmp_path / "b.tar.gz").read_bytes()
    found = members(tmp_path / "a.tar.gz")
    assert set(found) == {"alias.tf", "main.tf", "run.sh", "sub"}
    assert found["alias.tf"] == (0o644, b"a")  # in-tree file symlink stored as the file
    assert found["run.sh"][0] == 0o755


@pytest.mark.parametrize("make_link", [
    lambda root: (root / "escape").symlink_to("/etc/passwd"),
    lambda root: (root / "escape").symlink_to("../outside"),
    lambda root: (root / "dirlink").symlink_to("sub"),
])
def test_pack_refuses_links_that_leave_or_loop(tmp_path: Path, make_link) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "m"
    (root / "sub").mkdir(parents=True)
    (tmp_path / "outside").write_text("secret")
    make_link(root)
    with pytest.raises(UnsafeArchive):
        pack(root, tmp_path / "out.tar.gz", LIMIT)


def test_pack_size_limit(tmp_path: Path) -> None:
    root = tmp_path / "m"
    root.mkdir()
    (root / "big").write_bytes(b"x" * 2000)
    with pytest.raises(UnsafeArchive, match="larger than"):
        pack(root, tmp_path / "out.tar.gz", 1000)


def test_unpack_tar_and_zip(tmp_path: Path) -> None:
    (tmp_path / "a.tgz").write_bytes(tar_gz({"d/main.tf": b"x", "d/link": ("symlink", "main.tf")}))
    unpack(tmp_path / "a.tgz", "tgz", tmp_path / "t", LIMIT)
    assert (tmp_path / "t/d/main.tf").read_bytes() == b"x"
    assert (tmp_path / "t/d/link").is_symlink()
    (tmp_path / "a.zip").write_bytes(build_zip({"bin/tool": (b"#!", 0o755), "e/": (b"", 0o755)}))
    unpack(tmp_path / "a.zip", "zip", tmp_path / "z", LIMIT)
    assert os.access(tmp_path / "z/bin/tool", os.X_OK)
    assert (tmp_path / "z/e").is_dir()


@pytest.mark.parametrize("bad", [
    {"../x": b"x"}, {"/abs": b"x"}, {"a/../../x": b"x"}, {"l": ("symlink", "/etc")},
    {"d/l": ("symlink", "../../x")}, {"h": ("hardlink", "../x")},
])
def test_unpack_refuses_escapes(tmp_path: Path, bad: dict[str, bytes | tuple[str, str]]) -> None:
    (tmp_path / "a.tgz").write_bytes(tar_gz(bad))
    with pytest.raises(UnsafeArchive):
        unpack(tmp_path / "a.tgz", "tar.gz", tmp_path / "t", LIMIT)
    assert not (tmp_path / "x").exists()


def test_unpack_refuses_zip_traversal_and_bombs(tmp_path: Path) -> None:
    (tmp_path / "a.zip").write_bytes(build_zip({"../x": (b"x", 0o644)}))
    with pytest.raises(UnsafeArchive):
        unpack(tmp_path / "a.zip", "zip", tmp_path / "z", LIMIT)
    (tmp_path / "b.zip").write_bytes(build_zip({"big": (b"\0" * 5000, 0o644)}))
    with pytest.raises(UnsafeArchive, match="more than"):
        unpack(tmp_path / "b.zip", "zip", tmp_path / "z2", 1000)


def test_unpack_refuses_devices(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        info = tarfile.TarInfo("dev")
        info.type = tarfile.CHRTYPE
        tar.addfile(info)
    (tmp_path / "a.tgz").write_bytes(buffer.getvalue())
    with pytest.raises(UnsafeArchive, match="not a file"):
        unpack(tmp_path / "a.tgz", "tgz", tmp_path / "t", LIMIT)


def test_corrupt_archive_is_an_upstream_error(tmp_path: Path) -> None:
    (tmp_path / "a.tgz").write_bytes(b"not gzip")
    with pytest.raises(UpstreamError, match="cannot be unpacked"):
        unpack(tmp_path / "a.tgz", "tgz", tmp_path / "t", LIMIT)


def test_select_subdir(tmp_path: Path) -> None:
    (tmp_path / "repo-abc/modules/x").mkdir(parents=True)
    (tmp_path / "other.txt").write_text("")
    assert select_subdir(tmp_path, "") == tmp_path
    assert select_subdir(tmp_path, "*/modules/x") == tmp_path / "repo-abc/modules/x"
    for bad in ("missing", "*/modules/y", "repo-abc/../../"):
        with pytest.raises(UpstreamError):
            select_subdir(tmp_path, bad)
    (tmp_path / "repo-def").mkdir()
    with pytest.raises(UpstreamError, match="matches 2"):
        select_subdir(tmp_path, "repo-*")
