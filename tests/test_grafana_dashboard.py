"""ops/grafana-dashboard.json: shaped as Grafana imports it (Grafana itself is packaged neither
in Debian nor on PyPI, so no Grafana runs here), and every query it makes, run by a real
Prometheus scraping a real proxy after some traffic, finds series."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from itertools import combinations
from pathlib import Path
from typing import Any

from tests.support.fake_registry import FakeRegistry
from tests.support.mirror_paths import archive_path
from tests.support.prometheus import OPS, Prometheus
from tests.support.proxy_process import ProxyProcess, free_port

DASHBOARD = OPS / "grafana-dashboard.json"
# What Grafana puts in place of its own variables, and of ours (every job and instance).
SUBSTITUTES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m",
               "$job": ".+", "$instance": ".+"}
# What operators look at, each through at least one panel.
WATCHED = ("tfproxy_http_requests_total", "tfproxy_cache_lookups_total",
           "tfproxy_upstream_requests_total", "tfproxy_integrity_failures_total",
           "tfproxy_fills_in_flight", "tfproxy_cache_size_bytes", "tfproxy_cache_max_size_bytes",
           "tfproxy_served_bytes_total", "tfproxy_aborted_responses_total",
           "tfproxy_open_connections", "tfproxy_store_operations_total", "tfproxy_build_info")


def _dashboard() -> dict[str, Any]:
    loaded = json.loads(DASHBOARD.read_text())
    assert isinstance(loaded, dict)
    return loaded


def _queries(dashboard: dict[str, Any]) -> list[str]:
    """Every PromQL expression: the panels' targets, and the variables' label_values(...)
    series."""
    found = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            series = re.fullmatch(r"label_values\((.+), *\w+\)", variable["definition"])
            assert series, variable["definition"]
            found.append(series.group(1))
    return found


def _substituted(expression: str) -> str:
    for variable, value in SUBSTITUTES.items():
        expression = expression.replace(variable, value)
    assert "$" not in expression, f"unknown variable in {expression}"
    return expression


def test_the_dashboard_has_what_grafana_imports() -> None:
    dashboard = _dashboard()
    inputs = dashboard["__inputs"]
    assert [(i["name"], i["type"], i["pluginId"]) for i in inputs] == [
        ("DS_PROMETHEUS", "datasource", "prometheus")]
    assert dashboard["uid"] and len(dashboard["uid"]) <= 40 and dashboard["title"]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"DS_PROMETHEUS", "job", "instance"} <= names
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["type"] in ("stat", "timeseries") and panel["title"], panel
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        grid = panel["gridPos"]
        assert all(isinstance(grid[k], int) for k in ("x", "y", "w", "h")), panel["title"]
        assert grid["x"] >= 0 and grid["w"] > 0 and grid["x"] + grid["w"] <= 24, panel["title"]
        assert panel["targets"], panel["title"]
        assert len({t["refId"] for t in panel["targets"]}) == len(panel["targets"])
        assert all(t["expr"].strip() for t in panel["targets"]), panel["title"]
    for one, other in combinations(panels, 2):
        a, b = one["gridPos"], other["gridPos"]
        apart = (a["x"] + a["w"] <= b["x"] or b["x"] + b["w"] <= a["x"]
                 or a["y"] + a["h"] <= b["y"] or b["y"] + b["h"] <= a["y"])
        assert apart, (one["title"], other["title"])
    queries = " ".join(_queries(dashboard))
    for metric in WATCHED:
        assert re.search(rf"\b{metric}\b", queries), metric


def test_every_dashboard_query_finds_series(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    port, cache = free_port(), tmp_path / "cache"
    proxy = ProxyProcess(write_config(cache_dir=cache, port=port), cache, port,
                         tmp_path / "proxy.log",
                         env={"TF_REGISTRY_PROXY_SERVER_WORKERS": "2",
                              "TF_REGISTRY_PROXY_CACHE_MAX_SIZE": "1GiB"})
    with proxy, Prometheus(tmp_path / "prometheus", port, proxy.ca_file) as prometheus:
        prometheus.wait_for_scrapes(2)
        for _ in range(2):  # a miss (fetched upstream), then hits
            proxy.get(archive_path("linux_amd64"))
            proxy.get("/mirror/registry.terraform.io/hashicorp/null/index.json")
        # Rates need two samples after the traffic.
        prometheus.wait_for("count_over_time(tfproxy_served_bytes_total[1m]) >= 3")
        empty = [query for query in _queries(_dashboard())
                 if not prometheus.query(_substituted(query))]
    assert not empty, f"queries that find no series: {empty}"
