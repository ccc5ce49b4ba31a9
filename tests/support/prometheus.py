"""A real Prometheus server (Debian package prometheus) scraping a proxy process over HTTPS
every second, with the shipped alert rules loaded; queried through its HTTP API."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from tests.support.proxy_process import free_port
from tests.support.tools import prometheus_tool

OPS = Path(__file__).parent.parent.parent / "ops"
JOB = "tf-registry-proxy"


def alert_expression(name: str) -> str:
    """The expression of one alert of ops/prometheus-alerts.yml."""
    rules = yaml.safe_load((OPS / "prometheus-alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == name:
                return str(rule["expr"])
    raise KeyError(name)


def prometheus_config(target_port: int, ca_file: Path | None = None) -> str:
    """A Prometheus configuration: the shipped rules, evaluated and scraped every second from
    127.0.0.1:target_port (over HTTPS trusting ca_file, if given) as job tf-registry-proxy."""
    tls = f"\n    scheme: https\n    tls_config:\n      ca_file: {ca_file}" if ca_file else ""
    return f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files:
  - {OPS / 'prometheus-alerts.yml'}
scrape_configs:
  - job_name: {JOB}{tls}
    static_configs:
      - targets: ["127.0.0.1:{target_port}"]
"""


class Prometheus:
    """`prometheus` scraping https://127.0.0.1:PORT/metrics (trusting ca_file) as job
    tf-registry-proxy, its data in work."""

    def __init__(self, work: Path, target_port: int, ca_file: Path) -> None:
        binary = prometheus_tool("prometheus")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        work.mkdir(parents=True, exist_ok=True)
        config = work / "prometheus.yml"
        config.write_text(prometheus_config(target_port, ca_file))
        self._command = [binary, f"--config.file={config}", f"--storage.tsdb.path={work / 'tsdb'}",
                         f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]
        self._log = work / "prometheus.log"
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Prometheus:
        with open(self._log, "ab") as log:
            self._process = subprocess.Popen(self._command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.base}/-/ready", timeout=2) as answer:
                    if answer.status == 200:
                        return self
            except OSError:
                time.sleep(0.1)
        raise AssertionError(f"prometheus did not become ready: {self._log.read_text()[-2000:]}")

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait()

    def query(self, expression: str) -> list[dict[str, Any]]:
        """The instant vector (or scalar) the expression evaluates to now."""
        url = f"{self.base}/api/v1/query?" + urllib.parse.urlencode({"query": expression})
        try:
            with urllib.request.urlopen(url, timeout=10) as answer:
                body = json.load(answer)
        except urllib.error.HTTPError as exc:  # a bad expression: say which
            raise AssertionError(f"{expression}: {exc.read().decode()}") from None
        result = body["data"]["result"]
        if body["data"]["resultType"] == "scalar":
            return [{"metric": {}, "value": result}]
        return list(result)

    def wait_for(self, expression: str, timeout: float = 30) -> list[dict[str, Any]]:
        """The expression's result once it is not empty; fails after timeout."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.query(expression)
            if found:
                return found
            assert time.monotonic() < deadline, f"still empty after {timeout} s: {expression}"
            time.sleep(0.25)

    def wait_for_scrapes(self, count: int = 2, timeout: float = 30) -> None:
        """Until Prometheus has scraped the proxy successfully count times."""
        self.wait_for(f'sum_over_time(up{{job="{JOB}"}}[5m]) >= {count}', timeout)
