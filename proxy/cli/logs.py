"""Logging for every command: to stderr, with secrets masked in every record. `serve` writes
text or JSON lines (server.log_format), and access lines as JSON alone (server.access_log)."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

from proxy.config.settings import ServerConfig
from proxy.core.line_writer import BatchedLineWriter
from proxy.core.redaction import install_log_masking, mask_secrets
from proxy.web.access_log import ACCESS_FIELDS, ACCESS_LOGGER, AccessLines, json_time

# What one-shot commands (warm, tls) log: warnings and errors, no timestamps.
COMMAND_FORMAT = "%(levelname)s %(name)s: %(message)s"


def configure_logging(level: int | str, line_format: str) -> None:
    """Log to stderr with secrets masked in every record, whoever logs it (our modules,
    aiohttp, tracebacks)."""
    logging.basicConfig(level=level, format=line_format)
    install_log_masking()


def flush_access_lines() -> None:
    """Write out the access lines queued so far (SIGHUP)."""
    for handler in logging.getLogger(ACCESS_LOGGER).handlers:
        handler.flush()


def close_access_lines() -> None:
    """Write out every access line and stop their writer (a clean stop)."""
    for handler in logging.getLogger(ACCESS_LOGGER).handlers:
        handler.close()


def configure_server_logging(server: ServerConfig, worker: int | None = None) -> None:
    """serve's logging on stderr, masked: server.log_format's lines, each naming the worker
    process (its index) when it is one of several; with access_log = "json", access lines
    are JSON objects whatever the format of the rest."""
    handler = logging.StreamHandler()
    if server.log_format == "json":
        handler.setFormatter(JsonLineFormatter(worker))
    else:
        who = f"w{worker} " if worker is not None else ""
        handler.setFormatter(logging.Formatter(
            f"%(asctime)s %(levelname)s {who}%(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(server.log_level.upper())
    access = logging.getLogger(ACCESS_LOGGER)
    for old in list(access.handlers):
        access.removeHandler(old)
        old.close()
    if server.access_log != "off" and access.isEnabledFor(logging.INFO):
        # Built in one step and written in batches, off the event loop (the same lines).
        access.propagate = False
        stderr = sys.stderr  # encoded as a StreamHandler on it would
        writer = BatchedLineWriter(stderr.fileno(), encoding=stderr.encoding,
                                   errors=stderr.errors or "strict")
        access.addHandler(AccessLines(server.access_log, server.log_format, worker, writer))
    else:
        access.propagate = server.access_log != "json"
    install_log_masking()
    logging.captureWarnings(True)  # Python's warnings as log lines too, not bare stderr text


class JsonLineFormatter(logging.Formatter):
    """One JSON object per record, on one line: time (UTC, ISO 8601), level, logger, the
    worker's index (if one of several), message, and exception (its traceback) if any. A
    record of an access line has its fields in place of message. Formats what the masking
    filter left: masked text (and masks the access fields itself)."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self._worker = worker

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON."""
        entry: dict[str, Any] = {
            "time": json_time(record.created),
            "level": record.levelname, "logger": record.name}
        if self._worker is not None:
            entry["worker"] = self._worker
        fields = getattr(record, ACCESS_FIELDS, None)
        if isinstance(fields, dict):  # an access line: its fields, not its text
            entry.update({key: mask_secrets(value) if isinstance(value, str) else value
                          for key, value in fields.items()})
            return json.dumps(entry, separators=(",", ":"))
        entry["message"] = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, separators=(",", ":"))
