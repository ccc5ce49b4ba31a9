"""Messages between worker processes: each reaches every other worker and not its sender; a
worker keeps only its own inbox and the others' outboxes; a full inbox drops messages
rather than blocking the sender."""

from __future__ import annotations

import asyncio
import functools

from proxy.core import siblings


async def test_a_message_reaches_every_other_worker_and_not_its_sender() -> None:
    channels = siblings.make(3)
    workers = [siblings.Siblings(channels.inboxes[index],
                                 tuple(out for other, out in enumerate(channels.outboxes)
                                       if other != index)) for index in range(3)]
    heard: list[list[tuple[str, str]]] = [[], [], []]
    both = asyncio.Event()

    def hear(index: int, kind: str, value: str) -> None:
        heard[index].append((kind, value))
        if heard[1] and heard[2]:
            both.set()

    for index, worker in enumerate(workers):
        worker.listen(functools.partial(hear, index))
    try:
        workers[0].tell("connect", "https://releases.example")
        await asyncio.wait_for(both.wait(), 5)
        await asyncio.sleep(0.05)
        assert heard == [[], [("connect", "https://releases.example")],
                         [("connect", "https://releases.example")]]
    finally:
        for worker in workers:
            worker.stop()


async def test_a_full_inbox_drops_messages_without_blocking_the_sender() -> None:
    channels = siblings.make(2)
    sender = siblings.Siblings(None, (channels.outboxes[1],))
    for _ in range(10_000):  # far more than a socket buffer holds; nobody reads
        sender.tell("connect", "https://releases.example")
    receiver = siblings.Siblings(channels.inboxes[1], ())
    heard: list[str] = []
    some = asyncio.Event()

    def hear(_kind: str, value: str) -> None:
        heard.append(value)
        some.set()

    receiver.listen(hear)
    try:
        await asyncio.wait_for(some.wait(), 5)
        await asyncio.sleep(0.05)
        assert 0 < len(heard) < 10_000
    finally:
        sender.stop()
        receiver.stop()


def test_a_worker_keeps_its_inbox_and_the_others_outboxes_and_closes_the_rest() -> None:
    channels = siblings.make(3)
    siblings.join(channels, 1)
    joined = siblings.joined()
    try:
        assert [box.fileno() == -1 for box in channels.inboxes] == [True, False, True]
        assert [box.fileno() == -1 for box in channels.outboxes] == [False, True, False]
    finally:
        joined.stop()  # this process hears no one, and is heard by no one, again
    assert all(box.fileno() == -1 for box in (*channels.inboxes, *channels.outboxes))
