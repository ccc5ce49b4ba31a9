"""The HTTP server around the app. Requests that aiohttp's parser refuses (garbage request
lines, bad headers, broken chunked framing, an HTTP/2 preface) never reach the middleware:
they are answered here, in JSON like every other error, and logged as what they are, client
errors: a rate-limited WARNING without traceback, and a count in tfproxy_bad_requests_total.
ERROR stays for the proxy's own faults."""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler

from proxy.core.log_limits import RateLimitedLog
from proxy.core.metrics import Metrics
from proxy.web.middleware import SERVER_NAME, json_error
from proxy.web.parser_errors import ParserError, describe
from proxy.web.routes import METRICS_KEY, QUICK_KEY

log = logging.getLogger(__name__)
WARNING_INTERVAL = 60.0  # seconds between two warnings about malformed requests


class BadRequestReport:
    """Counts every refused request; logs one line a minute at most."""

    def __init__(self, metrics: Metrics, interval: float = WARNING_INTERVAL) -> None:
        self._counter = metrics.bad_requests
        self._log = RateLimitedLog(log, interval=interval)

    def record(self, remote: str | None, error: ParserError) -> None:
        """Count one refused request and maybe log it."""
        self._counter.labels(error.reason).inc()
        self._log.log("refused a malformed request from %s (%s): %s", remote or "-",
                      error.reason, error.text)


class ProxyRunner(web.AppRunner):
    """web.AppRunner whose connections answer and log parser errors as above.

    aiohttp 3 offers no hook for this (aiohttp 4 routes these requests through the
    middleware): the runner builds its Server as AppRunner does, then an equivalent one whose
    connections are _JsonErrorRequestHandler. tests/test_malformed_requests.py pins the
    behaviour, so an aiohttp upgrade that bypasses it fails the tests."""

    def __init__(self, app: web.Application, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self._report = BadRequestReport(app[METRICS_KEY])

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # starts the app, freezes it
        handler = server.request_handler
        quick_answers = self.app.get(QUICK_KEY)
        if quick_answers is not None:  # held documents go out before routing
            handler = quick_answers.before(handler)
        # Server keeps the RequestHandler arguments (access log, limits) in _kwargs.
        return _Server(handler, request_factory=server.request_factory,
                       handler_cancellation=server.handler_cancellation,
                       report=self._report, **server._kwargs)


class _Server(web.Server):
    def __init__(self, handler: Any, *, report: BadRequestReport, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._report = report

    def __call__(self) -> RequestHandler:
        return _JsonErrorRequestHandler(self, self._report, loop=self._loop, **self._kwargs)


class _JsonErrorRequestHandler(RequestHandler):
    """One connection; `handle_error` is where aiohttp answers requests that never reached
    the app (parser errors, status 400) and failures outside the middleware (500)."""

    __slots__ = ("_report",)

    def __init__(self, manager: web.Server, report: BadRequestReport, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._report = report

    def handle_error(self, request: web.BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """A JSON answer that closes the connection; a parser error is reported as a
        client error, anything else is logged by aiohttp at ERROR with its traceback."""
        if isinstance(exc, HttpProcessingError) and 400 <= status < 500:
            error = describe(exc)
            self._report.record(request.remote, error)
            response = json_error(status, f"malformed request: {error.text}")
        else:
            super().handle_error(request, status, exc, message)  # logs; may raise
            response = json_error(status, "internal error" if status == 500
                                  else HTTPStatus(status).phrase)
        response.headers["Server"] = SERVER_NAME  # no on_response_prepare: no route
        response.force_close()  # the parser cannot find the next request
        return response
