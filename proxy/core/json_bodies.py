"""Protocol documents serialized once: the bytes sent on every hit, with their strong ETag."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class JsonBody:
    """A JSON document as sent: its bytes and a strong ETag naming exactly those bytes."""

    body: bytes
    etag: str


def json_body(document: dict[str, Any]) -> JsonBody:
    """Serialize a protocol document (compact, as every JSON answer is) and tag its bytes."""
    body = json.dumps(document, separators=(",", ":")).encode()
    return JsonBody(body, f'"{hashlib.sha256(body).hexdigest()}"')
