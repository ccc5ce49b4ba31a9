"""Short messages between the worker processes of one proxy (server.workers > 1): a worker tells
the others something they can act on ahead of a request that any of them may accept.

The supervisor makes one datagram socket pair per worker before it forks them (`make`); each
worker keeps its own inbox and the others' outboxes (`join`). Best effort by design: a message
that finds an inbox full, or a worker gone, is dropped, and a message is only ever a hint (a
worker that misses one does what it would have done without it). A message is a short text
of one kind and one value; what arrives is checked like any input."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

# A message's most bytes (a kind, a space, a URL's origin); anything longer is not one.
MOST_BYTES = 512


@dataclass(frozen=True)
class Channels:
    """Every worker's inbox and outbox (index: the worker's), as the supervisor made them."""

    inboxes: tuple[socket.socket, ...]
    outboxes: tuple[socket.socket, ...]


def make(count: int) -> Channels:
    """The channels of `count` workers (in the supervisor, before it forks them)."""
    pairs = [socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM) for _ in range(count)]
    for inbox, outbox in pairs:
        inbox.setblocking(False)
        outbox.setblocking(False)
    return Channels(tuple(inbox for inbox, _ in pairs), tuple(out for _, out in pairs))


class Siblings:
    """This worker's place among its siblings: its inbox, and the others' outboxes."""

    def __init__(self, inbox: socket.socket | None = None,
                 outboxes: tuple[socket.socket, ...] = ()) -> None:
        self._inbox = inbox
        self._outboxes = outboxes

    def tell(self, kind: str, value: str) -> None:
        """Send `kind value` to every other worker; dropped where it does not fit now."""
        try:  # what a message names is ASCII (an origin: IDNA); anything else is not one
            message = f"{kind} {value}".encode("ascii")
        except UnicodeEncodeError:
            return
        if len(message) > MOST_BYTES or "\n" in value:
            return
        for outbox in self._outboxes:
            with contextlib.suppress(OSError):  # full (BlockingIOError), or that worker gone
                outbox.send(message)

    def listen(self, heard: Callable[[str, str], None]) -> None:
        """Call heard(kind, value) for each message that arrives (on the running loop)."""
        inbox = self._inbox
        if inbox is None:
            return
        loop = asyncio.get_running_loop()

        def readable() -> None:
            while True:
                try:
                    raw = inbox.recv(MOST_BYTES + 1)
                except (BlockingIOError, InterruptedError):
                    return
                except OSError as exc:
                    log.debug("sibling messages: %s", exc)
                    loop.remove_reader(inbox)
                    return
                kind, _, value = raw.decode("utf-8", "replace").partition(" ")
                if len(raw) <= MOST_BYTES and kind and value:
                    heard(kind, value)

        loop.add_reader(inbox, readable)

    def stop(self) -> None:
        """Stop listening (the loop's reader) and close this worker's sockets."""
        if self._inbox is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._inbox)
            self._inbox.close()
        for outbox in self._outboxes:
            outbox.close()
        self._inbox, self._outboxes = None, ()


_joined = Siblings()


def join(channels: Channels, index: int) -> None:
    """In worker `index` just forked: keep its inbox and the others' outboxes, close the
    rest (another's inbox, its own outbox)."""
    global _joined
    for number, (inbox, outbox) in enumerate(zip(channels.inboxes, channels.outboxes,
                                                 strict=True)):
        if number != index:
            inbox.close()
        else:
            outbox.close()
    _joined = Siblings(channels.inboxes[index],
                       tuple(out for number, out in enumerate(channels.outboxes)
                             if number != index))


def joined() -> Siblings:
    """This process's siblings (none unless it is one of several workers)."""
    return _joined
