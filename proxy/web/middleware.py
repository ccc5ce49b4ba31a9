"""Request middleware: JSON error bodies for every failure, and request metrics."""

from __future__ import annotations

import logging
import re
from urllib.parse import unquote

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler, Middleware
from prometheus_client import Counter

from proxy.core.errors import BadRequest, ProxyError
from proxy.core.metrics import Metrics
from proxy.web.responses import PREPARED_RESPONSE_KEY, abort_after_headers, error_body

log = logging.getLogger(__name__)


# What the Server header says: no library or Python versions in answers.
SERVER_NAME = "tf-registry-proxy"


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


def error_middleware(metrics: Metrics) -> Middleware:
    """Turn ProxyError and aiohttp's HTTP errors into JSON; never leak a traceback. A failure
    after the response headers were sent cannot be answered: it cuts the connection."""

    # The labelled counter of each route and status class, looked up once.
    counted: dict[tuple[str, int], Counter] = {}

    def count(route: str, status: int) -> None:
        key = (route, status // 100)
        child = counted.get(key)
        if child is None:
            child = counted[key] = metrics.requests.labels(route, f"{status // 100}xx")
        child.inc()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        route = _route_name(request)
        try:
            try:
                reject_odd_path(request.raw_path)
            except UnicodeDecodeError:
                raise BadRequest("request path is not valid UTF-8") from None
            response = await handler(request)
        except Exception as exc:
            prepared = request.get(PREPARED_RESPONSE_KEY)
            if prepared is None:
                response = _error_response(request, exc)
            else:
                abort_after_headers(request, exc, metrics.aborted_responses, route)
                response = prepared  # aiohttp finds it sent and the connection gone
        count(route, response.status)
        return response

    return middleware


def _error_response(request: web.Request, exc: Exception) -> web.Response:
    if isinstance(exc, ProxyError):
        if exc.status >= 500:
            log.warning("%s %s -> %d: %s", request.method, request.path, exc.status,
                        exc.message)
        response = json_error(exc.status, exc.message)
        if exc.status == 401:
            response.headers["WWW-Authenticate"] = 'Bearer realm="tf-registry-proxy"'
        return response
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        response = json_error(exc.status, exc.reason)
        if "Allow" in exc.headers:  # a 405 must say what is allowed
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    log.error("unexpected error on %s %s", request.method, request.path, exc_info=exc)
    return json_error(500, "internal error")


def _route_name(request: web.Request) -> str:
    info = request.match_info
    route = getattr(info, "route", None)
    name = getattr(route, "name", None)
    return name if isinstance(name, str) else "unmatched"
