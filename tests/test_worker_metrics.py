"""/metrics of a proxy running several worker processes covers them all: every scrape, whichever
worker answers it, shows every request; the version and each worker's resources are there."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp.test_utils import TestClient

from proxy import __version__
from tests.support.fake_registry import FakeRegistry
from tests.support.metrics import sample, total
from tests.support.proxy_process import ProxyProcess, free_port

REQUESTS = 24


def served_by(log: Path) -> set[str]:
    """The workers whose access lines show a discovery request."""
    return set(re.findall(r" (w\d) proxy\.access: \S+ \"GET /\.well-known/", log.read_text()))


def test_every_scrape_counts_the_requests_of_every_worker(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    port, cache = free_port(), tmp_path / "cache"
    proxy = ProxyProcess(write_config(cache_dir=cache, port=port), cache, port,
                         tmp_path / "proxy.log", env={"TF_REGISTRY_PROXY_SERVER_WORKERS": "2"})
    with proxy:
        # Each request on a connection of its own, until both workers served some: the
        # kernel spreads connections over them once both listen.
        sent, deadline = 0, time.monotonic() + 60
        while sent < REQUESTS or served_by(proxy.log) != {"w0", "w1"}:
            assert time.monotonic() < deadline, "the requests did not reach both workers"
            proxy.get("/.well-known/terraform.json")
            sent += 1
        scrapes = [proxy.get("/metrics").decode() for _ in range(8)]
    for text in scrapes:
        assert sample(text, "tfproxy_http_requests_total", route="discovery",
                      status_class="2xx") == sent
    last = scrapes[-1]
    assert sample(last, "tfproxy_build_info", version=__version__) == 1
    for worker in ("0", "1"):  # each worker's resources, labelled
        assert sample(last, "process_resident_memory_bytes", worker=worker)
        assert sample(last, "process_cpu_seconds_total", worker=worker) is not None
    # Limits and gauges summed over the live workers; the scrape's own connection is open.
    assert sample(last, "tfproxy_max_connections") == 2 * 1000
    open_now = sample(last, "tfproxy_open_connections")
    assert open_now is not None and open_now >= 1
    assert sample(last, "tfproxy_fills_in_flight") == 0
    assert total(last, "python_info") == 1


async def test_one_process_shows_its_version_and_resources(client: TestClient) -> None:
    text = await (await client.get("/metrics")).text()
    assert sample(text, "tfproxy_build_info", version=__version__) == 1
    memory = sample(text, "process_resident_memory_bytes")
    assert memory is not None and memory > 0
    assert sample(text, "process_cpu_seconds_total") is not None
    assert total(text, "python_info") == 1
