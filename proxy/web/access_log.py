"""One access log line per request, plain or JSON, with credentials in URLs masked."""

from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.web import BaseRequest, StreamResponse

from proxy.core.redaction import mask_secrets

__all__ = ["ABORTED_KEY", "ACCESS_FIELDS", "ACCESS_LOGGER", "CACHE_RESULT_KEY",
           "JsonAccessLogger", "PlainAccessLogger", "mask_secrets", "request_line_fields"]

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


def request_line_fields(request: BaseRequest, response: StreamResponse,
                        seconds: float) -> dict[str, Any]:
    """What the access log says about one request."""
    size = response.body_length
    aborted = request.get(ABORTED_KEY, "-")
    if (response.status == 200 and request.method != "HEAD" and response.content_length
            and aborted == "-"):
        size = response.content_length  # sendfile bodies are not counted by body_length
    return {
        "remote": request.remote,
        "method": request.method,
        "path": mask_secrets(request.path_qs),
        "status": response.status,
        "bytes": size,
        "duration_ms": round(seconds * 1000, 1),
        "cache": request.get(CACHE_RESULT_KEY, "-"),
        "aborted": aborted,
    }


class PlainAccessLogger(AbstractAccessLogger):
    """`remote "METHOD path" status bytes duration cache=... aborted=...`."""

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        f = request_line_fields(request, response, time)
        log.info('%s "%s %s" %s %s %sms cache=%s aborted=%s', f["remote"], f["method"],
                 f["path"], f["status"], f["bytes"], f["duration_ms"], f["cache"], f["aborted"])


class JsonAccessLogger(AbstractAccessLogger):
    """One JSON object per line: the fields travel with the record, for a JSON formatter
    that adds the time and writes nothing else; the message is the same object as text."""

    def log(self, request: BaseRequest, response: StreamResponse, time: float) -> None:
        fields = request_line_fields(request, response, time)
        log.info("%s", json.dumps(fields, separators=(",", ":")), extra={ACCESS_FIELDS: fields})
