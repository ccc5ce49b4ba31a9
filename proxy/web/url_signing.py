"""Signed, expiring URLs for package and module archives: clients send no credentials there
(Terraform fetches them anonymously), so the URL itself carries the proof. Pure: no I/O."""

from __future__ import annotations

import hashlib
import hmac
import time
from urllib.parse import urlencode

from proxy.core.digits import is_decimal

EXPIRES = "expires"
SIGNATURE = "sig"
# The name of the token whose request handed the URL out (signed with it): the audit log
# names who fetched an archive, although clients send no credentials for it.
SIGNED_FOR = "by"
# Expiry times are rounded down to a step of this share of the TTL (at most a minute): URLs
# signed within one step are the same, and so are the documents carrying them (one ETag),
# while no URL outlives the TTL.
_STEPS_PER_TTL = 60
_LONGEST_STEP = 60


class UrlSigner:
    """HMAC-SHA256 over the path and an expiry time."""

    def __init__(self, key: bytes, ttl: float) -> None:
        self._key = key
        self._ttl = ttl
        self._step = max(1, min(_LONGEST_STEP, int(ttl // _STEPS_PER_TTL)))

    def _mac(self, path: str, expires: int, signed_for: str | None = None) -> str:
        # A URL signed for no one keeps the MAC it always had (URLs already handed out).
        text = f"{path}\n{expires}" if signed_for is None else f"{path}\n{expires}\n{signed_for}"
        return hmac.new(self._key, text.encode(), hashlib.sha256).hexdigest()

    def binding(self, secret: bytes) -> str:
        """A short MAC of a client token: what a credential issued for that token carries, so
        that it stops working once the token is no longer configured (the token itself is
        never in it)."""
        return hmac.new(self._key, b"token\n" + secret, hashlib.sha256).hexdigest()[:32]

    def expiry(self, now: float | None = None, credential_expires: float | None = None) -> int:
        """When a URL signed now expires: the TTL from now, rounded down to the step; for
        a credential that expires (an OIDC token), never later than the TTL past that."""
        at = int((time.time() if now is None else now) + self._ttl)
        if credential_expires is not None:
            at = min(at, int(credential_expires + self._ttl))
        return at - at % self._step

    def query(self, path: str, now: float | None = None, expires: int | None = None,
              signed_for: str | None = None) -> str:
        """The query string (without `?`) that authorizes GET/HEAD of path until `expires`
        (default: the expiry of a URL signed now), for the token named signed_for."""
        if expires is None:
            expires = self.expiry(now)
        query: dict[str, str | int] = {EXPIRES: expires}
        if signed_for is not None:
            query[SIGNED_FOR] = signed_for
        query[SIGNATURE] = self._mac(path, expires, signed_for)
        return urlencode(query)

    def valid(self, path: str, expires: str | None, signature: str | None,
              now: float | None = None, signed_for: str | None = None) -> bool:
        """Whether the query parameters authorize path now."""
        if not expires or not signature or not is_decimal(expires) or len(expires) > 12:
            return False
        if int(expires) < (time.time() if now is None else now):
            return False
        return hmac.compare_digest(self._mac(path, int(expires), signed_for), signature)
