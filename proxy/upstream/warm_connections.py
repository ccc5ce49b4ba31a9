"""Connections to upstream opened ahead of a download a client is about to ask for.

Terraform and OpenTofu read a package's document (VERSION.json, a download document), then
ask for its zip on a new connection, which any of the proxy's workers may accept. On a cold
package that worker fetches the zip from upstream at once: if it holds no connection to the
download's host, the client's first byte waits for one (TCP and TLS: two round trips, tens of
milliseconds to a registry across the internet). So when a worker fetches a package's
download document (to answer either), it opens a connection to the download's host, unless
it holds one, and tells its siblings to do the same (proxy.core.siblings). Nothing is
requested on it: it waits in the pool for the zip's request, and closes after the pool's
keep-alive if none comes. Each process warms an origin at most once per WARM_EVERY seconds;
offline, through an outbound proxy, or where the egress policy refuses the host, nothing is
opened."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict

from prometheus_client import Counter

from proxy.core.errors import ProxyError
from proxy.core.held import keep_recent
from proxy.core.siblings import Siblings
from proxy.upstream.http import UpstreamHTTP, origin_of

log = logging.getLogger(__name__)

WARM_EVERY = 10.0  # seconds
# The kind of sibling message that names an origin to warm.
CONNECT = "connect"
_MOST_ORIGINS = 256  # origins remembered (the oldest forgotten first)


class ConnectionWarmer:
    """Warms connections for expected downloads, here and in the sibling workers."""

    def __init__(self, http: UpstreamHTTP, siblings: Siblings, warmed: Counter) -> None:
        self._http = http
        self._counted = warmed  # by outcome
        self._siblings = siblings
        # origin -> monotonic time of its last warming
        self._warmed: OrderedDict[str, float] = OrderedDict()
        self._tasks: set[asyncio.Task[None]] = set()

    def expect(self, origin: str) -> None:
        """A client is about to download from origin (https://host[:port], as origin_of
        gives it) through this proxy: warm it here and in the siblings."""
        try:  # a hint: nothing of it may fail the request that gave it
            if self._due(origin):
                self._siblings.tell(CONNECT, origin)
                self._start(origin)
        except Exception:
            log.debug("no connection warmed for %r", origin, exc_info=True)

    def listen(self) -> None:
        """Warm the origins the siblings name (on the running loop)."""
        self._siblings.listen(self._heard)

    def _heard(self, kind: str, value: str) -> None:
        origin = origin_of(value)
        if kind == CONNECT and origin == value and self._due(origin):
            self._start(origin)

    def _due(self, origin: str) -> bool:
        now = time.monotonic()
        last = self._warmed.get(origin)
        if last is not None and now - last < WARM_EVERY:
            return False
        keep_recent(self._warmed, origin, now, _MOST_ORIGINS)
        return True

    def _start(self, origin: str) -> None:
        task = asyncio.ensure_future(self._warm(origin))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _warm(self, origin: str) -> None:
        try:
            if await self._http.warm_connection(origin):
                self._counted.labels("opened").inc()
                log.debug("opened a connection to %s ahead of a download", origin)
        except asyncio.CancelledError:
            raise
        except ProxyError as exc:  # refused by the egress policy
            self._counted.labels("failed").inc()
            log.debug("no connection to %s ahead of a download: %s", origin, exc.message)
        except Exception as exc:  # unreachable now: the download will say so, if it comes
            self._counted.labels("failed").inc()
            log.debug("no connection to %s ahead of a download: %r", origin, exc)

    async def close(self) -> None:
        """Stop listening and abandon warmings under way."""
        self._siblings.stop()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

