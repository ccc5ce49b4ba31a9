"""The version policy (`[policy]`): a cooldown counted from the release's signed time, deny
and allow entries, the same answer on every protocol (network mirror, providers.v1,
modules.v1, OCI, the CLI releases), changed by SIGHUP, checked by `policy check`. The fake
upstream here signs each release at a chosen time (gpg's --faked-system-time)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import urllib.error
from collections.abc import Callable, Iterator
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from io import BytesIO
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import trustme
from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import Config, ConfigError, load_config
from proxy.core.executors import serving
from proxy.core.metrics import Metrics
from proxy.store import layout
from proxy.store.disk import open_disk_storage
from tests.conftest import config_writer
from tests.support.audit import audit_lines, eventually
from tests.support.fake_registry import FakeRegistry
from tests.support.gpg import GpgKey, generate_key, stop_agent
from tests.support.metrics import sample
from tests.support.proxy_process import ProxyProcess, free_port
from tests.support.terraform import terraform_env, terraform_init

DAY, HOUR = 86400, 3600
# Versions and how long ago they were signed.
ALPHA = {"1.0.0": 30 * DAY, "1.1.0": 20 * DAY, "1.1.2": 10 * DAY, "1.1.3": 5 * DAY,
         "1.2.0": HOUR}
TERRAFORM = {"1.9.7": 20 * DAY, "1.9.8": 10 * DAY, "1.12.0": HOUR}
OPENTOFU = {"1.9.1": 10 * DAY, "1.10.0": HOUR}
BOX = ("1.0.0", "1.1.0", "1.2.0")  # a module: no signature, dated from first sight
HOST = "registry.terraform.io"
SIGNED: dict[tuple[str, str], float] = {}  # when the fixture signed each release
ALPHA_ADDRESS = f"{HOST}/acme/alpha"
MIRROR = f"/mirror/{ALPHA_ADDRESS}"
CVE = "CVE-2026-12345: leaks credentials in plan output"

COOLDOWN = """
[policy]
min_release_age = "72h"
"""
# Every kind of entry, on every kind of address.
EVERY_RULE = COOLDOWN + f"""
[[policy.rules]]
match = "{HOST}/acme/box"
min_release_age = "0"

[[policy.deny]]
match = "{ALPHA_ADDRESS}"
versions = ">= 1.1.0, < 1.1.3"
reason = "{CVE}"

[[policy.deny]]
match = "{HOST}/acme/box"
versions = "1.1.0"
reason = "broken"

[[policy.deny]]
match = "releases/terraform"
versions = "1.9.8"
reason = "regression"
"""


@pytest.fixture(scope="module")
def dated_keys(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GpgKey, GpgKey]]:
    """A signer and an impostor made in the past, so that they can sign at past times."""
    home = tmp_path_factory.mktemp("dated-gpg")
    keys = (generate_key(home / "signer", "Dated Signer", at="20250101T000000"),
            generate_key(home / "impostor", "Dated Impostor", at="20250101T000000"))
    yield keys
    for key in keys:
        stop_agent(key)


@pytest.fixture(scope="module")
def dated(upstream_ca: trustme.CA, dated_keys: tuple[GpgKey, GpgKey]) -> Iterator[FakeRegistry]:
    """An upstream whose releases were signed at the ages above."""
    server = FakeRegistry(upstream_ca, *dated_keys)
    now = time.time()
    for version, age in ALPHA.items():
        SIGNED[("alpha", version)] = now - age
        server.add_release("acme", "alpha", version, signed_at=now - age)
    for version, age in TERRAFORM.items():
        server.cli.add("terraform", version, platforms=("linux_amd64",), signed_at=now - age)
    for version, age in OPENTOFU.items():
        server.cli.add("opentofu", version, platforms=("linux_amd64",), signed_at=now - age)
    for version in BOX:
        server.add_module_archive(f"box-{version}.tar.gz", _tar_gz(version))
        server.add_module("acme", "box", "aws", version,  # relative: the registry's host
                          f"../../../../../../archives/box-{version}.tar.gz")
    server.start()
    yield server
    server.stop()


def _tar_gz(version: str) -> bytes:
    buffer = BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        data = f'output "version" {{\n  value = "{version}"\n}}\n'.encode()
        info = tarfile.TarInfo("main.tf")
        info.size = len(data)
        archive.addfile(info, BytesIO(data))
    return buffer.getvalue()


@pytest.fixture
def upstream(dated: FakeRegistry) -> Iterator[FakeRegistry]:
    dated.reset()
    yield dated
    dated.reset()


@pytest.fixture
def write_policy_config(tmp_path: Path, upstream: FakeRegistry, upstream_ca_file: Path,
                        dated_keys: tuple[GpgKey, GpgKey]) -> Callable[..., Path]:
    """Write tmp_path/proxy.toml: the dated upstream as registry.terraform.io and the CLI
    releases, with the policy lines given."""
    keys = tmp_path / "release-keys.asc"
    keys.write_text(dated_keys[0].armored_public_key)
    write = config_writer(tmp_path, upstream, upstream_ca_file)

    def policy_config(policy: str, **options: Any) -> Path:
        return write(extra=upstream.cli.toml(keys) + policy, **options)

    return policy_config


def _versions(body: dict[str, Any]) -> set[str]:
    return {entry["version"] for entry in body["versions"]}


def _served_from(message: str) -> float:
    found = re.search(r"served from (\S+Z)", message)
    assert found, message
    return datetime.strptime(found.group(1), "%Y-%m-%dT%H:%M:%SZ").replace(
        tzinfo=UTC).timestamp()


async def test_one_answer_on_every_protocol_refused_with_why_and_from_when(
        aiohttp_client: Any, write_policy_config: Callable[..., Path], upstream: FakeRegistry,
        tmp_path: Path) -> None:
    audit = tmp_path / "audit.log"
    config = load_config(write_policy_config(EVERY_RULE), environ={
        "TF_REGISTRY_PROXY_SERVER_AUDIT_LOG": str(audit)})
    client: TestClient = await aiohttp_client(create_app(config))  # type: ignore[type-arg]

    async def get(path: str) -> tuple[int, Any]:
        response = await client.get(path)
        body = await response.read()
        return response.status, json.loads(body) if body[:1] in (b"{", b"[") else body

    shown = {"1.0.0", "1.1.3"}  # 1.1.0 and 1.1.2 denied, 1.2.0 an hour old
    status, index = await get(f"{MIRROR}/index.json")
    assert status == 200 and set(index["versions"]) == shown
    status, listed = await get(f"/providers/{ALPHA_ADDRESS}/versions")
    assert status == 200 and _versions(listed) == shown
    warnings = listed["warnings"]  # what Terraform prints, newest first
    assert warnings[0].startswith(f"{ALPHA_ADDRESS} 1.2.0 is too new for the version policy")
    assert f"{ALPHA_ADDRESS} 1.1.2 is denied by policy.deny[0]: {CVE}" in warnings
    status, tags = await get(f"/v2/providers/{ALPHA_ADDRESS}/tags/list")
    assert status == 200 and set(tags["tags"]) == shown
    status, modules = await get(f"/modules/{HOST}/acme/box/aws/versions")
    assert status == 200
    assert {v["version"] for v in modules["modules"][0]["versions"]} == {"1.0.0", "1.2.0"}
    status, module_tags = await get(f"/v2/modules/{HOST}/acme/box/aws/tags/list")
    assert status == 200 and set(module_tags["tags"]) == {"1.0.0", "1.2.0"}
    status, terraform = await get("/releases/terraform/index.json")
    assert status == 200 and set(terraform["versions"]) == {"1.9.7"}
    status, tofu = await get("/releases/tofu/api.json")
    assert status == 200 and [v["id"] for v in tofu["versions"]] == ["1.9.1"]
    status, tree = await get("/releases/opentofu/opentofu/releases/download/")
    assert status == 200 and b"v1.9.1/" in tree and b"v1.10.0/" not in tree

    signed = SIGNED[("alpha", "1.2.0")]
    status, too_new = await get(f"{MIRROR}/1.2.0.json")
    assert status == 403
    message = too_new["error"]["message"] if "error" in too_new else too_new["errors"][0]
    assert "too new for the version policy" in str(message) and "72h" in str(message)
    assert abs(_served_from(str(message)) - (signed + 72 * HOUR)) < 120
    refusals: dict[str, tuple[int, str]] = {}
    for path in (f"{MIRROR}/1.1.2.json", f"{MIRROR}/terraform-provider-alpha_1.2.0_linux_amd64.zip",
                 f"/providers/{ALPHA_ADDRESS}/1.2.0/download/linux/amd64",
                 f"/providers/{ALPHA_ADDRESS}/1.1.0/download/linux/amd64",
                 f"/modules/{HOST}/acme/box/aws/1.1.0/download",
                 "/releases/terraform/1.12.0/terraform_1.12.0_linux_amd64.zip",
                 "/releases/terraform/1.9.8/index.json"):
        status, body = await get(path)
        refusals[path] = (status, json.dumps(body) if isinstance(body, dict) else str(body))
    assert all(status == 403 for status, _ in refusals.values()), refusals
    assert CVE in refusals[f"{MIRROR}/1.1.2.json"][1]
    assert "regression" in refusals["/releases/terraform/1.9.8/index.json"][1]
    status, oci = await get(f"/v2/providers/{ALPHA_ADDRESS}/manifests/1.2.0")
    assert status == 403 and oci["errors"][0]["code"] == "DENIED"
    assert "too new" in oci["errors"][0]["message"]

    # Nothing refused was fetched: no denied version was even dated, no archive asked for.
    fetched = upstream.paths()
    assert not [p for p in fetched if "/1.1.0/" in p or "/1.1.2/" in p or p.endswith(".zip")
                or "box-1.1.0" in p], fetched
    metrics = (await (await client.get("/metrics")).read()).decode()
    # Refused requests (lists that leave versions out are not refusals).
    assert sample(metrics, "tfproxy_policy_refusals_total", reason="cooldown") == 5
    assert sample(metrics, "tfproxy_policy_refusals_total", reason="deny") == 4
    status_document = await (await client.get("/status.json")).json()
    assert [d["match"] for d in status_document["policy"]["deny"]] == [
        ALPHA_ADDRESS, f"{HOST}/acme/box", "releases/terraform"]
    assert any("1.2.0" in r["artifact"] and r["kind"] == "cooldown"
               for r in status_document["policy_refusals"])
    page = (await (await client.get("/")).read()).decode()
    assert "CVE-2026-12345" in page and 'id="policy-refusals"' in page
    refused = await eventually(audit, "refused", count=7, outcome="policy_deny")
    assert {(line.get("type") or line["name"], line["version"], line["rule"], line["status"])
            for line in refused} \
        == {("alpha", "1.1.2", "policy.deny[0]", 403), ("alpha", "1.1.0", "policy.deny[0]", 403),
            ("box", "1.1.0", "policy.deny[1]", 403), ("terraform", "1.9.8", "policy.deny[2]", 403),
            # left out of the lists the client read
            ("alpha", "1.1.2", "policy.deny[0]", 200), ("alpha", "1.1.0", "policy.deny[0]", 200),
            ("box", "1.1.0", "policy.deny[1]", 200)}, refused


async def test_module_ages_come_from_first_sight_and_survive_restarts_and_a_bundle(
        aiohttp_client: Any, write_policy_config: Callable[..., Path], tmp_path: Path) -> None:
    config = load_config(write_policy_config('[policy]\nmin_release_age = "2s"\n'),
                         environ={})
    modules = f"/modules/{HOST}/acme/box/aws/versions"

    async def listed(client: TestClient) -> set[str]:  # type: ignore[type-arg]
        body = await (await client.get(modules)).json()
        return {v["version"] for v in body["modules"][0]["versions"]}

    first = await aiohttp_client(create_app(config))
    assert await listed(first) == set()  # first seen just now: every version is new
    download = await first.get(f"/modules/{HOST}/acme/box/aws/1.2.0/download")
    assert download.status == 403
    await asyncio.sleep(2.2)
    assert await listed(first) == set(BOX)
    download = await first.get(f"/modules/{HOST}/acme/box/aws/1.2.0/download")
    assert download.status in (200, 204)
    archive = await first.get(urlsplit(download.headers["X-Terraform-Get"]).path)
    assert archive.status == 200, await archive.text()
    await first.close()

    # A restart keeps the first sightings: still old enough at once.
    again = await aiohttp_client(create_app(config))
    assert await listed(again) == set(BOX)
    await again.close()

    # A bundle carries them across the air gap: the inside counts from the same time.
    bundle = tmp_path / "bundle.tar"
    exported = _cli("export", "--unsigned", "--output", str(bundle), config=config.source)
    assert exported.returncode == 0, exported.stderr
    manifest = json.loads(tarfile.open(bundle).extractfile("manifest.json").read())  # type: ignore[union-attr]
    first_seen = {m["version"]: m["first_seen"] for m in manifest["modules"]}
    assert set(first_seen) == {"1.2.0"} and time.time() - first_seen["1.2.0"] > 2
    inside = tmp_path / "inside.toml"
    inside.write_text(f'[cache]\ndir = "{tmp_path / "inside-cache"}"\n[server]\nstate_dir = '
                      f'"{tmp_path / "inside-state"}"\n[upstream]\nmode = "offline"\n'
                      '[policy]\nmin_release_age = "1h"\n')
    imported = _cli("import", "--allow-unsigned", str(bundle), config=inside)
    assert imported.returncode == 0, imported.stderr
    inside_config = load_config(inside, environ={})
    offline = await aiohttp_client(create_app(inside_config))
    assert await listed(offline) == set()  # seen 2 s ago outside: younger than 1h
    await offline.close()
    assert await _sightings(inside_config, "1.2.0") == pytest.approx(first_seen["1.2.0"])


async def _sightings(config: Config, version: str) -> float:
    """When the store says the module version was first seen."""
    async with serving(), AsyncExitStack() as opened:
        storage = await open_disk_storage(config.cache, Metrics(), opened)
        record = await storage.index.get(layout.sightings_record("module",
                                                                 f"{HOST}/acme/box/aws"))
    assert isinstance(record, dict)
    return float(record["versions"][version][0])


def _cli(*args: str, config: Path | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "proxy", *args, "--config", str(config)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TF_REGISTRY_PROXY_CONFIG": ""})


def test_a_policy_that_does_not_parse_names_each_problem(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text('[policy]\nmin_release_age = "soon"\nwindow = 1\n'
                    '[[policy.deny]]\nmatch = "acme"\nversions = "banana"\n')
    with pytest.raises(ConfigError) as raised:
        load_config(path, environ={})
    problems = "\n".join(raised.value.problems)
    assert 'policy.min_release_age: expected a duration such as "72h"' in problems
    assert "policy.window: unknown key" in problems
    assert "policy.deny[0].match: expected HOST/NAMESPACE/NAME" in problems


ALPHA_ROOT = """
terraform {
  required_providers {
    alpha = { source = "acme/alpha", version = "%s" }
  }
}
"""


@pytest.mark.e2e
def test_terraform_init_under_a_cooldown_a_lock_file_an_exception_and_a_sighup_deny(
        tmp_path: Path, write_policy_config: Callable[..., Path], upstream: FakeRegistry,
        upstream_ca_file: Path) -> None:
    port, cache, audit = free_port(), tmp_path / "cache", tmp_path / "audit.log"
    config = write_policy_config(COOLDOWN, cache_dir=cache, port=port)

    def workdir(name: str, constraint: str, lock: Path | None = None) -> Path:
        path = tmp_path / name
        path.mkdir()
        (path / "main.tf").write_text(ALPHA_ROOT % constraint)
        if lock is not None:
            (path / ".terraform.lock.hcl").write_text(lock.read_text())
        return path

    # A direct install from upstream pins the version signed an hour ago.
    direct_config = tmp_path / "direct.tfrc"
    direct_config.write_text(f'host "{HOST}" {{\n  services = {{\n'
                             f'    "providers.v1" = "{upstream.providers_url}"\n  }}\n}}\n')
    direct = workdir("direct", "1.2.0")
    result = terraform_init(direct, terraform_env(tmp_path / "direct-home", direct_config,
                                                  upstream_ca_file))
    assert result.retcode == 0, result.output
    pinned = direct / ".terraform.lock.hcl"

    with ProxyProcess(config, cache, port, tmp_path / "proxy.log",
                      env={"TF_REGISTRY_PROXY_SERVER_AUDIT_LOG": str(audit)}) as proxy:
        printed = proxy.cli("client-config", "--mode", "registry")
        cli_config = tmp_path / "client.tfrc"
        cli_config.write_text(printed.stdout)

        def init(path: Path) -> Any:
            return terraform_init(path, terraform_env(tmp_path / f"home-{path.name}",
                                                      cli_config, proxy.ca_file))

        result = init(workdir("fresh", ">= 1.0"))
        assert result.retcode == 0, result.output
        assert "Installed acme/alpha v1.1.3" in result.stdout  # the newest old enough

        locked = init(workdir("locked", ">= 1.0", pinned))
        assert locked.retcode != 0
        assert "1.2.0 is too new for the version policy" in locked.output, locked.output
        assert "served from" in locked.output
        told = [line for line in audit_lines(audit) if line["event"] == "refused"
                and line.get("version") == "1.2.0"]
        assert told and told[0]["outcome"] == "policy_cooldown"
        assert told[0]["rule"] == "policy.min_release_age"

        checked = json.loads(proxy.cli("policy", "check", "--json").stdout)
        hidden = {h["version"]: h for a in checked["addresses"]
                  if a["address"] == ALPHA_ADDRESS for h in a["hidden"]}
        index = json.loads(proxy.get(f"{MIRROR}/index.json"))
        assert set(hidden) == set(ALPHA) - set(index["versions"]) == {"1.2.0"}
        assert hidden["1.2.0"]["served_from"] is not None

        # An exception, put in force by SIGHUP: served at once.
        config.write_text(config.read_text() + f'\n[[policy.allow]]\nmatch = "{ALPHA_ADDRESS}"'
                          '\nversions = "1.2.0"\nreason = "hotfix, SEC-42"\n')
        _hangup(proxy, "1 allow entries")
        allowed = init(workdir("allowed", ">= 1.0", pinned))
        assert allowed.retcode == 0, allowed.output
        assert "Installed acme/alpha v1.2.0" in allowed.stdout
        package = f"{MIRROR}/terraform-provider-alpha_1.2.0_linux_amd64.zip"
        assert proxy.get(package)[:2] == b"PK"  # cached now

        # A deny rule added by SIGHUP stops the cached package at once.
        config.write_text(config.read_text() + f'\n[[policy.deny]]\nmatch = "{ALPHA_ADDRESS}"'
                          '\nversions = "1.2.0"\nreason = "pulled by the vendor"\n')
        _hangup(proxy, "1 deny and 1 allow entries")
        with pytest.raises(urllib.error.HTTPError) as refused:
            proxy.get(package)
        assert refused.value.code == 403
        assert "pulled by the vendor" in refused.value.read().decode()
        checked = proxy.cli("policy", "check", ALPHA_ADDRESS)
        assert checked.returncode == 0, checked.stderr
        assert "1.2.0  deny (policy.deny[0]): pulled by the vendor" in checked.stdout

        # A policy that does not parse keeps the one in force.
        config.write_text(config.read_text() + '\n[[policy.deny]]\nmatch = "nonsense"\n')
        _hangup(proxy, "does not load, the version policy in force stays")
        with pytest.raises(urllib.error.HTTPError) as still_refused:
            proxy.get(package)
        assert still_refused.value.code == 403
        assert "pulled by the vendor" in still_refused.value.read().decode()
        assert proxy.process.poll() is None


def _hangup(proxy: ProxyProcess, expected: str) -> None:
    """SIGHUP, then wait for the log line saying what it did."""
    before = proxy.log.read_text().count(expected)
    os.kill(proxy.process.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while proxy.log.read_text().count(expected) <= before:
        assert time.monotonic() < deadline, proxy.log.read_text()[-2000:]
        time.sleep(0.05)

