"""Held documents answered before routing. A version list or VERSION.json answer that
depends on nothing but its request path (clients do not authenticate, no version policy is
in force) is kept for a moment under that exact path, and the next GET and HEAD requests for
it are answered from here: no router, no route guard, no handler, no held-document lookups.
This is the path a warm `terraform init` and a fleet of CI runners take most.

An answer is kept at most QUICK_SECONDS (versions_ttl when shorter), and every kept answer
is dropped at once when something it was built from changes in this process (a package
verified, a version list read anew, the policy reloaded). What another process changed (a
platform another worker fetched, an import), which this process's held documents show a few
seconds later, shows here up to QUICK_SECONDS later still. Each path was checked by the
route's guard when its answer was kept: only exact paths (without a query: clients send
none) the proxy answered with 200 are ever looked up here."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import hdrs, web
from multidict import istr
from prometheus_client import Counter

from proxy.core.json_bodies import JsonBody
from proxy.core.redaction import mask_secrets

# How long an answer is kept (at most: versions_ttl when shorter).
QUICK_SECONDS = 1.0
# Paths kept at once; beyond, the table starts again empty (however many distinct paths
# clients ask for, it stays bounded).
QUICK_PATHS = 4096
_QUICK_METHODS = (hdrs.METH_GET, hdrs.METH_HEAD)

RequestHandler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


class QuickAnswer(web.Response):
    """A kept answer, with what its access line says of it computed once: the request path
    (masked) and the size of the body."""

    def __init__(self, logged_path: str, *, status: int, body: bytes | None,
                 headers: dict[istr, str]) -> None:
        super().__init__(status=status, body=body, headers=headers)
        self.logged_path = logged_path
        self.body_size = 0 if body is None else len(body)


@dataclass(frozen=True, slots=True)
class _Kept:
    document: JsonBody
    headers: dict[istr, str]  # of a 200, in aiohttp's own names: its cheapest way in
    logged_path: str
    route: str
    until: float  # time.monotonic()


class QuickAnswers:
    """The kept answers of one process, by exact request path (paths without a query)."""

    def __init__(self, requests: Counter, server_name: str, seconds: float = QUICK_SECONDS,
                 limit: int = QUICK_PATHS) -> None:
        self._requests = requests  # tfproxy_requests_total: the route guard's counts
        self._server_name = server_name
        self.seconds = seconds  # how long an answer is kept
        self._limit = limit
        self._kept: dict[str, _Kept] = {}
        self._counted: dict[tuple[str, int], Callable[[], None]] = {}

    def keep(self, request: web.Request, route: str, document: JsonBody) -> None:
        """Keep document as the answer to request's path, which route's guard let through
        and whose answer depends on nothing else."""
        path = request.raw_path
        if "?" in path:  # clients send none; made-up ones must not turn the table over
            return
        if path not in self._kept and len(self._kept) >= self._limit:
            self._kept.clear()
        headers = {hdrs.ETAG: document.etag, hdrs.CONTENT_TYPE: "application/json",
                   hdrs.SERVER: self._server_name}
        self._kept[path] = _Kept(document, headers, mask_secrets(request.path_qs), route,
                                 time.monotonic() + self.seconds)

    def clear(self) -> None:
        """Drop every kept answer (something they were built from changed)."""
        self._kept.clear()

    def answer(self, request: web.BaseRequest) -> QuickAnswer | None:
        """The kept answer to request, counted as its route's guard counts answers; None
        when there is none (or the request needs more than a kept answer)."""
        kept = self._kept.get(request.raw_path)
        if kept is None or request.method not in _QUICK_METHODS:
            return None
        if kept.until < time.monotonic():
            del self._kept[request.raw_path]
            return None
        headers = request.headers
        if hdrs.EXPECT in headers:  # the router answers what an Expect header asks
            return None
        if_none_match = headers.get(hdrs.IF_NONE_MATCH)
        if if_none_match and holds(if_none_match, kept.document.etag):
            answer = QuickAnswer(kept.logged_path, status=304, body=None,
                                 headers={hdrs.ETAG: kept.document.etag,
                                          hdrs.SERVER: self._server_name})
        else:
            answer = QuickAnswer(kept.logged_path, status=200, body=kept.document.body,
                                 headers=kept.headers.copy())
        self._count(kept.route, answer.status)
        return answer

    def before(self, handler: RequestHandler) -> RequestHandler:
        """handler (the application's), after a look at the kept answers."""

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            answer = self.answer(request)
            return answer if answer is not None else await handler(request)

        return handle

    def _count(self, route: str, status: int) -> None:
        key = (route, status // 100)
        count = self._counted.get(key)
        if count is None:
            count = self._counted[key] = self._requests.labels(route, f"{key[1]}xx").inc
        count()


def holds(if_none_match: str, etag: str) -> bool:
    """Whether If-None-Match names etag (weak comparison, as RFC 9110 13.1.2 asks)."""
    tags = [t.strip().removeprefix("W/") for t in if_none_match.split(",")]
    return "*" in tags or etag in tags
