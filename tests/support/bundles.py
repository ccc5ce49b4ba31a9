"""Air-gap bundles for tests: run the CLI as an operator would, read a bundle's members and
manifest, write altered bundles (signed again with the exporter's key when asked), and take
snapshots of a cache (its files byte for byte, and its index records)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import diskcache
import pysequoia


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`python -m proxy ARGS` of the checkout under test (PYTHONPATH passed through)."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd)}
    if "PYTHONPATH" in os.environ:
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return subprocess.run([sys.executable, "-m", "proxy", *args], capture_output=True,
                          text=True, env=env, timeout=300, cwd=cwd)


def offline_config(tmp_path: Path, name: str, extra: str = "", port: int = 8443) -> Path:
    """A proxy in the air-gapped network (cache tmp_path/name): its upstream does not
    exist, and it is offline. extra: more lines for the [upstream] table."""
    path = tmp_path / f"{name}.toml"
    path.write_text(f"""
[server]
listen = "127.0.0.1:{port}"
state_dir = "{tmp_path / (name + '-state')}"
[cache]
dir = "{tmp_path / name}"
[upstream]
mode = "offline"
{extra}
[upstream.hosts."registry.terraform.io".services]
"providers.v1" = "https://upstream.invalid/v1/providers/"
"modules.v1" = "https://upstream.invalid/v1/modules/"
""")
    return path


def read_bundle(bundle: Path) -> tuple[dict[str, bytes], dict[str, Any]]:
    """Every member of a bundle, and its manifest."""
    members = {}
    with tarfile.open(bundle) as tar:
        for member in tar.getmembers():
            source = tar.extractfile(member) if member.isfile() else None
            if source is not None:
                members[member.name] = source.read()
    return members, json.loads(members["manifest.json"])


def write_bundle(path: Path, members: dict[str, bytes], manifest: dict[str, Any] | None = None,
                 signing_key: Path | None = None) -> Path:
    """A tar of members: the manifest, when given, rewritten first, then signed again with
    signing_key, when given (else the old signature, if any, is kept)."""
    if manifest is not None:
        members = {**members, "manifest.json": json.dumps(manifest).encode()}
    if signing_key is not None:
        key = pysequoia.Tsk.from_bytes(signing_key.read_bytes())
        members = {**members, "manifest.json.sig": pysequoia.sign(
            key.signer(), members["manifest.json"], mode=pysequoia.SignatureMode.DETACHED,
            armor=False)}
    with tarfile.open(path, "w") as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return path


def relist(manifest: dict[str, Any], name: str, content: bytes) -> None:
    """Make the manifest's entry for a member describe new content."""
    manifest["files"][name] = {"size": len(content),
                               "sha256": hashlib.sha256(content).hexdigest()}


def cache_files(cache: Path) -> dict[str, str]:
    """Every file under the cache directory, but the index database, with its sha256; and
    every directory (value ""), so that one left behind shows."""
    found = {}
    for path in sorted(cache.rglob("*")):
        name = str(path.relative_to(cache))
        if path.is_dir():
            found[name + "/"] = ""
        elif not name.startswith("index/cache.db"):
            found[name] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def index_records(cache: Path) -> dict[str, Any]:
    """Every record of the cache index ({} when there is none). Opening the index rewrites
    its settings, so the database file is compared through this, not byte for byte."""
    if not (cache / "index").is_dir():
        return {}
    index = diskcache.Cache(str(cache / "index"))
    try:
        return {key: index.get(key) for key in index.iterkeys()}
    finally:
        index.close()


def cache_state(cache: Path) -> tuple[dict[str, str], dict[str, Any]]:
    """What a refused import must leave exactly as it was: files, directories, records."""
    return cache_files(cache), index_records(cache)


def changes_since(before: tuple[dict[str, str], dict[str, Any]], cache: Path) -> list[str]:
    """What differs in the cache from a cache_state taken before ([] when nothing)."""
    files, records = cache_state(cache)
    old_files, old_records = before
    return [f"{what} {name}" for what, names in (
        ("file added:", files.keys() - old_files.keys()),
        ("file removed:", old_files.keys() - files.keys()),
        ("file changed:", {n for n in files.keys() & old_files.keys()
                           if files[n] != old_files[n]}),
        ("record added:", records.keys() - old_records.keys()),
        ("record removed:", old_records.keys() - records.keys()),
        ("record changed:", {k for k in records.keys() & old_records.keys()
                             if records[k] != old_records[k]})) for name in sorted(names)]
