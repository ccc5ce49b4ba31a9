"""Store operations are counted and timed on every backend (tfproxy_store_operations_total,
tfproxy_store_operation_seconds), with bounded labels: backend, operation, outcome."""

from __future__ import annotations

from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import Config
from proxy.store.memory import open_memory_storage
from tests.support.fake_registry import FakeRegistry
from tests.support.metrics import sample
from tests.support.mirror_paths import archive_path

PLATFORM = "linux_amd64"


async def _served(client: TestClient, registry: FakeRegistry) -> str:
    answer = await client.get(archive_path(PLATFORM))
    assert answer.status == 200
    assert await answer.read() == registry.releases[("hashicorp", "null", "3.2.1")].zips[PLATFORM]
    return await (await client.get("/metrics")).text()


def _count(exposition: str, backend: str, operation: str, outcome: str = "ok") -> float:
    return sample(exposition, "tfproxy_store_operations_total", backend=backend,
                  operation=operation, outcome=outcome) or 0.0


async def test_a_fill_and_a_hit_on_disk_are_counted_and_timed(
        client: TestClient, registry: FakeRegistry) -> None:
    filled = await _served(client, registry)
    assert _count(filled, "disk", "publish") == 1
    assert _count(filled, "disk", "index_set") >= 1  # the record that vouches for it
    assert _count(filled, "disk", "stat", "absent") >= 1  # the miss
    opened = _count(filled, "disk", "open")
    hit = await _served(client, registry)
    assert _count(hit, "disk", "publish") == 1  # no second fill
    assert _count(hit, "disk", "open") > opened
    assert (sample(hit, "tfproxy_store_operation_seconds_count", backend="disk",
                   operation="open") or 0) == _count(hit, "disk", "open")


async def test_the_memory_backend_is_counted_too(
        aiohttp_client, proxy_config: Config, registry: FakeRegistry) -> None:  # type: ignore[no-untyped-def]
    client: TestClient = await aiohttp_client(create_app(
        proxy_config, open_storage=open_memory_storage))
    filled = await _served(client, registry)
    assert _count(filled, "memory", "publish") == 1
    # The record that vouches for the package is saved before its last byte goes out (the
    # reads that follow, for its h1, may still be under way when the client has it all).
    assert _count(filled, "memory", "index_set") >= 1
