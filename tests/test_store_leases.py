"""Fill locks across replicas, and the index leases (proxy.store.leases) that a store with no
locks of its own fills under: run over every backend's index, with replicas that share one
store through index objects of their own (disk: second instances on the same directory)."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from proxy.core.errors import Unavailable
from proxy.store.index import MetadataCache
from proxy.store.leases import FillLeases, IndexLease, LeaseTimings, lease_key
from proxy.store.protocol import BlobStore
from proxy.store.s3 import S3BlobStore
from proxy.store.s3_index import AREA
from proxy.store.s3_objects import ObjectStore
from tests.support.controlled_index import ControlledIndex
from tests.support.seaweedfs import S3Server
from tests.support.stores import BACKENDS, OpenedStore, open_store

NAME = "registry.example/acme/thing/1.0.0/linux_amd64"
# Short enough for fast tests, long enough that a loaded machine renews in time.
FAST = LeaseTimings(seconds=0.6, first_poll=0.01, max_poll=0.05, error_patience=0.3)


@pytest.fixture(params=BACKENDS)
async def store(request: pytest.FixtureRequest, tmp_path: Path,
                monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[OpenedStore]:
    """Each backend in turn (and the replicas it opens)."""
    backend = str(request.param)
    s3 = request.getfixturevalue("s3_server") if backend == "s3" else None
    async with open_store(backend, tmp_path, monkeypatch, s3=s3) as opened:
        yield opened


@asynccontextmanager
async def replicas(store: OpenedStore, count: int) -> AsyncIterator[list[OpenedStore]]:
    """store and count - 1 more replicas of it."""
    async with AsyncExitStack() as stack:
        yield [store] + [await stack.enter_async_context(store.replica())
                         for _ in range(count - 1)]


def counting(outcomes: Counter[str]) -> Callable[[str], None]:
    return lambda outcome: outcomes.update([outcome])


async def until(condition: Callable[[], bool], within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, "not within the time allowed"
        await asyncio.sleep(0.01)


# --- the backends' fill locks --------------------------------------------------------------

async def test_a_fill_lock_admits_one_holder_among_racers_on_several_replicas(
        store: OpenedStore) -> None:
    inside: list[int] = []
    most = entered = 0

    async def fill(blobs: BlobStore, n: int) -> None:
        nonlocal most, entered
        async with blobs.fill_lock(NAME, "package") as held:
            assert held
            inside.append(n)
            most, entered = max(most, len(inside)), entered + 1
            await asyncio.sleep(0.02)
            inside.remove(n)

    async with replicas(store, 3) as views:
        await asyncio.wait_for(asyncio.gather(
            *(fill(views[n % 3].blobs, n) for n in range(6))), 30)
    assert (entered, most) == (6, 1)


async def test_a_fill_lock_waiter_stops_waiting_once_the_artifact_is_ready(
        store: OpenedStore) -> None:
    published = asyncio.Event()

    async def ready() -> bool:
        return published.is_set()

    async def enter(blobs: BlobStore) -> bool:
        async with blobs.fill_lock(NAME, "package", ready) as held:
            return held

    async with replicas(store, 2) as (first, second):
        async with first.blobs.fill_lock(NAME, "package") as held:
            assert held
            waiter = asyncio.ensure_future(enter(second.blobs))
            await asyncio.sleep(0.2)
            assert not waiter.done()
            published.set()  # while the holder still holds it: served at once
            assert await asyncio.wait_for(waiter, 3) is False
        assert await asyncio.wait_for(enter(second.blobs), 3) is True  # free: taken


# --- index leases --------------------------------------------------------------------------

async def test_a_renewed_lease_is_never_taken_over(store: OpenedStore) -> None:
    outcomes: Counter[str] = Counter()
    order: list[str] = []
    # Renewed every half second: a real S3 server on a loaded two-core CI machine once took
    # two renewals of a 0.6 s lease (0.2 s apart) past its expiry.
    steady = replace(FAST, seconds=1.5)
    async with replicas(store, 3) as views:
        leases = [FillLeases(view.index, steady, counting(outcomes)) for view in views]

        async def hold(n: int, seconds: float) -> None:
            async with leases[n].lock(NAME, "package") as held:
                assert held
                order.append(f"{n} in")
                await asyncio.sleep(seconds)
                order.append(f"{n} out")

        first = asyncio.ensure_future(hold(0, 3 * steady.seconds))  # slow, but alive
        await until(lambda: bool(order))
        await asyncio.gather(hold(1, 0), hold(2, 0), first)
    assert order[:2] == ["0 in", "0 out"]
    assert outcomes == {"acquired": 1, "waited": 2}
    assert await store.index.get(lease_key(NAME)) is None  # released


async def test_an_abandoned_lease_is_taken_over_by_exactly_one_waiter(
        store: OpenedStore) -> None:
    outcomes: Counter[str] = Counter()
    inside: list[int] = []
    most = 0
    async with replicas(store, 4) as views:
        dead_index = ControlledIndex(views[0].index)
        dead = FillLeases(dead_index, FAST).lock(NAME, "package")
        started = time.monotonic()  # the lease it writes expires FAST.seconds from here on
        assert await dead.__aenter__()
        dead_index.freeze()  # the replica is killed: no renewal, no release

        async def wait_and_fill(n: int) -> float:
            nonlocal most
            async with FillLeases(views[n].index, FAST, counting(outcomes)).lock(
                    NAME, "package") as held:
                assert held
                entered = time.monotonic() - started
                inside.append(n)
                most = max(most, len(inside))
                await asyncio.sleep(0.05)
                inside.remove(n)
                return entered

        try:
            entered = await asyncio.wait_for(
                asyncio.gather(*(wait_and_fill(n) for n in (1, 2, 3))), 10)
        finally:
            dead_index.thaw()
            await dead.__aexit__(None, None, None)
    assert min(entered) >= FAST.seconds * 0.9  # not before it expired
    assert min(entered) < FAST.seconds + 2  # and soon after
    assert outcomes == {"taken_over": 1, "waited": 2}
    assert most == 1


async def test_a_holder_that_stalled_past_its_lease_loses_it_and_cannot_release_it(
        store: OpenedStore) -> None:
    outcomes: Counter[str] = Counter()
    async with replicas(store, 3) as views:
        stalled_index = ControlledIndex(views[0].index)
        stalled = FillLeases(stalled_index, FAST, counting(outcomes)).lock(NAME, "package")
        assert await stalled.__aenter__()
        stalled_index.freeze()  # cut off from the store: its renewal hangs
        taker: IndexLease = FillLeases(views[1].index, FAST, counting(outcomes)).lock(
            NAME, "package")
        async with taker as held:
            assert held and outcomes["taken_over"] == 1
            stalled_index.thaw()  # back: its renewal finds the lease taken
            await until(lambda: stalled.lost)
            assert not stalled.held
            await stalled.__aexit__(None, None, None)  # its release must not remove it
            assert await views[2].index.get(lease_key(NAME)) is not None
            await asyncio.sleep(FAST.seconds)  # the taker still renews what it holds
            assert taker.held
            third = FillLeases(views[2].index, FAST).lock(NAME, "package")
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(third.__aenter__(), FAST.seconds / 2)
    assert outcomes == {"acquired": 1, "taken_over": 1, "lost": 1}
    assert await store.index.get(lease_key(NAME)) is None


async def test_a_lease_that_stops_changing_is_taken_over_whatever_its_expiry_says(
        store: OpenedStore) -> None:
    # A holder whose clock ran an hour ahead, then died: its expires_at alone would block
    # every fill of the artifact for an hour.
    await store.index.create(lease_key(NAME), {"owner": "gone", "holder": "elsewhere",
                                               "expires_at": time.time() + 3600})
    outcomes: Counter[str] = Counter()
    started = time.monotonic()
    lease = FillLeases(store.index, FAST, counting(outcomes)).lock(NAME, "package")
    assert await asyncio.wait_for(lease.__aenter__(), 10)
    await lease.__aexit__(None, None, None)
    assert FAST.seconds * 0.9 <= time.monotonic() - started < FAST.seconds + 2
    assert outcomes == {"taken_over": 1}


async def test_store_errors_are_retried_then_answered_with_503(store: OpenedStore) -> None:
    flaky = ControlledIndex(store.index)
    outcomes: Counter[str] = Counter()
    leases = FillLeases(flaky, FAST, counting(outcomes))
    flaky.fail(3)
    async with leases.lock(NAME, "package") as held:  # retried through
        assert held
        flaky.fail(2, {"replace"})  # two renewals fail: the next ones make it
        await asyncio.sleep(2 * FAST.seconds)
        assert flaky.failed == 5
        lease_lost = outcomes["lost"]
    assert lease_lost == 0
    assert await store.index.get(lease_key(NAME)) is None
    flaky.fail(10**6)
    with pytest.raises(Unavailable) as refused:
        async with leases.lock(NAME, "package"):
            raise AssertionError("entered without a store")
    assert refused.value.status == 503
    assert "try again" in refused.value.message


def test_racing_replaces_in_separate_processes_of_one_directory_have_one_winner(
        tmp_path: Path) -> None:
    # Threads with event loops and index instances of their own: true parallelism on one
    # SQLite file, as the processes sharing a cache directory have.
    directory = tmp_path / "index"
    setup = MetadataCache(directory)
    asyncio.run(setup.set("lease/fill", {"owner": "dead"}))
    found = asyncio.run(setup.get_versioned("lease/fill"))
    setup.close()
    assert found is not None
    won: list[str | None] = []
    start = threading.Barrier(8)

    def race(n: int) -> None:
        index = MetadataCache(directory)
        try:
            start.wait()
            won.append(asyncio.run(index.replace("lease/fill", {"owner": n}, found[1])))
        finally:
            index.close()

    threads = [threading.Thread(target=race, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert len(won) == 8 and sum(new is not None for new in won) == 1


async def test_a_waiter_on_another_replica_is_served_within_a_quarter_second_of_the_publish(
        store: OpenedStore) -> None:
    # Default timings: the poll interval is capped, however long the waiter has waited.
    published: list[float] = []

    async def ready() -> bool:
        return bool(published)

    async def wait(blobs: BlobStore) -> float:
        async with blobs.fill_lock(NAME, "package", ready) as held:
            assert not held
            return time.monotonic()

    async with replicas(store, 2) as (first, second):
        async with first.blobs.fill_lock(NAME, "package") as held:
            assert held
            waiter = asyncio.ensure_future(wait(second.blobs))
            await asyncio.sleep(2)  # long enough for any backoff to reach its cap
            published.append(time.monotonic())
            served = await asyncio.wait_for(waiter, 5)
    assert served - published[0] < 0.25 + 0.1  # the cap, plus a poll's own requests


async def test_a_lease_nobody_can_read_is_taken_over_after_its_duration(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        s3_server: S3Server) -> None:
    # Written by something else, or cut short: no owner, no expiry to read.
    for body in (b"", b'{"owner": "gone", "expi', b"[1, 2, 3]"):
        async with open_store("s3", tmp_path / uuid.uuid4().hex, monkeypatch,
                              s3=s3_server) as opened:
            assert isinstance(opened.blobs, S3BlobStore)
            objects = opened.blobs.objects
            await objects.put_bytes(AREA + lease_key(NAME), body)
            before = _requests(objects)
            outcomes: Counter[str] = Counter()
            started = time.monotonic()
            lease = FillLeases(opened.index, LeaseTimings(seconds=1.0),
                               counting(outcomes)).lock(NAME, "package")
            assert await asyncio.wait_for(lease.__aenter__(), 10)
            waited = time.monotonic() - started
            await lease.__aexit__(None, None, None)
            assert outcomes == {"taken_over": 1}, body
            assert 0.9 <= waited < 1.0 + 0.25 + 0.5, (body, waited)
            assert (_requests(objects) - before) / waited < 20, body  # polls back off


async def test_a_waiter_gives_up_with_503_when_a_holder_renews_forever(
        store: OpenedStore) -> None:
    bounded = LeaseTimings(seconds=0.6, first_poll=0.01, max_poll=0.05, max_wait=1.0)
    async with replicas(store, 2) as (first, second):
        async with FillLeases(first.index, bounded).lock(NAME, "package") as held:
            assert held
            started = time.monotonic()
            with pytest.raises(Unavailable) as refused:
                async with FillLeases(second.index, bounded).lock(NAME, "package"):
                    raise AssertionError("entered a lease that is held and renewed")
            assert 1.0 <= time.monotonic() - started < 3.0
    assert refused.value.status == 503
    assert "waited 1 s for another replica's fill" in refused.value.message


def _requests(objects: ObjectStore) -> float:
    return sum(sample.value for metric in objects._metrics.store_operations.collect()
               for sample in metric.samples if sample.name.endswith("_total"))
