"""`keys export` (the registry signing keys the cache holds, per provider namespace) and the
audit lines of the air-gap commands: what `warm` fetched, `export` wrote and `import` took,
each with its sha256 and the key that signed it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tests.support.audit import events, with_audit_log
from tests.support.bundles import cli, offline_config
from tests.support.fake_registry import FakeRegistry
from tests.support.gpg import GpgKey

PACKAGE = {"kind": "provider", "host": "registry.terraform.io", "namespace": "hashicorp",
           "type": "null", "version": "3.2.1", "os": "linux", "arch": "amd64"}


def test_exported_keys_are_what_import_trusts_on_the_other_side(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry,
        signer: GpgKey, impostor: GpgKey) -> None:
    signer_id = signer.fingerprint[-16:].upper()
    outside_log, inside_log = tmp_path / "outside-audit.log", tmp_path / "inside-audit.log"
    connected = with_audit_log(write_config(cache_dir=tmp_path / "connected"), outside_log)
    empty = cli("keys", "export", "--config", str(connected), cwd=tmp_path)
    assert empty.returncode == 2 and "no verified provider package" in empty.stderr
    wanted = tmp_path / "wanted.txt"
    wanted.write_text("hashicorp/null 3.2.1\nacme/tarball/aws 1.0.0\n")
    warmed = cli("warm", "--config", str(connected), "--platform", "linux_amd64", str(wanted),
                 cwd=tmp_path)
    assert warmed.returncode == 0, warmed.stdout + warmed.stderr
    [fetched] = events(outside_log, "fetched", **PACKAGE)
    assert fetched["key_id"] == signer_id

    # One armored file (what import --trusted-keys takes), and the per-namespace layout.
    keys_file = tmp_path / "registry-keys.asc"
    listed = cli("keys", "export", "--config", str(connected), "--output", str(keys_file),
                 cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    assert f"registry.terraform.io/hashicorp  key {signer_id}  fingerprint " \
           f"{signer.fingerprint.upper()}" in listed.stdout
    assert keys_file.read_text().count("BEGIN PGP PUBLIC KEY BLOCK") == 1
    keys_dir = tmp_path / "registry-keys"
    assert cli("keys", "export", "--config", str(connected), "--output", str(keys_dir),
               cwd=tmp_path).returncode == 0
    index = json.loads((keys_dir / "keys.json").read_text())["namespaces"]
    [key] = index["registry.terraform.io/hashicorp"]["keys"]
    assert key["key_id"] == signer_id and key["signed"] == ["null 3.2.1"]
    assert key["providers"] == ["registry.terraform.io/hashicorp/null"]
    per_namespace = keys_dir / index["registry.terraform.io/hashicorp"]["file"]
    assert per_namespace == keys_dir / "registry.terraform.io" / "hashicorp.asc"

    bundle = tmp_path / "bundle.tar"
    exported = cli("export", "--config", str(connected), "--output", str(bundle),
                   "--unsigned", cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    [out] = events(outside_log, "exported", **PACKAGE)
    assert out["sha256"] == fetched["sha256"] and out["key_id"] == signer_id
    assert out["bundle"] == str(bundle) and out["bytes"] == fetched["bytes"]
    assert len(events(outside_log, "exported", kind="module", name="tarball")) == 1

    # The air-gapped side: a foreign key is refused, the exported keys are taken.
    inside = with_audit_log(offline_config(tmp_path, "inside"), inside_log)
    foreign = tmp_path / "foreign.asc"
    foreign.write_text(impostor.armored_public_key)
    refused = cli("import", "--config", str(inside), "--allow-unsigned-bundle",
                  "--trusted-keys", str(foreign), str(bundle), cwd=tmp_path)
    assert refused.returncode == 2
    assert f"made by key {signer_id}; tried key {impostor.fingerprint[-16:].upper()}" \
        in refused.stderr
    assert events(inside_log, "imported") == []
    for trusted, outcome in ((keys_file, "ok"), (per_namespace, "present")):
        imported = cli("import", "--config", str(inside), "--allow-unsigned-bundle",
                       "--trusted-keys", str(trusted), str(bundle), cwd=tmp_path)
        assert imported.returncode == 0, imported.stderr
        [line] = events(inside_log, "imported", outcome=outcome, **PACKAGE)
        assert line["sha256"] == fetched["sha256"] and line["key_id"] == signer_id
        assert line["bundle"] == str(bundle) and line["token"] is None
    # The other side's cache now holds the same keys.
    again = cli("keys", "export", "--config", str(inside), cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert f"key {signer_id}" in again.stdout and "signed 1 release(s)" in again.stdout
