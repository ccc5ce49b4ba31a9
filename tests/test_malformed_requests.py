"""Hostile clients cannot flood the log: requests that break HTTP/1.1 are client errors, one
rate-limited WARNING without traceback and a count in tfproxy_bad_requests_total, and every
answer aiohttp makes for them is JSON like the proxy's own errors. ERROR stays for the
proxy's faults."""

from __future__ import annotations

import json
import logging
import ssl
import urllib.request
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import trustme
from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadHttpMethod,
    BadStatusLine,
    InvalidHeader,
    LineTooLong,
    TransferEncodingError,
)
from aiohttp.typedefs import Handler

import proxy
from proxy.app import create_app
from proxy.config import Config
from proxy.core.log_limits import RateLimitedLog
from proxy.web.parser_errors import MAX_TEXT, REASONS, describe
from tests.support.metrics import sample
from tests.support.proxy_process import ProxyProcess, free_port
from tests.support.raw_http import RawAnswer, raw_request, served

SECRET = "glpat-NotForTheLog0123"
HOST = b"Host: 127.0.0.1\r\n"


@dataclass(frozen=True)
class Malformed:
    """A request the parser refuses, and the reason the proxy should count it under."""

    name: str
    request: bytes
    reason: str


MALFORMED = [
    Malformed("garbage request line", b"\x00\x01\x02\xff garbage\r\n\r\n", "method"),
    Malformed("no target", b"GET\r\n\r\n", "method"),
    Malformed("unknown version", b"GET / HTTP/7.1\r\n" + HOST + b"\r\n", "request_line"),
    Malformed("space in a header name",
              b"GET /mirror/ HTTP/1.1\r\n" + HOST + f"X Token: {SECRET}\r\n\r\n".encode(),
              "header"),
    Malformed("NUL in a header value",
              b"GET / HTTP/1.1\r\n" + HOST + f"Authorization: Bearer {SECRET}\0\r\n\r\n"
              .encode(), "header"),
    Malformed("too many headers",
              b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) +
              b"\r\n", "header"),
    # Over the 8190-byte limit, within one TLS record: the server reads all of it before it
    # closes, so the close is a FIN, not a reset that would destroy its answer.
    Malformed("huge header", b"GET / HTTP/1.1\r\n" + HOST + b"X-Big: " + b"a" * 10000 +
              b"\r\n\r\n", "too_long"),
    Malformed("huge request line", b"GET /" + SECRET.encode() * 400 + b" HTTP/1.1\r\n" +
              HOST + b"\r\n", "too_long"),
    Malformed("invalid chunk size", b"POST /mirror/ HTTP/1.1\r\n" + HOST +
              b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n", "framing"),
    Malformed("Content-Length and chunked", b"POST / HTTP/1.1\r\n" + HOST +
              b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", "framing"),
    Malformed("HTTP/2 preface", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "http2"),
]
# After a good request on the same connection (aiohttp logs only a first bad request at
# debug level; a later one was an ERROR with its traceback).
PIPELINED = Malformed("bad second request", b"BAD REQUEST\r\n\r\n", "method")
GOOD = b"GET /healthz HTTP/1.1\r\n" + HOST + b"\r\n"
ROUNDS = 40  # 480 malformed requests


@dataclass(frozen=True)
class Flood:
    """What 480 malformed requests to a real `serve` process left behind."""

    answers: list[tuple[Malformed, RawAnswer]]
    log: str
    metrics: str


@pytest.fixture(scope="module")
def flood(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Flood]:
    work = tmp_path_factory.mktemp("flood")
    port = free_port()
    config = work / "proxy.toml"
    config.write_text(f'[server]\nlisten = "127.0.0.1:{port}"\n[cache]\ndir = "{work / "cache"}"\n')
    log = work / "proxy.log"
    here = str(Path(proxy.__file__).resolve().parents[1])  # the package under test
    with ProxyProcess(config, work / "cache", port, log, env={"PYTHONPATH": here}) as running:
        tls = ssl.create_default_context(cafile=str(running.ca_file))
        requests = [*MALFORMED, PIPELINED] * ROUNDS
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda bad: (bad, send(port, tls, bad)), requests))
        with urllib.request.urlopen(f"{running.url}metrics", context=tls, timeout=10) as got:
            metrics = got.read().decode()
    yield Flood(answers, log.read_text(), metrics)


def send(port: int, tls: ssl.SSLContext, bad: Malformed) -> RawAnswer:
    # A long idle limit costs nothing (the server closes these connections) and rides out a
    # busy machine.
    if bad is PIPELINED:
        return raw_request("127.0.0.1", port, GOOD, tls, idle=10, then=bad.request)
    return raw_request("127.0.0.1", port, bad.request, tls, idle=10)


def test_a_flood_of_malformed_requests_leaves_one_warning_and_no_error(flood: Flood) -> None:
    lines = flood.log.splitlines()
    assert "Traceback" not in flood.log
    assert [line for line in lines if " ERROR " in line] == []
    warnings = [line for line in lines if " WARNING " in line]
    assert len(warnings) == 1, warnings  # all within a minute: one line
    assert "refused a malformed request from 127.0.0.1 (" in warnings[0]
    assert SECRET not in flood.log and "NotForTheLog" not in flood.log


def test_every_malformed_request_is_counted_by_reason(flood: Flood) -> None:
    expected = Counter(bad.reason for bad, _answer in flood.answers)
    for reason in REASONS:
        counted = sample(flood.metrics, "tfproxy_bad_requests_total", reason=reason)
        assert (counted or 0) == expected[reason], (reason, counted)
    assert sum(expected.values()) == len(flood.answers) == ROUNDS * 12


def test_malformed_requests_get_json_errors(flood: Flood) -> None:
    for bad, answer in flood.answers:
        if bad is PIPELINED:  # the good request's answer, then the error's
            assert answer.status == 200, bad.name
            assert answer.body.startswith(b'{"status":"ok"}HTTP/1.0 400 Bad Request\r\n')
            assert answer.body.endswith(b'{"errors": ["malformed request: Invalid method '
                                   b'encountered"]}'), answer.body
            continue
        assert answer.status == 400, (bad.name, answer)
        assert answer.headers["content-type"] == "application/json", (bad.name, answer)
        assert answer.headers["server"] == "tf-registry-proxy"
        assert answer.ended == "eof"  # the parser cannot go on: the connection is closed
        [message] = json.loads(answer.body)["errors"]
        assert message.startswith("malformed request: ") and len(message) < 150, message
        assert "NotForTheLog" not in message and "\\x" not in message, message


async def test_expectation_failed_is_json(proxy_config: Config, upstream_ca: trustme.CA,
                                          caplog: pytest.LogCaptureFixture) -> None:
    """417 comes from aiohttp after routing, before the middleware."""
    async with served(create_app(proxy_config), upstream_ca) as proxy:
        answer = await proxy.raw_request(b"POST /mirror/ HTTP/1.1\r\n" + HOST +
                                         b"Expect: 200-ok\r\nContent-Length: 2\r\n\r\nhi")
    assert answer.status == 417
    assert answer.headers["content-type"].split(";")[0] == "application/json"
    assert answer.body == b'{"errors": ["Expectation Failed"]}'
    assert answer.content_length == len(answer.body)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_fault_outside_the_middleware_is_an_error_with_traceback_and_json(
        proxy_config: Config, upstream_ca: trustme.CA,
        caplog: pytest.LogCaptureFixture) -> None:
    """The proxy's own faults keep their ERROR line and traceback; the answer is still
    JSON."""
    app = create_app(proxy_config)

    @web.middleware
    async def broken(request: web.Request, handler: Handler) -> web.StreamResponse:
        raise RuntimeError("a bug in the proxy")

    app.middlewares.insert(0, broken)  # outside the error middleware
    async with served(app, upstream_ca) as proxy:
        answer = await proxy.raw_request(b"GET /healthz HTTP/1.1\r\n" + HOST + b"\r\n")
    assert answer.status == 500
    assert answer.headers["content-type"] == "application/json"
    assert answer.body == b'{"errors": ["internal error"]}'
    [error] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert error.exc_info is not None and "a bug in the proxy" in str(error.exc_info[1])


@pytest.mark.parametrize(("exc", "reason", "text"), [
    (LineTooLong(b"GET /" + SECRET.encode() + b"...", 8190), "too_long",
     "request line or header longer than 8190 bytes"),
    (InvalidHeader(f"X-Token: {SECRET}".encode()), "header", "Invalid HTTP header"),
    (BadHttpMessage("Duplicate 'Host' header found."), "header", "Duplicate header found"),
    (BadHttpMethod(f"{SECRET} / HTTP/1.1"), "method", "Bad HTTP method in status line"),
    (BadStatusLine(f"GET /{SECRET} HTTP/9"), "request_line", "Bad status line"),
    (BadHttpMessage(f"Invalid header value char:\n\n  b'Authorization: Bearer {SECRET}\\x00'"
                    "\n    ^"), "header", "Invalid header value char"),
    (BadHttpMessage("Transfer-Encoding can't be present with Content-Length:\n\n  b'x'\n  ^"),
     "framing", "Transfer-Encoding can't be present with Content-Length"),
    (TransferEncodingError("Not enough data to satisfy transfer length header."), "framing",
     "Not enough data to satisfy transfer length header"),
    (BadHttpMessage("\x1b[2J" + "z" * 500), "other", "?[2J" + "z" * (MAX_TEXT - 4)),
])
def test_parser_errors_are_described_without_the_clients_bytes(
        exc: BadHttpMessage, reason: str, text: str) -> None:
    """Both parsers' messages (the C parser's and aiohttp's pure-Python one) quote what the
    client sent; the description keeps the parser's words only."""
    described = describe(exc)
    assert (described.reason, described.text) == (reason, text)
    assert described.reason in REASONS


def test_rate_limited_log_says_how_many_lines_it_dropped(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    limited = RateLimitedLog(logging.getLogger("test.limited"), interval=60,
                             clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="test.limited")
    assert limited.log("bad request from %s", "a")
    for second in range(59):
        now[0] = 101.0 + second
        assert not limited.log("bad request from %s", "b")
    assert limited.suppressed == 59
    now[0] = 175.0
    assert limited.log("bad request from %s", "c")
    assert not limited.log("bad request from %s", "d")
    now[0] = 1000.0
    assert limited.log("bad request from %s", "e")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, "bad request from a"),
        (logging.WARNING, "bad request from c (59 more like it in the last 75s were not "
                          "logged)"),
        (logging.WARNING, "bad request from e (1 more like it in the last 825s were not "
                          "logged)"),
    ]
