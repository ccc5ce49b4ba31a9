"""Signed, expiring URLs for package and module archives: clients send no credentials there
(Terraform fetches them anonymously), so the URL itself carries the proof. Pure: no I/O."""

from __future__ import annotations

import hashlib
import hmac
import time
from urllib.parse import urlencode

EXPIRES = "expires"
SIGNATURE = "sig"


class UrlSigner:
    """HMAC-SHA256 over the path and an expiry time."""

    def __init__(self, key: bytes, ttl: float) -> None:
        self._key = key
        self._ttl = ttl

    def _mac(self, path: str, expires: int) -> str:
        return hmac.new(self._key, f"{path}\n{expires}".encode(), hashlib.sha256).hexdigest()

    def query(self, path: str, now: float | None = None) -> str:
        """The query string (without `?`) that authorizes GET/HEAD of path until the TTL."""
        expires = int((time.time() if now is None else now) + self._ttl)
        return urlencode({EXPIRES: expires, SIGNATURE: self._mac(path, expires)})

    def valid(self, path: str, expires: str | None, signature: str | None,
              now: float | None = None) -> bool:
        """Whether the query parameters authorize path now."""
        if not expires or not signature or not expires.isdigit() or len(expires) > 12:
            return False
        if int(expires) < (time.time() if now is None else now):
            return False
        return hmac.compare_digest(self._mac(path, int(expires)), signature)
