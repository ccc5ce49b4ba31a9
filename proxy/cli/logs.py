"""Logging for every command: to stderr, with secrets masked in every record."""

from __future__ import annotations

import logging

from proxy.core.redaction import install_log_masking

# What one-shot commands (warm, tls) log: warnings and errors, no timestamps.
COMMAND_FORMAT = "%(levelname)s %(name)s: %(message)s"


def configure_logging(level: int | str, line_format: str) -> None:
    """Log to stderr with secrets masked in every record, whoever logs it (our modules,
    aiohttp, tracebacks)."""
    logging.basicConfig(level=level, format=line_format)
    install_log_masking()
