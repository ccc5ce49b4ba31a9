"""SingleFlight: one run per key, detached from callers, failures not remembered."""

from __future__ import annotations

import asyncio

import pytest

from proxy.core.singleflight import SingleFlight


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
