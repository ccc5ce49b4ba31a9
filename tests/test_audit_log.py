"""The audit log (server.audit_log): one JSON line per package or module served or fetched,
per refused request that named an artifact; who asked (client address, token name, never
the token); the upstream URL (masked), sha256 and key ID of each fill; lines kept whole
with several workers; a new file after logrotate's rename and SIGHUP."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import signal
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pytest

from proxy.config import ConfigError, load_config
from tests.conftest import AppClient
from tests.support.audit import audit_lines, events, eventually
from tests.support.fake_registry import DEFAULT_PLATFORMS, FakeRegistry
from tests.support.gpg import GpgKey
from tests.support.mirror_paths import BASE, ZIP, archive_path
from tests.support.proxy_process import ProxyProcess, free_port

TOKEN = "ci-runner-token-0123456789"
NULL = {"kind": "provider", "host": "registry.terraform.io", "namespace": "hashicorp",
        "type": "null"}


def key_id(key: GpgKey) -> str:
    return key.fingerprint[-16:].upper()


async def test_a_fill_and_the_archives_served_each_write_a_line(
        make: AppClient, registry: FakeRegistry, signer: GpgKey, tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    registry.faults.add("expiring")  # download URLs carry a token, as presigned ones do
    client = await make(server_audit_log=str(log))
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    for _ in range(2):  # a miss, then a hit
        response = await client.get(f"{BASE}/{ZIP}")
        assert response.status == 200
        await response.read()
    package = {**NULL, "version": "3.2.1", "os": "linux", "arch": "amd64"}
    size = len(release.zips["linux_amd64"])
    [fetched] = await eventually(log, "fetched")
    assert fetched | package == fetched and fetched["cache"] == "miss"
    assert fetched["sha256"] == release.sha256("linux_amd64") and fetched["bytes"] == size
    assert fetched["key_id"] == key_id(signer)
    assert fetched["upstream_url"].endswith(f"/{release.filename('linux_amd64')}?token=***")
    # Each written once its answer is sent, maybe after the client read it.
    served = await eventually(log, "served", count=2)
    assert [line["cache"] for line in served] == ["miss", "hit"]
    for line in (fetched, *served):
        assert line | package == line and line["outcome"] == "ok"
        assert line["client"] == "127.0.0.1" and line["token"] is None
        assert datetime.fromisoformat(line["time"]).utcoffset() is not None
        assert line["time"].endswith("Z")
    assert all(line["bytes"] == size for line in served)
    assert f"token={registry.url_token}" not in log.read_text()


async def test_served_packages_carry_the_sha256_and_key_of_their_fill(
        make: AppClient, registry: FakeRegistry, signer: GpgKey, tmp_path: Path) -> None:
    # An auditor must not need the fetched line (rotated away, maybe) to know what was sent.
    log = tmp_path / "audit.log"

    async def get_twice() -> None:
        client = await make(server_audit_log=str(log))
        for _ in range(2):
            response = await client.get(f"{BASE}/{ZIP}")
            assert response.status == 200
            await response.read()

    await get_twice()  # a miss, then a hit
    [fetched] = await eventually(log, "fetched")
    served = await eventually(log, "served", count=2)
    assert [line["cache"] for line in served] == ["miss", "hit"]
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    assert fetched["sha256"] == release.sha256("linux_amd64")
    assert fetched["key_id"] == key_id(signer)
    # The fetched line rotated away; a restarted proxy (nothing in memory) serves hits.
    log.rename(tmp_path / "audit.log.1")
    await get_twice()
    served += await eventually(log, "served", count=2)
    assert not events(log, "fetched")
    assert [line["cache"] for line in served] == ["miss", "hit", "hit", "hit"]
    for line in served:
        assert (line["sha256"], line["key_id"]) == (fetched["sha256"], fetched["key_id"])


async def test_module_fill_and_archive_are_audited(make: AppClient, registry: FakeRegistry,
                                                   tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    client = await make(server_audit_log=str(log))
    base = "/modules/registry.terraform.io/acme/tarball/aws/1.0.0"
    assert (await client.get(f"{base}/download")).status in (200, 204)
    for _ in range(2):  # waits for the fill `download` started, then a hit
        response = await client.get(f"{base}/tarball-aws-1.0.0.tar.gz")
        assert response.status == 200
        body = await response.read()
    module = {"kind": "module", "host": "registry.terraform.io", "namespace": "acme",
              "name": "tarball", "system": "aws", "version": "1.0.0"}
    [fetched] = await eventually(log, "fetched", **module)
    served = await eventually(log, "served", count=2, **module)
    for line in served:
        assert fetched["bytes"] == line["bytes"] == len(body)
        assert line["sha256"] == fetched["sha256"] == hashlib.sha256(body).hexdigest()
        assert "key_id" not in line
    assert fetched["upstream_url"].startswith(registry.url) and len(fetched["sha256"]) == 64
    assert "key_id" not in fetched  # nothing signs a module


async def test_refusals_that_name_an_artifact_say_why(make: AppClient, registry: FakeRegistry,
                                                      tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    online = await make(server_audit_log=str(log))
    assert (await online.get(f"{BASE}/9.9.9.json")).status == 404
    assert (await online.get("/mirror/example.com/acme/thing/index.json")).status == 404
    assert (await online.get("/mirror/bad_host!/acme/thing/index.json")).status in (400, 404)
    # A scanner's path under a real provider names no artifact (as for the warnings).
    assert (await online.get(f"{BASE}/wp-login.php")).status == 404
    offline = await make(server_audit_log=str(log), upstream_mode="offline")
    assert (await offline.get(f"{BASE}/{ZIP}")).status == 404
    refused = events(log, "refused")
    assert [(line["outcome"], line["status"]) for line in refused] == [
        ("unknown_version", 404), ("host_not_allowed", 404), ("offline", 404)]
    assert refused[0] | {**NULL, "version": "9.9.9"} == refused[0]
    assert refused[1]["host"] == "example.com" and "not served" in refused[1]["reason"]
    assert refused[2] | {**NULL, "version": "3.2.1", "os": "linux", "arch": "amd64"} \
        == refused[2] and "offline" in refused[2]["reason"]
    assert registry.archive_requests() == []


async def test_the_token_name_is_logged_never_the_token(
        make: AppClient, registry: FakeRegistry, tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    client = await make(extra=f'[auth]\ntokens = [{{ name = "ci-runner", token = "{TOKEN}" }},'
                              f' "second-token-abcdefghij"]\n', server_audit_log=str(log))
    auth = {"Authorization": f"Bearer {TOKEN}"}
    response = await client.get(f"{BASE}/{ZIP}", headers=auth)
    assert response.status == 200
    await response.read()
    assert (await client.get(f"{BASE}/9.9.9.json",
                             headers={"Authorization": "Bearer second-token-abcdefghij"}
                             )).status == 404
    assert (await client.get(f"{BASE}/9.9.9.json")).status == 401  # no token: not audited
    await eventually(log, "served")
    assert [(line["event"], line["token"]) for line in audit_lines(log)
            if line["event"] != "fetched"] == [("served", "ci-runner"),
                                               ("refused", "token-2")]
    [fetched] = await eventually(log, "fetched")
    assert fetched["token"] == "ci-runner"  # the fill ran for this request
    assert TOKEN not in log.read_text() and "abcdefghij" not in log.read_text()


async def test_archives_fetched_through_signed_urls_name_the_token_that_asked(
        make: AppClient, registry: FakeRegistry, tmp_path: Path) -> None:
    """Terraform fetches archives without credentials, through the signed URLs the version
    document hands out: the URL carries the name of the token that asked for it, signed."""
    log = tmp_path / "audit.log"
    client = await make(extra=f'[auth]\ntokens = [{{ name = "ci-runner", token = "{TOKEN}" }}]\n',
                        server_audit_log=str(log))
    document = await client.get(f"{BASE}/3.2.1.json",
                                headers={"Authorization": f"Bearer {TOKEN}"})
    url = (await document.json())["archives"]["linux_amd64"]["url"]
    assert "by=ci-runner" in url
    forged = url.replace("by=ci-runner", "by=someone-else")
    assert (await client.get(f"{BASE}/{forged}")).status == 401
    response = await client.get(f"{BASE}/{url}")  # no Authorization header
    assert response.status == 200
    await response.read()
    [served] = await eventually(log, "served")
    assert served["token"] == "ci-runner" and served["client"] == "127.0.0.1"


async def test_a_bad_signature_names_the_key_that_made_it_and_the_keys_tried(
        make: AppClient, registry: FakeRegistry, signer: GpgKey, impostor: GpgKey,
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    log = tmp_path / "audit.log"
    registry.faults.add("badsig")
    client = await make(server_audit_log=str(log))
    response = await client.get(f"{BASE}/3.2.1.json")
    assert response.status == 502
    message = (await response.json())["errors"][0]
    named = f"made by key {key_id(impostor)}; tried key {key_id(signer)}"
    assert named in message
    assert named in caplog.text
    [refused] = events(log, "refused")
    assert refused["outcome"] == "integrity" and named in refused["reason"]
    assert refused["key_id"] == key_id(impostor)
    assert refused["keys_tried"] == [key_id(signer)]


def test_token_names_and_the_audit_log_are_checked_with_the_config(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    tokens = tmp_path / "tokens"
    tokens.write_text(f"# name, then token\nrunner {TOKEN}\nsecond-token-abcdefghij\n")
    path.write_text(f'[server]\naudit_log = "{tmp_path / "audit.log"}"\n'
                    f'[auth]\ntokens = [{{ name = "ci", token = "{TOKEN}x" }}]\n'
                    f'tokens_file = "{tokens}"\n')
    config = load_config(path, environ={})
    assert config.server.audit_log == str(tmp_path / "audit.log")
    assert [config.auth.name_of(i) for i in range(3)] == ["ci", "runner", "token-3"]
    assert load_config(None, environ={}).server.audit_log is None
    path.write_text('[server]\naudit_log = "/no/such/dir/audit.log"\n'
                    '[auth]\ntokens = [{ name = "bad name", token = "0123456789abcdefgh" }]\n')
    with pytest.raises(ConfigError) as raised:
        load_config(path, environ={})
    assert len(raised.value.problems) == 2, raised.value.problems


def _get(proxy: ProxyProcess, path: str) -> int:
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    try:
        with urllib.request.urlopen(proxy.url + path.lstrip("/"), context=context,
                                    timeout=60) as response:
            response.read()
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def _audited_proxy(tmp_path: Path, write_config: Callable[..., Path], log: Path,
                   workers: int) -> ProxyProcess:
    port = free_port()
    cache = tmp_path / "cache"
    return ProxyProcess(write_config(cache_dir=cache, port=port), cache, port,
                        tmp_path / "proxy.log",
                        env={"TF_REGISTRY_PROXY_SERVER_WORKERS": str(workers),
                             "TF_REGISTRY_PROXY_SERVER_AUDIT_LOG": str(log)})


def test_workers_append_whole_lines_to_one_file(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    log = tmp_path / "audit.log"
    with _audited_proxy(tmp_path, write_config, log, workers=2) as proxy:
        paths = [archive_path(p) for p in DEFAULT_PLATFORMS] * 15 \
            + [f"{BASE}/9.9.{n}.json" for n in range(30)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
            statuses = list(pool.map(lambda path: _get(proxy, path), paths))
    assert statuses.count(200) == 15 * len(DEFAULT_PLATFORMS) and statuses.count(404) == 30
    lines = audit_lines(log)  # each line parses: none torn or interleaved
    assert len(events(log, "served")) == 15 * len(DEFAULT_PLATFORMS)
    assert sorted(line["version"] for line in events(log, "refused")) == sorted(
        f"9.9.{n}" for n in range(30))
    assert len(events(log, "fetched")) == len(DEFAULT_PLATFORMS)  # one fill per package
    assert len(lines) == 15 * len(DEFAULT_PLATFORMS) + 30 + len(DEFAULT_PLATFORMS)


def test_sighup_reopens_the_audit_log_after_a_rename(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    log = tmp_path / "audit.log"
    rotated = tmp_path / "audit.log.1"
    with _audited_proxy(tmp_path, write_config, log, workers=2) as proxy:
        assert proxy.process is not None
        assert _get(proxy, f"{BASE}/9.9.1.json") == 404
        os.rename(log, rotated)  # what logrotate does first
        assert _get(proxy, f"{BASE}/9.9.2.json") == 404  # still to the renamed file
        # To the parent, which forwards it to the workers (again until both took it: one
        # may still be starting, with SIGHUP ignored until it can reopen the file).
        deadline = time.monotonic() + 20
        while not all(f"w{n} proxy.core.audit: reopened the audit log" in proxy.log.read_text()
                      for n in (0, 1)):
            assert time.monotonic() < deadline, proxy.log.read_text()[-2000:]
            os.kill(proxy.process.pid, signal.SIGHUP)
            time.sleep(0.5)
        for n in range(3, 9):  # whichever worker answers
            assert _get(proxy, f"{BASE}/9.9.{n}.json") == 404
        assert proxy.process.poll() is None  # SIGHUP did not stop it
    assert [line["version"] for line in audit_lines(rotated)] == ["9.9.1", "9.9.2"]
    assert [line["version"] for line in audit_lines(log)] == [f"9.9.{n}" for n in range(3, 9)]
