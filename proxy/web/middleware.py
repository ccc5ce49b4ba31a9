"""Around every route: JSON error bodies for every failure, and request metrics."""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable
from functools import update_wrapper
from typing import Protocol
from urllib.parse import unquote

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler
from prometheus_client import Counter

from proxy.config.settings import AuthConfig
from proxy.core.errors import BadRequest, ProxyError
from proxy.core.metrics import Metrics
from proxy.web.auth import BASIC_ROUTES, RELEASE_ROUTES, Authenticator
from proxy.web.error_warnings import ErrorWarnings
from proxy.web.responses import PREPARED_RESPONSE_KEY, abort_after_headers, error_body

log = logging.getLogger(__name__)


# What the Server header says: no library or Python versions in answers.
SERVER_NAME = "tf-registry-proxy"
# The route name, and metric label, of requests for paths no route serves.
UNMATCHED = "unmatched"


def json_error(status: int, message: str) -> web.Response:
    """The one error shape: `{"errors": ["..."]}`, secrets masked."""
    return web.Response(status=status, body=error_body(message),
                        content_type="application/json")


async def json_error_bodies(_request: web.Request, response: web.StreamResponse) -> None:
    """An on_response_prepare hook: error answers that aiohttp makes after routing but
    outside the middleware (417 for an Expect header other than 100-continue) get the JSON
    shape too."""
    if (response.status >= 400 and isinstance(response, web.Response)
            and response.content_type != "application/json"):
        body = error_body(response.reason)
        response.body = body
        response.content_type = "application/json"
        # aiohttp has already set Content-Length from the old body when the hooks run.
        response.headers[hdrs.CONTENT_LENGTH] = str(len(body))


def response_prepared(metrics: Metrics) -> Callable[[web.Request, web.StreamResponse],
                                                    Awaitable[None]]:
    """The on_response_prepare hook, one function (it runs for every response): our Server
    header; the JSON shape of errors aiohttp makes itself, counted when the request never
    reached a route (a request target with no path: `OPTIONS *`, CONNECT); the note that
    the headers are committed (PREPARED_RESPONSE_KEY)."""
    count_unrouted = _answer_counter(metrics, UNMATCHED)

    async def prepared(request: web.Request, response: web.StreamResponse) -> None:
        response.headers[hdrs.SERVER] = SERVER_NAME
        if response.status >= 400:
            await json_error_bodies(request, response)
            if request.match_info.http_exception is not None:  # aiohttp's router answered
                response.charset = None  # as json_error's answers say it
                count_unrouted(response.status)
        # A later failure of this request must not be answered with a second response.
        request[PREPARED_RESPONSE_KEY] = response

    return prepared


MAX_PATH_LENGTH = 2048
_ODD_CHARACTERS = re.compile(r"[\x00-\x1f\x7f\\]")  # control characters, backslash
_DOT_SEGMENT = re.compile(r"(?:^|/)\.\.?(?=/|$)")


def reject_odd_path(raw_path: str) -> None:
    """Refuse, before any routing, paths no client sends: too long, `.`/`..` segments
    (raw or percent-encoded), backslashes, NUL or other control characters, encoded `/`.
    Percent-decoding happens once, here and in the router; nothing decodes twice."""
    if len(raw_path) > MAX_PATH_LENGTH:
        raise BadRequest(f"request path longer than {MAX_PATH_LENGTH} characters")
    path = raw_path.partition("?")[0]
    if not plain_path(path):
        reject_odd_segments(path)


def plain_path(path: str) -> bool:
    """Whether path is surely fine, at a fraction of reject_odd_segments' cost (the usual
    path): nothing to decode, no control character or backslash, no segment starting with
    a dot."""
    return ("%" not in path and "\\" not in path and "/." not in path and path.isprintable()
            and not path.startswith("."))


def reject_odd_segments(path: str) -> None:
    """The whole check of a path without its query: encoded slashes, then (decoded) control
    characters, backslashes and dot segments."""
    decoded = path
    if "%" in path:
        lowered = path.lower()
        if "%2f" in lowered or "%5c" in lowered:
            raise BadRequest("encoded slashes are not allowed in paths")
        decoded = unquote(path, errors="strict")
    if _ODD_CHARACTERS.search(decoded):
        raise BadRequest("control characters and backslashes are not allowed in paths")
    if _DOT_SEGMENT.search(decoded):
        raise BadRequest("dot segments are not allowed in paths")


# How a route's errors are answered, where not with json_error: (request, status, message,
# the exception) -> the response (the OCI API has its own error shape and challenge).
ErrorShape = Callable[[web.Request, int, str, Exception], web.Response]


class Guard(Protocol):
    """What route_guard returns: wraps one route's handler."""

    def __call__(self, route: str, handler: Handler,
                 shape: ErrorShape | None = None) -> Handler: ...


def route_guard(metrics: Metrics, auth: AuthConfig) -> Guard:
    """What wraps each route's handler, once, when the route is added: odd paths refused,
    then clients authenticated (where auth requires it), ProxyError and aiohttp's HTTP errors
    turned into JSON (never a traceback), and every answer counted by route and status
    class. A failure after the response headers were sent cannot be answered: it cuts the
    connection. No middleware, so nothing else runs per request. A refusal of a request
    that names an artifact is logged with its reason and what to do (ErrorWarnings)."""
    warnings = ErrorWarnings()
    authenticator = Authenticator(
        auth, lambda method, result: metrics.auth_requests.labels(method, result).inc())

    def guard(route: str, handler: Handler, shape: ErrorShape | None = None) -> Handler:
        # Paths no route serves are answered (404, 405) without asking for credentials.
        authenticate = None if route == UNMATCHED else authenticator.for_route(route)
        count = _answer_counter(metrics, route)

        async def guarded(request: web.Request) -> web.StreamResponse:
            try:
                try:
                    reject_odd_path(request.raw_path)
                except UnicodeDecodeError:
                    raise BadRequest("request path is not valid UTF-8") from None
                if authenticate is not None:
                    await authenticate(request)
                response = await handler(request)
            except Exception as exc:
                prepared = request.get(PREPARED_RESPONSE_KEY)
                if prepared is None:
                    response = _error_response(request, route, exc, warnings, shape)
                else:
                    explained = isinstance(exc, ProxyError) and warnings.cut_off(
                        route, request.match_info, exc)
                    abort_after_headers(request, exc, metrics.aborted_responses, route,
                                        explained=explained)
                    response = prepared  # aiohttp finds it sent and the connection gone
            count(response.status)
            return response

        return update_wrapper(guarded, handler)

    return guard


def _answer_counter(metrics: Metrics, route: str) -> Callable[[int], None]:
    """Counts route's answers by status class, each labelled series looked up once."""
    counted: dict[int, Counter] = {}

    def count(status: int) -> None:
        status_class = status // 100
        child = counted.get(status_class)
        if child is None:
            child = counted[status_class] = metrics.requests.labels(route, f"{status_class}xx")
        child.inc()

    return count


def _error_response(request: web.Request, route: str, exc: Exception,
                    warnings: ErrorWarnings, shape: ErrorShape | None) -> web.Response:
    if isinstance(exc, ProxyError):
        warnings.refused(route, request.match_info, request.path, exc)
        if shape is not None:
            return shape(request, exc.status, exc.message, exc)
        response = json_error(exc.status, exc.message)
        if exc.status == 401:
            response.headers["WWW-Authenticate"] = 'Bearer realm="tf-registry-proxy"'
            # A browser prompts for the token as a password; version managers send it so.
            if route in BASIC_ROUTES or route in RELEASE_ROUTES:
                response.headers.add("WWW-Authenticate",
                                     'Basic realm="tf-registry-proxy", charset="UTF-8"')
        return response
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        response = json_error(exc.status, exc.reason) if shape is None else \
            shape(request, exc.status, exc.reason, exc)
        if "Allow" in exc.headers:  # a 405 must say what is allowed
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    log.error("unexpected error on %s %s", request.method, request.path, exc_info=exc)
    return json_error(500, "internal error") if shape is None else \
        shape(request, 500, "internal error", exc)
