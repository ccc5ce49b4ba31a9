"""A real Prometheus server scrapes the proxy; the series come back through its HTTP API, and
the alert rules load. Also: the rules pass promtool's checks and unit tests."""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import load_config
from tests.support.fake_registry import FakeRegistry
from tests.support.mirror_paths import BASE, ZIP
from tests.support.prometheus import prometheus_config
from tests.support.proxy_process import free_port
from tests.support.tools import prometheus_tool

OPS = Path(__file__).parent.parent / "ops"


def promtool() -> str:
    return prometheus_tool("promtool")


def test_alert_rules_pass_promtool() -> None:
    for args in (["check", "rules", "prometheus-alerts.yml"],
                 ["test", "rules", "prometheus-alerts.test.yml"]):
        result = subprocess.run([promtool(), *args], cwd=OPS, capture_output=True, text=True,
                                timeout=60)
        assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
async def prometheus(tmp_path: Path) -> AsyncIterator[Callable[[int], asyncio.Future[str]]]:
    binary = prometheus_tool("prometheus")
    port = free_port()
    processes: list[asyncio.subprocess.Process] = []

    async def start(target_port: int) -> str:
        config = tmp_path / "prometheus.yml"
        config.write_text(prometheus_config(target_port))
        process = await asyncio.create_subprocess_exec(
            binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        processes.append(process)
        base = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as session:
            for _ in range(300):
                try:
                    async with session.get(f"{base}/-/ready") as response:
                        if response.status == 200:
                            return base
                except aiohttp.ClientError:
                    pass
                await asyncio.sleep(0.1)
        raise AssertionError("prometheus did not become ready")

    yield start  # type: ignore[misc]
    for process in processes:
        process.kill()
        await process.wait()


async def query(base: str, expression: str) -> float | None:
    async with aiohttp.ClientSession() as session, \
            session.get(f"{base}/api/v1/query", params={"query": expression}) as response:
        body = await response.json()
    results = body["data"]["result"]
    return float(results[0]["value"][1]) if results else None


async def test_prometheus_scrapes_what_operators_watch(
        aiohttp_client, write_config: Callable[..., Path], registry: FakeRegistry,  # type: ignore[no-untyped-def]
        prometheus) -> None:  # type: ignore[no-untyped-def]
    config = load_config(write_config(), environ={"TF_REGISTRY_PROXY_UPSTREAM_VERSIONS_TTL":
                                                  "0.001"})
    client: TestClient = await aiohttp_client(create_app(config))
    base = await prometheus(client.port)

    await (await client.get(f"{BASE}/{ZIP}")).read()          # miss
    await (await client.get(f"{BASE}/{ZIP}")).read()          # hit
    registry.faults.add("badsig")
    await client.get("/mirror/registry.terraform.io/hashicorp/random/3.6.0.json")
    registry.faults = {"down"}
    await client.get(f"{BASE}/index.json")                    # expired: refresh fails
    await asyncio.sleep(0.2)
    await client.get(f"{BASE}/index.json")                    # stale, counted
    await client.get("/mirror/registry.terraform.io/hashicorp/nothing/index.json")  # 502

    expectations = {
        'tfproxy_cache_lookups_total{kind="archive",result="hit"}': 1,
        'tfproxy_cache_lookups_total{kind="archive",result="miss"}': 1,
        'tfproxy_cache_lookups_total{kind="versions",result="stale"}': 1,
        'tfproxy_integrity_failures_total{kind="signature"}': 1,
        'sum(tfproxy_upstream_requests_total{host="registry.terraform.io",'
        'outcome="server_error"})': 1,
        'up{job="tf-registry-proxy"}': 1,
    }
    deadline = time.monotonic() + 30
    pending = dict(expectations)
    while pending and time.monotonic() < deadline:
        for expression, least in list(pending.items()):
            value = await query(base, expression)
            if value is not None and value >= least:
                del pending[expression]
        await asyncio.sleep(0.5)
    assert not pending, f"series not seen in Prometheus: {pending}"
    async with aiohttp.ClientSession() as session, \
            session.get(f"{base}/api/v1/rules") as response:
        groups = (await response.json())["data"]["groups"]
    assert [g["name"] for g in groups] == ["tf-registry-proxy"]
    assert all(rule["health"] == "ok" for rule in groups[0]["rules"])
