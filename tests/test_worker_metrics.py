"""/metrics of a proxy running several worker processes covers them all: every scrape, whichever
worker answers it, shows every request; the version and each worker's resources are there."""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry, generate_latest

from proxy import __version__
from proxy.core.tree_memory import ProcessTreeMemory, rollup
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
    # The whole tree, supervisor included: its RSS beyond the workers'; shared pages make
    # its PSS less.
    workers_rss = sum(sample(last, "process_resident_memory_bytes", worker=worker) or 0
                      for worker in ("0", "1"))
    tree_rss = sample(last, "tfproxy_process_tree_rss_bytes")
    tree_pss = sample(last, "tfproxy_process_tree_pss_bytes")
    assert tree_rss is not None and tree_pss is not None
    assert tree_rss > workers_rss * 1.1
    assert 0 < tree_pss < tree_rss
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
    pss = sample(text, "tfproxy_process_tree_pss_bytes")
    assert pss is not None and 0 < pss <= (sample(text, "tfproxy_process_tree_rss_bytes") or 0)
    assert sample(text, "process_cpu_seconds_total") is not None
    assert total(text, "python_info") == 1


def test_the_tree_memory_sums_the_processes_it_can_read(tmp_path: Path) -> None:
    for pid, text in (("10", "Rss:  2048 kB\nPss:  1024 kB\nShared_Clean: 0 kB\n"),
                      ("11", "Rss: 4096 kB\nPss: 512 kB\n"),
                      ("12", "Rss: lots\n")):  # unreadable: left out
        (tmp_path / pid).mkdir()
        (tmp_path / pid / "smaps_rollup").write_text(text)
    assert rollup(10, tmp_path) == (1024 * 1024, 2048 * 1024)
    assert rollup(12, tmp_path) is None
    assert rollup(13, tmp_path) is None  # gone
    text = generate_latest_of(ProcessTreeMemory(lambda: [10, 11, 12, 13], tmp_path))
    assert sample(text, "tfproxy_process_tree_pss_bytes") == (1024 + 512) * 1024
    assert sample(text, "tfproxy_process_tree_rss_bytes") == (2048 + 4096) * 1024
    # Nothing readable (not Linux): no series rather than zeros.
    assert "tfproxy_process_tree" not in generate_latest_of(
        ProcessTreeMemory(lambda: [13], tmp_path))


def generate_latest_of(collector: ProcessTreeMemory) -> str:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()
