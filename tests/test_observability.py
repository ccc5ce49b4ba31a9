"""Health, readiness, access logs and metrics as operators see them."""

from __future__ import annotations

import json
import logging
import shutil
import ssl
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, make_mocked_request

from proxy.config import Config
from proxy.web.access_log import (
    CACHE_RESULT_KEY,
    JsonAccessLogger,
    PlainAccessLogger,
    mask_secrets,
)
from tests.support.fake_registry import FakeRegistry
from tests.support.metrics import sample
from tests.support.mirror_paths import BASE, ZIP
from tests.support.proxy_process import ProxyProcess, free_port
from tests.support.tools import prometheus_tool


async def test_readyz_is_ready_with_a_writable_cache(client: TestClient) -> None:
    response = await client.get("/readyz")
    assert response.status == 200
    assert await response.json() == {"status": "ready"}


async def test_readyz_fails_when_the_cache_takes_no_writes(client: TestClient,
                                                            proxy_config: Config) -> None:
    own = next(p for p in (proxy_config.cache.dir / "tmp").iterdir() if p.name.startswith("p"))
    shutil.rmtree(own)
    own.write_text("not a directory")  # unwritable even for root
    response = await client.get("/readyz")
    assert response.status == 503
    assert "not writable" in (await response.json())["errors"][0]


@pytest.mark.parametrize(("given", "masked"), [
    ("/a.zip?exp=1&sig=abcdef", "/a.zip?exp=1&sig=***"),
    ("/a?X-Amz-Signature=zzz&X-Amz-Credential=c&ok=1",
     "/a?X-Amz-Signature=***&X-Amz-Credential=***&ok=1"),
    ("/a?token=t", "/a?token=***"),
    ("/plain/path", "/plain/path"),
])
def test_access_log_masks_credentials(given: str, masked: str) -> None:
    assert mask_secrets(given) == masked


def test_access_log_lines_are_json_or_plain_with_masked_queries(
        caplog: pytest.LogCaptureFixture) -> None:
    request = make_mocked_request("GET", "/mirror/x/y/z/a.zip?sig=secret")
    request[CACHE_RESULT_KEY] = "hit"
    response = web.Response(body=b"12345")
    caplog.set_level(logging.INFO, logger="proxy.access")
    JsonAccessLogger(logging.getLogger("proxy.access"), "").log(request, response, 0.0123)
    PlainAccessLogger(logging.getLogger("proxy.access"), "").log(request, response, 0.0123)
    first = json.loads(caplog.records[0].getMessage())
    assert first["path"] == "/mirror/x/y/z/a.zip?sig=***"
    assert (first["method"], first["status"], first["cache"]) == ("GET", 200, "hit")
    assert first["duration_ms"] == 12.3
    plain = caplog.records[1].getMessage()
    assert '"GET /mirror/x/y/z/a.zip?sig=***" 200' in plain and "cache=hit" in plain
    assert "secret" not in caplog.text


async def test_metrics_move_and_pass_promtool(client: TestClient,
                                              registry: FakeRegistry) -> None:
    await (await client.get(f"{BASE}/{ZIP}")).read()     # miss: fill
    await (await client.get(f"{BASE}/{ZIP}")).read()     # hit
    registry.faults.add("badsig")
    await client.get("/mirror/registry.terraform.io/hashicorp/random/3.6.0.json")
    registry.faults.clear()
    text = await (await client.get("/metrics")).text()
    size = len(registry.releases[("hashicorp", "null", "3.2.1")].zips["linux_amd64"])
    assert sample(text, "tfproxy_served_bytes_total", kind="package") == 2 * size
    assert sample(text, "tfproxy_cache_lookups_total", kind="archive", result="hit") == 1
    assert sample(text, "tfproxy_cache_lookups_total", kind="archive", result="miss") == 1
    bad_signatures = sample(text, "tfproxy_integrity_failures_total", kind="signature")
    assert bad_signatures is not None and bad_signatures >= 1, text
    upstream_ok = sample(text, "tfproxy_upstream_requests_total", host="registry.terraform.io",
                         outcome="ok")
    assert upstream_ok is not None and upstream_ok > 0, text
    assert sample(text, "tfproxy_cache_files") == 1
    assert sample(text, "tfproxy_cache_size_bytes") == size
    assert sample(text, "tfproxy_upstream_fetched_bytes_total", kind="package") == size
    # Labels stay bounded: no version, provider, os or arch anywhere.
    for forbidden in ("3.2.1", "hashicorp", "linux", "amd64", "null"):
        assert forbidden not in text
    promtool = prometheus_tool("promtool")
    checked = subprocess.run([promtool, "check", "metrics"], input=text, text=True,
                             capture_output=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_access_log_says_miss_for_an_answer_that_waited_for_upstream(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    """Terraform's HEAD of a module archive waits for the clone and gets the stored file:
    a miss, not a hit; the GET after it, and every later HEAD, is a hit."""
    port, cache = free_port(), tmp_path / "cache"
    archive = "/modules/registry.terraform.io/acme/tarball/aws/1.0.0/tarball-aws-1.0.0.tar.gz"
    with ProxyProcess(write_config(cache_dir=cache, port=port), cache, port,
                      tmp_path / "proxy.log") as proxy:
        context = ssl.create_default_context(cafile=str(proxy.ca_file))
        for method in ("HEAD", "GET", "HEAD"):
            request = urllib.request.Request(proxy.url + archive.lstrip("/"), method=method)
            with urllib.request.urlopen(request, context=context, timeout=30) as answer:
                assert answer.status == 200
    lines = [line for line in proxy.log.read_text().splitlines()
             if "tarball-aws-1.0.0.tar.gz" in line and "cache=" in line]
    assert [line.split("cache=")[1].split()[0] for line in lines] == ["miss", "hit", "hit"]
