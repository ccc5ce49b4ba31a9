"""What to say about a request that aiohttp's HTTP/1 parser refused: a reason from a small
fixed set (a metric label) and a short text, safe to log and to send back. Pure: no I/O."""

from __future__ import annotations

import re
from dataclasses import dataclass

from aiohttp.http_exceptions import (
    BadHttpMethod,
    BadStatusLine,
    HttpProcessingError,
    InvalidHeader,
    InvalidURLError,
    LineTooLong,
    PayloadEncodingError,
)

from proxy.core.redaction import excerpt

# Every reason `describe` returns (the label values of tfproxy_bad_requests_total).
REASONS = ("method", "request_line", "url", "header", "too_long", "framing", "http2", "other")
MAX_TEXT = 100

# The parser quotes what it could not parse (`b'...'`, `bytearray(b'...')`, `'...'`) and
# points at it (`^`): the client's own bytes, kept out of logs and answers.
_QUOTED = re.compile(r"""(?:^|\s+)(?:bytearray\()?b?(['"]).*?(?:\1\)?|$)""")
_RAW_LINE = re.compile(r"""^(?:bytearray\(|b?['"]|\^)""")
_UNPRINTABLE = re.compile(r"[^\x20-\x7e]")
_DEFAULT_TEXT = {
    "method": "invalid method",
    "request_line": "invalid request line",
    "url": "invalid request target",
    "header": "invalid header",
    "framing": "invalid message framing (Content-Length, Transfer-Encoding or chunks)",
    "http2": "HTTP/2 connection preface on an HTTP/1.1 connection",
    "other": "malformed request",
}


@dataclass(frozen=True)
class ParserError:
    """A refused request, as the proxy reports it."""

    reason: str  # one of REASONS
    text: str    # at most MAX_TEXT characters, no raw request bytes, secrets masked


def describe(exc: HttpProcessingError) -> ParserError:
    """The reason and text for the parser's exception."""
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else None
        size = f" longer than {limit} bytes" if isinstance(limit, int) else " too long"
        return ParserError("too_long", f"request line or header{size}")
    text = _summary(exc.message)
    reason = _reason(exc, text.lower())
    if reason == "http2" or not text:
        text = _DEFAULT_TEXT[reason]
    return ParserError(reason, text)


def _reason(exc: HttpProcessingError, text: str) -> str:
    # Subclasses first: BadHttpMethod is a BadStatusLine.
    for kind, reason in ((BadHttpMethod, "method"), (BadStatusLine, "request_line"),
                         (InvalidURLError, "url"), (InvalidHeader, "header"),
                         (PayloadEncodingError, "framing")):
        if isinstance(exc, kind):
            return reason
    # The C parser raises plain BadHttpMessage for most errors; its description says which.
    if "pri/upgrade" in text or "http/2" in text:
        return "http2"
    if any(word in text for word in ("chunk", "content-length", "transfer-encoding")):
        return "framing"
    return "header" if "header" in text else "other"


def _summary(message: str) -> str:
    """The parser's description of the error, without the bytes it quotes."""
    parts = []
    for line in message.splitlines():
        line = line.strip()
        if _RAW_LINE.match(line):
            break
        line = _QUOTED.sub("", line).rstrip(":. ")
        if line:
            parts.append(line)
    return excerpt(_UNPRINTABLE.sub("?", ": ".join(parts)), MAX_TEXT)
