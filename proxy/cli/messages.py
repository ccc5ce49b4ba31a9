"""What a command prints when it fails: one masked, printable line on stderr."""

from __future__ import annotations

import sys

from proxy.core.redaction import mask_secrets

# The exit status of a command refused for its input, its configuration or its files.
FAILED = 2


def fail(message: str) -> int:
    """Print message as the command's error and return its exit status."""
    print(f"tf-registry-proxy: {_printable(mask_secrets(message))}", file=sys.stderr)
    return FAILED


def _printable(text: str) -> str:
    # Messages may quote what a file or a peer sent: no control sequence reaches the
    # operator's terminal, each is shown escaped.
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
