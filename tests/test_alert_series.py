"""The series alerts read exist from the start, at 0, for every label value: a real Prometheus
running the shipped rules sees the first integrity failure, and the rules' promtool tests use
only series shapes the proxy emits."""

from __future__ import annotations

import http.client
import re
from collections.abc import Callable
from pathlib import Path

import yaml
from aiohttp.test_utils import TestClient

from proxy.core.errors import INTEGRITY_KINDS
from tests.support.fake_registry import FakeRegistry
from tests.support.metrics import declared, sample
from tests.support.mirror_paths import archive_path
from tests.support.prometheus import OPS, Prometheus, alert_expression
from tests.support.proxy_process import ProxyProcess, free_port

_SERIES = re.compile(r"^(\w+)\{(.*)\}$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


async def test_promtool_series_have_the_shapes_the_exporter_emits(client: TestClient) -> None:
    """A counter given as starting at 0 must be at 0 on a fresh proxy's /metrics (same name,
    same labels; the scrape adds job and instance); one that starts absent ("_") must at
    least be declared."""
    text = await (await client.get("/metrics")).text()
    tests = yaml.safe_load((OPS / "prometheus-alerts.test.yml").read_text())["tests"]
    checked = 0
    for series in (s for test in tests for s in test["input_series"]):
        match = _SERIES.match(series["series"])
        assert match, series
        name = match.group(1)
        labels = {k: v for k, v in _LABEL.findall(match.group(2)) if k not in ("job", "instance")}
        first = str(series["values"]).split()[0]
        if first.startswith("_"):
            assert declared(text, name), name
            continue
        found = sample(text, name, **labels)
        assert found is not None, f"{series['series']} is not on a fresh proxy's /metrics"
        if name.endswith("_total"):
            assert re.match(r"0(\+|x|$)", first), f"{series['series']} starts at {first}"
            assert found == 0, series["series"]
        checked += 1
    assert checked >= 10


async def test_every_label_value_alerts_read_starts_at_zero(client: TestClient) -> None:
    text = await (await client.get("/metrics")).text()
    for kind in INTEGRITY_KINDS:
        assert sample(text, "tfproxy_integrity_failures_total", kind=kind) == 0, kind
    for route in ("mirror", "module"):
        for reason in ("integrity", "upstream", "io", "internal"):
            assert sample(text, "tfproxy_aborted_responses_total", route=route,
                          reason=reason) == 0
    for disk_kind in ("package", "module", "index"):
        assert sample(text, "tfproxy_cache_disk_full_total", kind=disk_kind) == 0
    for documents in ("versions", "module_versions"):
        assert sample(text, "tfproxy_cache_lookups_total", kind=documents, result="stale") == 0
    for outcome in ("ok", "client_error", "server_error", "error", "timeout"):
        assert sample(text, "tfproxy_upstream_requests_total", host="registry.terraform.io",
                      outcome=outcome) == 0
    assert sample(text, "tfproxy_connection_limit_waits_total") == 0


def test_the_integrity_alert_fires_on_the_first_failure(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    """One corrupted download, and the shipped alert's own expression, evaluated by a real
    Prometheus that scraped the proxy before it, is above 0 for kind=checksum."""
    port, cache = free_port(), tmp_path / "cache"
    proxy = ProxyProcess(write_config(cache_dir=cache, port=port), cache, port,
                         tmp_path / "proxy.log")
    with proxy, Prometheus(tmp_path / "prometheus", port, proxy.ca_file) as prometheus:
        prometheus.wait_for_scrapes(3)  # the counters' 0 is recorded
        registry.faults.add("corrupt")
        try:
            proxy.get(archive_path("linux_amd64"))
            raise AssertionError("a corrupted package was served")
        except (OSError, http.client.HTTPException):
            pass  # a 502, or a connection cut mid-body
        expression = alert_expression("TfProxyIntegrityFailures")
        fired = prometheus.wait_for(expression, timeout=30)
        assert [r["metric"]["kind"] for r in fired] == ["checksum"]
        assert float(fired[0]["value"][1]) > 0
        alerts = prometheus.wait_for('ALERTS{alertname="TfProxyIntegrityFailures"}')
        assert alerts[0]["metric"]["severity"] == "critical"
