"""The status page (`/`) and its JSON twin (`/status.json`), read with a plain HTTP client
after real traffic through the fake upstream registry: the production app factory, and a
real proxy process with several workers. (The page in a real browser:
test_status_page_browser.py.)"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from proxy import __version__
from proxy.config import load_config
from proxy.core.activity import COUNTED_NAMES, Activity, CappedCounts, merge_snapshots
from proxy.core.activity_share import FAILURES_FILE, SnapshotShare
from proxy.tls.state import StatePaths
from proxy.web.status_page import render_status_page
from tests.conftest import AppClient
from tests.support.fake_registry import FakeRegistry
from tests.support.metrics import sample
from tests.support.mirror_paths import BASE, archive_path
from tests.support.page_reader import PageReader
from tests.support.proxy_process import ProxyProcess, free_port

TOKEN = "status-client-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NULL = "registry.terraform.io/hashicorp/null"
RANDOM = "/mirror/registry.terraform.io/hashicorp/random"


async def status(client: TestClient, headers: dict[str, str] | None = None) -> dict[str, Any]:
    response = await client.get("/status.json", headers=headers)
    assert response.status == 200, await response.text()
    assert response.content_type == "application/json"
    document: dict[str, Any] = await response.json()
    return document


def upstream(document: dict[str, Any], host: str) -> dict[str, Any]:
    found = [h for h in document["upstreams"] if h["host"] == host]
    assert len(found) == 1, document["upstreams"]
    return found[0]


async def fetch(client: TestClient, path: str) -> int:
    response = await client.get(path)
    await response.read()
    return response.status


async def test_status_counts_a_miss_a_hit_and_upstream_health(make: AppClient,
                                                              registry: FakeRegistry) -> None:
    client = await make()
    before = await status(client)
    assert before["version"] == __version__ and before["mode"] == "online"
    assert before["processes"] == 1
    quiet = upstream(before, "registry.terraform.io")
    assert quiet["configured"] and quiet["last_success"] is None and quiet["last_error"] is None
    assert (before["lookups"]["total"], before["lookups"]["hits"],
            before["lookups"]["hit_rate"]) == (0, 0, None)
    assert before["top_providers"] == [] and before["integrity_failures"] == []

    assert await fetch(client, archive_path("linux_amd64")) == 200  # a miss: fetched
    response = await client.get(archive_path("linux_amd64"))  # a hit
    zipped = await response.read()
    document = await status(client)

    assert document["top_providers"] == [{"name": NULL, "requests": 2}]
    archive = document["lookups"]["by_kind"]["archive"]
    assert (archive.get("miss"), archive.get("hit")) == (1, 1)
    lookups = document["lookups"]
    assert 0 < lookups["hits"] < lookups["total"]
    assert lookups["hit_rate"] == round(lookups["hits"] / lookups["total"], 4)
    assert document["cache"] == {"backend": "disk", "bytes": len(zipped), "files": 1,
                                 "max_bytes": None, "used_fraction": None,
                                 "store": {"reachable": True, "problem": None}}
    assert document["fills_in_flight"] == 0
    healthy = upstream(document, "registry.terraform.io")
    assert healthy["last_success"] is not None and healthy["requests_ok"] >= 4
    assert healthy["last_error"] is None and healthy["requests_failed"] == 0

    registry.faults.add("down")  # a provider the cache does not hold, upstream answering 503
    assert await fetch(client, f"{RANDOM}/index.json") == 502
    failed = upstream(await status(client), "registry.terraform.io")
    assert failed["requests_failed"] >= 1 and failed["last_error"] is not None
    assert "answered 503" in failed["last_error_reason"]
    assert failed["last_success"] == healthy["last_success"]


async def test_stale_answers_are_counted_per_host(make: AppClient,
                                                  registry: FakeRegistry) -> None:
    client = await make(upstream_versions_ttl="0.2")
    assert await fetch(client, f"{BASE}/index.json") == 200
    registry.faults.add("down")
    await asyncio.sleep(0.3)  # the copy has expired: upstream is asked again, and fails
    deadline = time.monotonic() + 10
    while True:
        assert await fetch(client, f"{BASE}/index.json") == 200  # the old copy
        stale = upstream(await status(client), "registry.terraform.io")["stale_answers"]
        if stale or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.1)
    assert stale >= 1
    await asyncio.sleep(0.5)  # a refresh the last request started has ended
    stale = upstream(await status(client), "registry.terraform.io")["stale_answers"]
    metrics = await (await client.get("/metrics")).text()
    assert stale == sample(metrics, "tfproxy_cache_lookups_total", kind="versions",
                           result="stale")


async def test_integrity_failures_are_listed_newest_first_with_their_reason(
        make: AppClient, registry: FakeRegistry) -> None:
    client = await make()
    registry.faults.add("corrupt")
    response = await client.get(archive_path("linux_amd64"))
    with pytest.raises(aiohttp.ClientPayloadError):  # cut: the sha256 did not match
        await response.read()
    registry.faults.clear()
    registry.faults.add("badsig")
    # One platform's archive: a VERSION.json checks each platform, and platforms filled
    # apart may each meet the bad signature (each is listed and counted).
    assert await fetch(client,
                       f"{RANDOM}/terraform-provider-random_3.6.0_linux_amd64.zip") == 502
    failures = (await status(client))["integrity_failures"]

    assert [(f["kind"], f["artifact"]) for f in failures] == [
        ("signature", "registry.terraform.io/hashicorp/random 3.6.0 SHA256SUMS"),
        ("checksum", f"{NULL} 3.2.1 linux_amd64"),
    ]
    assert "does not verify" in failures[0]["reason"]
    assert "does not match" in failures[1]["reason"]
    assert failures[0]["time"] >= failures[1]["time"]
    metrics = await (await client.get("/metrics")).text()
    assert sample(metrics, "tfproxy_integrity_failures_total", kind="checksum") == 1
    assert sample(metrics, "tfproxy_integrity_failures_total", kind="signature") == 1
    page = PageReader(await (await client.get("/")).text())
    assert [row[1:3] for row in page.body_rows("integrity")] == [
        ["registry.terraform.io/hashicorp/random 3.6.0 SHA256SUMS", "signature"],
        [f"{NULL} 3.2.1 linux_amd64", "checksum"]]


async def test_offline_mode_shows_and_contacts_nobody(make: AppClient,
                                                      registry: FakeRegistry) -> None:
    client = await make(upstream_mode="offline")
    assert await fetch(client, archive_path("linux_amd64")) == 404
    document = await status(client)
    assert document["mode"] == "offline"
    host = upstream(document, "registry.terraform.io")
    assert (host["last_success"], host["last_error"], host["requests_ok"],
            host["requests_failed"]) == (None, None, 0, 0)
    assert document["top_providers"] == []
    page = PageReader(await (await client.get("/")).text())
    assert page.texts["mode"] == "offline"
    assert "Offline: upstream is never contacted." in page.texts["upstreams"]
    assert registry.requests == []


async def test_status_needs_the_token_when_clients_authenticate(
        make: AppClient, registry: FakeRegistry) -> None:
    client = await make(extra=f'[auth]\ntokens = ["{TOKEN}"]\n')
    for path in ("/", "/status.json"):
        refused = await client.get(path)
        assert refused.status == 401, path
        assert (await refused.json())["errors"]
        assert (await client.get(path, headers={"Authorization": "Bearer wrong-token-123"})
                ).status == 401
    assert (await status(client, AUTH))["mode"] == "online"
    page = await client.get("/", headers=AUTH)
    assert page.status == 200 and page.content_type == "text/html"
    assert "default-src 'none'" in page.headers["Content-Security-Policy"]
    assert PageReader(await page.text()).texts["mode"] == "online"


async def test_a_browser_gives_the_token_as_a_basic_password(
        make: AppClient, registry: FakeRegistry) -> None:
    # A browser cannot send a bearer token; challenged with Basic it asks for a password.
    client = await make(extra=f'[auth]\ntokens = ["{TOKEN}"]\n')
    refused = await client.get("/")
    challenges = refused.headers.getall("WWW-Authenticate")
    assert any(c.startswith("Basic ") for c in challenges), challenges

    def basic(password: str) -> dict[str, str]:
        pair = base64.b64encode(f"anyone:{password}".encode()).decode()
        return {"Authorization": f"Basic {pair}"}

    for path in ("/", "/status.json"):
        assert (await client.get(path, headers=basic(TOKEN))).status == 200, path
        assert (await client.get(path, headers=basic("wrong-token-123"))).status == 401
    # Only the pages for people: Terraform's routes still take bearer tokens alone.
    mirror = await client.get("/mirror/registry.terraform.io/hashicorp/null/index.json",
                              headers=basic(TOKEN))
    assert mirror.status == 401
    assert not any(c.startswith("Basic ")
                   for c in mirror.headers.getall("WWW-Authenticate"))


async def test_no_secret_on_the_page_or_in_the_json(make: AppClient, registry: FakeRegistry,
                                                    write_config: Callable[..., Path]) -> None:
    url_secret, upstream_token = "url-password-0123456789", "upstream-token-0123456789"
    extra = f"""
[upstream.hosts."other.example.com"]
token = "{upstream_token}"
[upstream.hosts."private.example.com".services]
"providers.v1" = "https://svc-user:{url_secret}@127.0.0.1:{registry.port}/v1/providers/"
[auth]
tokens = ["{TOKEN}"]
"""
    client = await make(extra=extra)
    private = "/mirror/private.example.com/hashicorp/null/index.json"
    assert (await client.get(private, headers=AUTH)).status == 200
    registry.faults.add("down")
    assert (await client.get("/mirror/private.example.com/hashicorp/random/index.json",
                             headers=AUTH)).status == 502
    json_text = await (await client.get("/status.json", headers=AUTH)).text()
    page = await (await client.get("/", headers=AUTH)).text()
    config = load_config(write_config(extra=extra), environ={})
    key = StatePaths(config.server.state_dir).signing_key.read_bytes()
    for shown in (json_text, page):
        assert "private.example.com" in shown  # the host is there, its secrets are not
        for secret in (url_secret, upstream_token, TOKEN, "svc-user", key.hex(),
                       base64.b64encode(key).decode()):
            assert secret not in shown
    host = upstream(await status(client, AUTH), "private.example.com")
    assert host["requests_ok"] >= 1 and "answered 503" in host["last_error_reason"]


def test_recorded_reasons_are_masked() -> None:
    activity = Activity()
    activity.upstream_failed("h.example", "GET https://user:pw-secret@h.example/x?token=tk-secret"
                             " failed; Authorization: Bearer abcdef123456")
    activity.integrity_failure("a", "checksum", "see https://u:zz-secret@h.example/y")
    text = str(activity.snapshot())
    for secret in ("pw-secret", "tk-secret", "abcdef123456", "zz-secret"):
        assert secret not in text


def test_hostile_names_and_reasons_stay_text() -> None:
    hostile = '<script>document.title="pwned"</script><img src=x onerror=alert(1)>"\'&'
    activity = Activity()
    activity.pulled("provider", hostile, "1.0.0", "hit", hostile)
    activity.pulled("module", hostile, "1.0.0", "miss", None)
    activity.upstream_failed(hostile, hostile)
    activity.integrity_failure(hostile, hostile, hostile)
    merged = merge_snapshots([activity.snapshot()])
    host = merged["hosts"][hostile]
    document = {
        "version": hostile, "generated_at": hostile, "mode": hostile, "processes": hostile,
        "counting_since": hostile,
        "upstreams": [{"host": hostile, "configured": False, "last_success": hostile,
                       "last_error": hostile, "last_error_reason": host.last_error_reason,
                       "requests_ok": 1, "requests_failed": 1, "stale_answers": 0}],
        "cache": {"backend": hostile, "bytes": 5, "files": hostile, "max_bytes": 10,
                  "used_fraction": 0.5},
        "lookups": {"total": hostile, "hits": hostile, "hit_rate": None, "by_kind": {}},
        "fills_in_flight": hostile,
        "integrity_failures": merged["integrity_failures"],
        "top_providers": [{"name": n, "requests": c} for n, c in merged["requested"]["provider"]],
        "top_modules": [{"name": n, "requests": c} for n, c in merged["requested"]["module"]],
        "pulls": {"total": 2, "hits": 1, "hit_rate": 0.5},
        "recent_pulls": merged["recent_pulls"],
        "clients": [{"client": hostile, "pulls": 1, "last_pull": hostile}],
    }
    page = render_status_page(document)
    reader = PageReader(page)
    assert "script" not in reader.tags and "img" not in reader.tags
    assert reader.tags.count("style") == 1
    assert reader.body_rows("top-providers") == [[hostile, "1"]]
    assert [row[2:] for row in reader.body_rows("recent-pulls")] == [
        [f"{hostile} 1.0.0", "miss", "—"], [f"{hostile} 1.0.0", "hit", hostile]]
    assert reader.body_rows("clients") == [[hostile, "1", hostile]]
    assert reader.body_rows("integrity")[0][1:] == [hostile, hostile[:40], hostile]
    assert reader.texts["mode"] == hostile


def test_request_counts_stay_bounded_and_keep_the_most_requested() -> None:
    counts = CappedCounts()
    for _ in range(50):
        counts.add("popular")
    for index in range(COUNTED_NAMES * 5):
        counts.add(f"once-{index}")
    assert len(counts) <= COUNTED_NAMES
    assert next(iter(counts.top(1).items())) == ("popular", 50)


def test_snapshots_merge_across_processes(tmp_path: Path) -> None:
    first, second = Activity(), Activity()
    first.upstream_succeeded("h")
    second.upstream_failed("h", "down")
    second.stale_answer("h")
    for _ in range(3):
        first.pulled("provider", "a/b/c", "1.0.0", "hit", None)
    second.pulled("provider", "a/b/c", "1.0.0", "hit", None)
    second.pulled("provider", "x/y/z", "1.0.0", "miss", None)
    first.integrity_failure("old", "checksum", "r1")
    time.sleep(0.01)
    second.integrity_failure("new", "signature", "r2")
    SnapshotShare(tmp_path, pid=1).write({**first.snapshot(), "fills_in_flight": 1})
    SnapshotShare(tmp_path, pid=2).write({**second.snapshot(), "fills_in_flight": 2})
    (tmp_path / "3.json").write_text("{not json")  # a damaged one is skipped
    others = SnapshotShare(tmp_path, pid=3).others()
    assert len(others) == 2
    merged = merge_snapshots(others)
    host = merged["hosts"]["h"]
    assert (host.succeeded, host.failed, host.stale_answers) == (1, 1, 1)
    assert host.last_success is not None and host.last_error_reason == "down"
    assert merged["requested"]["provider"] == [("a/b/c", 4), ("x/y/z", 1)]
    assert [f["artifact"] for f in merged["integrity_failures"]] == ["new", "old"]
    assert merged["fills_in_flight"] == 3
    assert SnapshotShare(tmp_path, pid=1).others()[0]["fills_in_flight"] == 2  # not its own


def test_commands_share_their_failures_bounded_newest_first_a_damaged_file_skipped(
        tmp_path: Path) -> None:
    share = SnapshotShare(tmp_path, pid=1)
    (tmp_path / FAILURES_FILE).write_text("[{not json")
    assert share.command_failures() == []
    activity = Activity()
    for number in range(5):
        activity.integrity_failure(f"a{number}", "stored", "r")
        time.sleep(0.002)
    share.add_failures(activity.snapshot()["integrity_failures"], keep=4)  # starts afresh
    later = Activity()
    later.integrity_failure("b", "stored", "r")
    (tmp_path / FAILURES_FILE).write_text(json.dumps(
        [*json.loads((tmp_path / FAILURES_FILE).read_text()), {"artifact": 1}]))
    SnapshotShare(tmp_path, pid=2).add_failures(later.snapshot()["integrity_failures"], keep=4)
    assert [f["artifact"] for f in share.command_failures()] == ["b", "a4", "a3", "a2"]
    # Not a process's snapshot: never taken for one, nor deleted as a dead process's.
    assert share.others() == []
    old = time.time() - 3600
    os.utime(tmp_path / FAILURES_FILE, (old, old))
    share.others()
    assert len(share.command_failures()) == 4


def test_every_worker_process_is_counted(tmp_path: Path, registry: FakeRegistry,
                                         write_config: Callable[..., Path]) -> None:
    port = free_port()
    cache = tmp_path / "cache"
    config = write_config(port=port, cache_dir=cache)
    requests = 8
    with ProxyProcess(config, cache, port, tmp_path / "proxy.log",
                      env={"TF_REGISTRY_PROXY_SERVER_WORKERS": "2"}) as proxy:
        for _ in range(requests):  # each on a new connection: the kernel spreads them
            proxy.get(archive_path("linux_amd64"))
        deadline = time.monotonic() + 20
        while True:  # every worker writes its snapshot every 2 s
            document = json.loads(proxy.get("/status.json"))
            served = document["top_providers"]
            if (document["processes"] == 2 and served
                    and served[0]["requests"] == requests) or time.monotonic() > deadline:
                break
            time.sleep(0.3)
    assert document["processes"] == 2
    assert served == [{"name": NULL, "requests": requests}]
    archive = document["lookups"]["by_kind"]["archive"]
    assert archive.get("hit", 0) + archive.get("miss", 0) == requests
    assert not list((cache / "status").glob("*.json"))  # withdrawn at shutdown


async def test_metrics_say_whether_the_instance_is_offline(make: AppClient) -> None:
    # For alerts that read only Prometheus: an offline instance's misses are not failures.
    for mode, expected in (("offline", 1), ("online", 0)):
        client = await make(upstream_mode=mode)
        text = await (await client.get("/metrics")).text()
        assert sample(text, "tfproxy_upstream_offline") == expected, mode


MODULE = "registry.terraform.io/acme/tarball/aws"
MODULE_ARCHIVE = f"/modules/{MODULE}/1.0.0/tarball-aws-1.0.0.tar.gz"


async def test_a_head_and_its_get_are_one_pull_and_a_first_install_is_all_misses(
        make: AppClient, tmp_path: Path) -> None:
    """As Terraform asks for a module archive: HEAD (it waits for the fill), then GET. One
    init is one request per artifact, and a first install on an empty cache a 0% hit rate."""
    audit = tmp_path / "audit.log"
    client = await make(server_audit_log=str(audit))
    for _ in range(2):  # two inits
        for method in ("HEAD", "GET"):
            response = await client.request(method, MODULE_ARCHIVE)
            assert response.status == 200
            await response.read()  # counted once the answer is whole
        if _ == 0:
            first = await status(client)
            assert first["top_modules"] == [{"name": MODULE, "requests": 1}]
            assert first["pulls"] == {"total": 1, "hits": 0, "hit_rate": 0.0}
    document = await status(client)
    assert document["top_modules"] == [{"name": MODULE, "requests": 2}]
    assert document["pulls"] == {"total": 2, "hits": 1, "hit_rate": 0.5}
    assert [(p["artifact"], p["cache"]) for p in document["recent_pulls"]] == [
        (f"{MODULE} 1.0.0", "hit"), (f"{MODULE} 1.0.0", "miss")]
    [client_row] = document["clients"]  # the audit log is on: who pulled is named
    assert client_row["pulls"] == 2 and client_row["client"].startswith("127.0.0.1")


async def test_without_the_audit_log_pulls_name_no_client(make: AppClient) -> None:
    client = await make()
    response = await client.get(archive_path("linux_amd64"))
    assert response.status == 200
    await response.read()  # counted once the answer is whole
    document = await status(client)
    assert [p["client"] for p in document["recent_pulls"]] == [None]
    assert document["clients"] is None
    page = PageReader(await (await client.get("/")).text())
    assert "clients" not in page.texts and page.body_rows("recent-pulls")[0][3] == "miss"


async def test_the_inventory_lists_what_cache_list_lists_searched_and_paged(
        make: AppClient, write_config: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
        ) -> None:
    client = await make()
    for path in (archive_path("linux_amd64"), archive_path("darwin_arm64"), MODULE_ARCHIVE):
        response = await client.get(path)
        assert response.status == 200
        await response.read()
    listed = json.loads(cache_list(write_config()))
    inventory = await (await client.get("/status/cache.json")).json()
    assert [(e["kind"], e["address"], e["version"], e["platforms"]) for e in
            inventory["entries"]] == [
        ("provider", NULL, "3.2.1", sorted(p["platform"] for p in listed["providers"])),
        ("module", MODULE, "1.0.0", [])]
    assert sum(e["bytes"] for e in inventory["entries"]) == listed["total_bytes"]
    assert all(e["last_used"] for e in inventory["entries"])
    searched = await (await client.get("/status/cache.json?q=ACME")).json()
    assert [e["address"] for e in searched["entries"]] == [MODULE]
    monkeypatch.setattr("proxy.protocols.inventory.PAGE_SIZE", 1)
    monkeypatch.setattr("proxy.protocols.inventory.HELD_SECONDS", 0.0)
    second = await (await client.get("/status/cache.json?page=2")).json()
    assert (second["page"], second["pages"], [e["address"] for e in second["entries"]]) == \
        (2, 2, [MODULE])
    page = PageReader(await (await client.get("/status/cache?q=%3Cscript%3E&page=x")).text())
    assert "script" not in page.tags  # the query is shown, escaped
    assert page.body_rows("held") == []


def cache_list(config: Path) -> str:
    """`cache list --json` over the same cache directory."""
    done = subprocess.run([sys.executable, "-m", "proxy", "cache", "list", "--json",
                           "--config", str(config)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "TF_REGISTRY_PROXY_CONFIG": ""})
    assert done.returncode == 0, done.stderr
    return done.stdout
