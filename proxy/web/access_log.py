"""One access log line per request, plain or JSON, with credentials in URLs masked.

Serving (proxy.cli.logs installs an AccessLines handler on the access logger), a request
leaves its fields with a batched writer (proxy.core.line_writer), which has its line made in
one step with the rest of its batch, in exactly the form the logging formatters give it, and
written by a thread: no log record, no formatter, no write per request. Elsewhere (a test
capturing records, a command), lines go through logging as records."""

from __future__ import annotations

import json
import logging
import time
from datetime import UTC, datetime
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse

from proxy.core.line_writer import BatchedLineWriter
from proxy.core.redaction import mask_secrets
from proxy.web.quick_answers import QuickAnswer

__all__ = ["ABORTED_KEY", "ACCESS_FIELDS", "ACCESS_LOGGER", "CACHE_RESULT_KEY",
           "AccessLines", "JsonAccessLogger", "PlainAccessLogger", "mask_secrets",
           "request_line_fields"]

ACCESS_LOGGER = "proxy.access"
# The attribute of a JSON access line's log record that holds its fields (as a dict): a JSON
# formatter writes them as they are, beside the line's time (proxy.cli.logs).
ACCESS_FIELDS = "access_fields"
log = logging.getLogger(ACCESS_LOGGER)
# Set by handlers that serve files: "hit" (from the cache) or "miss" (fetched now).
CACHE_RESULT_KEY = web.RequestKey("cache_result", str)
# Set when the body was cut off after the headers (why: integrity, upstream, io, internal):
# the status line already said 200, so the access line must say the download failed.
ABORTED_KEY = web.RequestKey("aborted", str)
# Fixed parts of kept answers' lines held at once (then made again).
_QUICK_PARTS = 4096


def request_line_fields(request: BaseRequest, response: StreamResponse,
                        seconds: float) -> dict[str, Any]:
    """What the access log says about one request."""
    if type(response) is QuickAnswer:  # its path masked once; from memory, never cut off
        path, cache, aborted = response.logged_path, "-", "-"
    else:
        path = mask_secrets(request.path_qs)
        cache, aborted = request.get(CACHE_RESULT_KEY, "-"), request.get(ABORTED_KEY, "-")
    size = response.body_length
    if (response.status == 200 and request.method != "HEAD" and response.content_length
            and aborted == "-"):
        size = response.content_length  # sendfile bodies are not counted by body_length
    return {
        "remote": request.remote,
        "method": request.method,
        "path": path,
        "status": response.status,
        "bytes": size,
        "duration_ms": round(seconds * 1000, 1),
        "cache": cache,
        "aborted": aborted,
    }


def plain_text(fields: dict[str, Any]) -> str:
    """`remote "METHOD path" status bytes duration cache=... aborted=...`."""
    return (f'{fields["remote"]} '
            f'{request_part(fields["method"], fields["path"], fields["status"], fields["bytes"])}'
            f'{fields["duration_ms"]}ms cache={fields["cache"]} aborted={fields["aborted"]}')


def request_part(method: str, path: str, status: object, size: object) -> str:
    """A plain line's part from the request line to the size, with its trailing space."""
    return f'"{method} {path}" {status} {size} '


def json_time(created: float) -> str:
    """A JSON log line's time: UTC, ISO 8601, milliseconds, `Z`."""
    return datetime.fromtimestamp(created, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


class AccessLines(logging.Handler):
    """The access logger's handler while serving: each line made in one step with its batch,
    in the form the server's formatters give it (server.log_format, server.access_log), and
    written in batches. Records that still reach it (emit) are written the same way."""

    def __init__(self, access_format: str, log_format: str, worker: int | None,
                 writer: BatchedLineWriter) -> None:
        super().__init__()
        self._json = access_format == "json"
        self._json_text = log_format == "json"  # plain lines inside JSON log lines
        self._worker = worker
        self._who = "" if worker is None else f"w{worker} "
        self._writer = writer
        # The text prefix last made: (second, millisecond, level, prefix), and the second's
        # text: (second, text). One attribute each, so that a record emitted by another
        # thread never sees half of an update.
        self._prefix: tuple[int, int, str, str] = (-1, -1, "", "")
        self._second: tuple[int, str] = (-1, "")
        # Whether lines are plain text (not JSON, not inside JSON log lines).
        self.text = not self._json and not self._json_text
        # Of a 200 to a GET from QuickAnswers: the line's part from the request line to the
        # size, by (path, size).
        self._quick_parts: dict[tuple[str, int], str] = {}

    def write(self, fields: dict[str, Any]) -> None:
        """One request's line, made with its batch."""
        self._writer.add((self.line, fields, time.time()))

    def write_quick(self, remote: str | None, answer: QuickAnswer, seconds: float) -> None:
        """The line of a 200 to a GET from QuickAnswers, in plain text lines: made with
        its batch (the line costs a kept answer's path little)."""
        self._writer.add((self._quick_line, time.time(), remote, answer.logged_path,
                          answer.body_size, seconds))

    def _quick_line(self, created: float, remote: str | None, path: str, size: int,
                    seconds: float) -> str:
        """What plain_text and _text_line make of a kept 200 GET's fields (the same
        characters), its fixed part made once per path and size."""
        key = (path, size)
        part = self._quick_parts.get(key)
        if part is None:
            if len(self._quick_parts) >= _QUICK_PARTS:
                self._quick_parts.clear()
            part = self._quick_parts[key] = request_part("GET", path, 200, size)
        # The duration as request_line_fields rounds it: the same characters as
        # round(..., 1) printed (both rounded correctly from the same float), made faster.
        return (f"{self._text_prefix(created, 'INFO')}{remote} {part}"
                f"{seconds * 1000:.1f}ms cache=- aborted=-\n")

    def line(self, fields: dict[str, Any], created: float) -> str:
        """The line, newline included, exactly as the formatters would write it."""
        if self._json:
            return self._json_line(created, "INFO", fields)
        return self._text_line(created, "INFO", plain_text(fields))

    def _text_line(self, created: float, level: str, message: str) -> str:
        if self._json_text:
            return self._json_line(created, level, {"message": message})
        return f"{self._text_prefix(created, level)}{message}\n"

    def _text_prefix(self, created: float, level: str) -> str:
        """What logging's text format puts before a line's message: made once per
        millisecond and level (the lines of a batch mostly share theirs)."""
        second = int(created)
        millisecond = int((created - second) * 1000)  # as logging.LogRecord's msecs
        made = self._prefix
        if made[0] == second and made[1] == millisecond and made[2] == level:
            return made[3]
        second_text = self._second
        if second_text[0] != second:  # strftime once a second
            second_text = self._second = (
                second, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(created)))
        prefix = f"{second_text[1]},{millisecond:03d} {level} {self._who}{ACCESS_LOGGER}: "
        self._prefix = (second, millisecond, level, prefix)
        return prefix

    def _json_line(self, created: float, level: str, content: dict[str, Any]) -> str:
        entry: dict[str, Any] = {"time": json_time(created), "level": level,
                                 "logger": ACCESS_LOGGER}
        if self._worker is not None:
            entry["worker"] = self._worker
        entry.update(content)
        return json.dumps(entry, separators=(",", ":")) + "\n"

    def emit(self, record: logging.LogRecord) -> None:
        """A record logged to the access logger some other way: the line the formatters
        wrote for it (its fields, as a JSON access line; else its masked message)."""
        fields = getattr(record, ACCESS_FIELDS, None)
        if self._json and isinstance(fields, dict):
            line = self._json_line(record.created, record.levelname, fields)
        else:
            line = self._text_line(record.created, record.levelname,
                                   mask_secrets(record.getMessage()))
        self._writer.add(line)

    def flush(self) -> None:
        """Hand every queued line to the writer thread (SIGHUP)."""
        self._writer.flush()

    def close(self) -> None:
        """Write out every line, then stop the writer (shutdown; logging.shutdown too)."""
        self._writer.close()
        super().close()


def _lines_of(logger: logging.Logger) -> AccessLines | None:
    """The AccessLines handler lines of logger go to alone, if it has one."""
    if logger.propagate:
        return None
    found = [h for h in logger.handlers if isinstance(h, AccessLines)]
    return found[0] if len(found) == 1 and len(logger.handlers) == 1 else None


class PlainAccessLogger(AbstractAccessLogger):
    """`remote "METHOD path" status bytes duration cache=... aborted=...`."""

    def __init__(self, logger: logging.Logger, log_format: str) -> None:
        super().__init__(logger, log_format)
        self._lines = _lines_of(logger)
        # Lines of text to a text log: a kept answer's line is mostly made once (the default).
        self._quick = self._lines if self._lines is not None and self._lines.text else None

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        quick = self._quick
        if (quick is not None and type(response) is QuickAnswer and response.status == 200
                and request.method == "GET"):
            quick.write_quick(request.remote, response, time)
            return
        fields = request_line_fields(request, response, time)
        if self._lines is not None:
            self._lines.write(fields)
            return
        self.logger.info("%s", plain_text(fields))


class JsonAccessLogger(AbstractAccessLogger):
    """One JSON object per line: the fields travel with the record, for a JSON formatter
    that adds the time and writes nothing else; the message is the same object as text."""

    def __init__(self, logger: logging.Logger, log_format: str) -> None:
        super().__init__(logger, log_format)
        self._lines = _lines_of(logger)

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        fields = request_line_fields(request, response, time)
        if self._lines is not None:
            self._lines.write(fields)
            return
        self.logger.info("%s", json.dumps(fields, separators=(",", ":")),
                         extra={ACCESS_FIELDS: fields})
