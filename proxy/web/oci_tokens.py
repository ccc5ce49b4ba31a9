"""Bearer tokens of the OCI token flow (https://distribution.github.io/distribution/spec/auth/token/):
a client challenged on /v2 asks /v2/token with its credentials (a proxy token as the Basic
password) and gets a short-lived token, signed like archive URLs (the same key and TTL), that
names the token it was issued for and carries that token's binding (UrlSigner.binding): it
is refused once no configured token has that binding. Pure: no I/O."""

from __future__ import annotations

import base64
import binascii
import time
from collections.abc import Collection
from urllib.parse import parse_qs

from proxy.web.url_signing import EXPIRES, SIGNATURE, SIGNED_FOR, UrlSigner

# What the signature covers in place of a path: these tokens open no archive URL.
_SIGNED_PATH = "/v2/token"
_PREFIX = "tfproxy."


def issue_token(signer: UrlSigner, token_name: str | None, binding: str | None,
                not_after: float | None = None) -> tuple[str, int]:
    """A bearer token for token_name (the credentials the client proved, whose binding is
    given; None for both with authentication off) and its lifetime in seconds; never valid
    past not_after (an OIDC token's own expiry)."""
    expires = signer.expiry()
    if not_after is not None:
        expires = min(expires, int(not_after))
    signed_for = None if binding is None else f"{binding}:{token_name or ''}"
    query = signer.query(_SIGNED_PATH, expires=expires, signed_for=signed_for)
    encoded = base64.urlsafe_b64encode(query.encode()).decode().rstrip("=")
    return _PREFIX + encoded, max(0, expires - int(time.time()))


def issued_token(signer: UrlSigner, presented: str,
                 bindings: Collection[str]) -> tuple[str, str] | None:
    """The binding and name of what an issued bearer token was given for, if it is one of
    ours, has not expired and what it was issued for is still configured (its binding is
    among bindings); None otherwise."""
    if not presented.startswith(_PREFIX) or len(presented) > 1024:
        return None
    encoded = presented[len(_PREFIX):]
    try:
        query = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    fields = parse_qs(query, keep_blank_values=True)
    expires, signature = fields.get(EXPIRES, [None])[0], fields.get(SIGNATURE, [None])[0]
    signed_for = fields.get(SIGNED_FOR, [None])[0]
    if not signer.valid(_SIGNED_PATH, expires, signature, signed_for=signed_for):
        return None
    binding, _, name = (signed_for or "").partition(":")
    return (binding, name) if binding in bindings else None
