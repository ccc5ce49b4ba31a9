"""Reads a printed CLI configuration with a real HCL parser, as plain Python values."""

from __future__ import annotations

from typing import Any

import hcl2


def parse_cli_config(text: str) -> dict[str, Any]:
    """The configuration's blocks and attributes, string quotes and parser markers removed;
    raises when the text is not valid HCL."""
    parsed = _plain(hcl2.loads(text))
    assert isinstance(parsed, dict)
    return parsed


def _plain(value: object) -> object:
    if isinstance(value, dict):
        return {_unquote(key): _plain(item) for key, item in value.items()
                if key not in ("__is_block__", "__comments__", "__inline_comments__")}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return _unquote(value) if isinstance(value, str) else value


def _unquote(text: str) -> str:
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text
