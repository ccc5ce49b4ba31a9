"""The audit log as tests read it: every line parsed (a line that is not JSON fails the
test), and configs that write one."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any


def audit_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of the audit log at path, parsed; [] when it does not exist."""
    if not path.exists():
        return []
    text = path.read_text()
    assert text == "" or text.endswith("\n"), f"a partial last line: {text[-200:]!r}"
    return [json.loads(line) for line in text.splitlines()]


def events(path: Path, event: str, **fields: object) -> list[dict[str, Any]]:
    """The lines of one event whose fields have the values given."""
    return [line for line in audit_lines(path) if line["event"] == event
            and all(line.get(key) == value for key, value in fields.items())]


def with_audit_log(config: Path, log: Path) -> Path:
    """config, its [server] table now writing the audit log to log."""
    text = config.read_text()
    assert "[server]\n" in text
    config.write_text(text.replace("[server]\n", f'[server]\naudit_log = "{log}"\n', 1))
    return config


async def eventually(path: Path, event: str, count: int = 1,
                     **fields: object) -> list[dict[str, Any]]:
    """The lines of one event once there are count of them (or after 10 s, those there
    are): a line is written once its answer or fill ends, which may be after the client
    got the last byte."""
    for _attempt in range(200):
        found = events(path, event, **fields)
        if len(found) >= count:
            return found
        await asyncio.sleep(0.05)
    return events(path, event, **fields)
