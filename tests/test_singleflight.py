"""SingleFlight: one run per artifact key, detached from callers, failures not remembered,
an optional cross-process exclusive part, and a streaming hand-off to followers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from proxy.core.singleflight import Offer, SingleFlight
from proxy.core.spool import GrowingFile


async def test_concurrent_callers_share_one_run() -> None:
    flights: SingleFlight[int] = SingleFlight()
    runs = 0
    gate = asyncio.Event()

    async def work() -> int:
        nonlocal runs
        runs += 1
        await gate.wait()
        return 42

    callers = [asyncio.create_task(flights.run("k", work)) for _ in range(20)]
    await asyncio.sleep(0)
    gate.set()
    assert await asyncio.gather(*callers) == [42] * 20
    assert runs == 1
    assert len(flights) == 0


async def test_cancelled_caller_does_not_cancel_the_run() -> None:
    flights: SingleFlight[str] = SingleFlight()
    gate = asyncio.Event()

    async def work() -> str:
        await gate.wait()
        return "done"

    first = asyncio.create_task(flights.run("k", work))
    second = asyncio.create_task(flights.run("k", work))
    await asyncio.sleep(0)
    first.cancel()
    await asyncio.sleep(0)
    gate.set()
    assert await second == "done"
    with pytest.raises(asyncio.CancelledError):
        await first


async def test_failure_is_shared_then_forgotten() -> None:
    flights: SingleFlight[int] = SingleFlight()
    attempts = 0

    async def flaky() -> int:
        nonlocal attempts
        attempts += 1
        if attempts == 1:
            raise RuntimeError("boom")
        return attempts

    with pytest.raises(RuntimeError):
        await flights.run("k", flaky)
    assert await flights.run("k", flaky) == 2


async def test_a_started_run_is_joined_by_later_callers() -> None:
    flights: SingleFlight[int] = SingleFlight()
    runs = 0
    gate = asyncio.Event()

    async def work() -> int:
        nonlocal runs
        runs += 1
        await gate.wait()
        return 7

    started = flights.start("k", work)  # nobody waits for it yet (a prefetch)
    await asyncio.sleep(0)
    assert flights.start("k", work) is started
    joined = asyncio.create_task(flights.run("k", work))
    await asyncio.sleep(0)
    gate.set()
    assert await joined == 7
    assert runs == 1
    assert len(flights) == 0


async def test_cancel_all_cancels_running_flights() -> None:
    flights: SingleFlight[None] = SingleFlight()
    task = asyncio.create_task(flights.run("k", lambda: asyncio.sleep(60)))
    await asyncio.sleep(0)
    await flights.cancel_all()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_cancel_all_lets_a_run_finish_whose_offered_answer_it_accepts() -> None:
    """A shutdown lets a fill finish what is left after publishing (its h1 pass); fills that
    offered nothing, or something not accepted, are cancelled."""
    flights: SingleFlight[str] = SingleFlight()
    finished: list[str] = []

    async def fill(offer: Offer[str], offered: str | None) -> str:
        if offered is not None:
            offer(offered)
        await asyncio.sleep(0.2)
        finished.append(offered or "none")
        return "done"

    callers = [asyncio.ensure_future(flights.run_streaming(
        key, lambda offer, offered=offered: fill(offer, offered)))  # type: ignore[misc]
        for key, offered in (("published", "final"), ("growing", "spool"), ("nothing", None))]
    await asyncio.sleep(0.05)
    await flights.cancel_all(finish=lambda answer: answer == "final")
    assert finished == ["final"]
    answers = await asyncio.gather(*callers, return_exceptions=True)
    assert answers[:2] == ["final", "spool"]  # offered before the shutdown
    assert isinstance(answers[2], asyncio.CancelledError)


async def test_runs_are_keyed_by_artifact_identity() -> None:
    """Two platforms of one version are two fills; two callers of one platform share one."""
    flights: SingleFlight[str] = SingleFlight()
    started: list[str] = []
    gate = asyncio.Event()

    def fill(key: str) -> Callable[[], Awaitable[str]]:
        async def work() -> str:
            started.append(key)
            await gate.wait()
            return key
        return work

    keys = ["h/ns/t/1.0.0/linux_amd64", "h/ns/t/1.0.0/darwin_arm64", "h/ns/t/1.0.0/linux_amd64"]
    callers = [asyncio.create_task(flights.run(key, fill(key))) for key in keys]
    for _ in range(5):
        await asyncio.sleep(0)
    assert sorted(started) == sorted(set(keys))
    assert len(flights) == 2
    gate.set()
    assert await asyncio.gather(*callers) == keys


async def test_a_failure_reaches_every_waiter_and_is_not_remembered() -> None:
    flights: SingleFlight[int] = SingleFlight()
    gate = asyncio.Event()
    attempts = 0

    async def failing() -> int:
        nonlocal attempts
        attempts += 1
        await gate.wait()
        raise RuntimeError(f"attempt {attempts}")

    waiters = [asyncio.create_task(flights.run("k", failing)) for _ in range(3)]
    await asyncio.sleep(0)
    gate.set()
    results = await asyncio.gather(*waiters, return_exceptions=True)
    assert [str(r) for r in results] == ["attempt 1"] * 3
    assert len(flights) == 0
    with pytest.raises(RuntimeError, match="attempt 2"):
        await flights.run("k", failing)


async def test_exclusive_part_is_held_around_each_run_and_serializes_two_holders() -> None:
    """Two SingleFlights sharing one exclusive part stand for two processes sharing a store:
    their runs for one key take turns, and each run holds the part for its key."""
    held: list[str] = []
    locks: dict[Hashable, asyncio.Lock] = {}
    order: list[str] = []

    @asynccontextmanager
    async def exclusive(key: Hashable) -> AsyncIterator[None]:
        async with locks.setdefault(key, asyncio.Lock()):
            held.append(str(key))
            yield

    first: SingleFlight[str] = SingleFlight(exclusive=exclusive)
    second: SingleFlight[str] = SingleFlight(exclusive=exclusive)
    gate = asyncio.Event()

    def fill(name: str) -> Callable[[], Awaitable[str]]:
        async def work() -> str:
            order.append(f"{name} starts")
            await gate.wait()
            order.append(f"{name} ends")
            return name
        return work

    one = asyncio.create_task(first.run("pkg", fill("one")))
    two = asyncio.create_task(second.run("pkg", fill("two")))
    for _ in range(5):
        await asyncio.sleep(0)
    assert order == ["one starts"]  # the second holder waits for the first one's run
    gate.set()
    assert await asyncio.gather(one, two) == ["one", "two"]
    assert order == ["one starts", "one ends", "two starts", "two ends"]
    assert held == ["pkg", "pkg"]


async def test_a_cancelled_follower_does_not_cancel_a_streaming_fill(tmp_path: Path) -> None:
    flights: SingleFlight[Path | GrowingFile] = SingleFlight()
    gate = asyncio.Event()
    finished = asyncio.Event()

    async def fill(offer: Offer[Path | GrowingFile]) -> Path | GrowingFile:
        await gate.wait()
        spool = GrowingFile(tmp_path / "pkg.part", 4)
        spool.temp.write_bytes(b"")
        offer(spool)
        await asyncio.sleep(0)
        spool.temp.write_bytes(b"data")
        spool.advance(4)
        spool.complete(spool.temp)
        finished.set()
        return spool.temp

    leaving = asyncio.create_task(flights.run_streaming("k", fill))
    staying = asyncio.create_task(flights.run_streaming("k", fill))
    await asyncio.sleep(0)
    leaving.cancel()  # the first caller hangs up before the download starts
    await asyncio.sleep(0)
    gate.set()
    spool = await staying
    assert isinstance(spool, GrowingFile)
    assert b"".join([chunk async for chunk in spool.chunks()]) == b"data"
    await asyncio.wait_for(finished.wait(), 5)
    assert leaving.cancelled()


async def test_followers_read_a_streaming_fill_while_it_grows(tmp_path: Path) -> None:
    """Every caller gets the same spool as soon as the fill offers it, and reads the bytes
    written so far before the fill ends (all but the last, which waits for the verdict)."""
    flights: SingleFlight[Path | GrowingFile] = SingleFlight()
    more = asyncio.Event()
    fills = 0

    async def fill(offer: Offer[Path | GrowingFile]) -> Path | GrowingFile:
        nonlocal fills
        fills += 1
        spool = GrowingFile(tmp_path / "pkg.part", 8)
        with spool.temp.open("wb", buffering=0) as handle:
            offer(spool)
            handle.write(b"abcd")
            spool.advance(4)
            await more.wait()
            handle.write(b"efgh")
            spool.advance(4)
        spool.complete(spool.temp)
        return spool.temp

    followers = await asyncio.gather(*(flights.run_streaming("k", fill) for _ in range(3)))
    assert fills == 1
    assert all(f is followers[0] for f in followers)
    spool = followers[0]
    assert isinstance(spool, GrowingFile)
    readers = [spool.chunks() for _ in followers]
    for reader in readers:
        assert await asyncio.wait_for(reader.__anext__(), 5) == b"abc"  # "d" is held back
    more.set()
    for reader in readers:
        assert b"".join([chunk async for chunk in reader]) == b"defgh"


async def test_a_stale_hand_off_starts_a_new_run_while_the_old_one_finishes() -> None:
    """A fill still finishing after it handed out a file that has left the store since is
    not joined: the next caller gets a new run."""
    flights: SingleFlight[str] = SingleFlight()
    release = asyncio.Event()
    runs = 0

    async def fill(offer: Offer[str]) -> str:
        nonlocal runs
        runs += 1
        offer(f"file {runs}")
        await release.wait()  # e.g. the h1 pass after publishing
        return "ignored"

    assert await flights.run_streaming("k", fill, stale=lambda _v: False) == "file 1"
    assert await flights.run_streaming("k", fill, stale=lambda _v: False) == "file 1"
    assert await flights.run_streaming("k", fill, stale=lambda v: v == "file 1") == "file 2"
    assert runs == 2
    release.set()
    await asyncio.sleep(0)
    await flights.cancel_all()
    assert len(flights) == 0
