"""OIDC identities: the signed token a CI job or a pod already holds (a JWT from GitHub
Actions, GitLab CI, a Kubernetes projected service-account token...) verified with PyJWT
against its issuer's published keys (`[[auth.oidc]]`): the signature (RS, PS, ES and EdDSA
algorithms only: `none` and the HMAC ones, which a public key would sign, are refused),
`iss`, `aud`, `exp`, `nbf` and `iat` with the provider's leeway. The first rule whose claims
all match says what the identity may pull (proxy.core.access); a token that matches none is
refused (403). Verified tokens are kept until they expire, so a job's requests verify once.

Keys come from a file (re-read when it changes: air-gapped networks carry the JWKS in) or a
URL (fetched through the egress policy, kept, and fetched again when a token names a key it
lacks, at most once a minute)."""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import jwt

from proxy.config.settings import OidcProvider
from proxy.core.access import Identity
from proxy.core.errors import Forbidden, Unauthorized
from proxy.core.executors import quick
from proxy.core.held import keep_recent
from proxy.core.singleflight import SingleFlight
from proxy.store.file_identity import FileIdentity, identity_of

log = logging.getLogger(__name__)

# Asymmetric algorithms only: a verifier that took HS256 would accept a token "signed" with
# the issuer's public key as the HMAC secret.
ALGORITHMS = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384",
              "ES512", "EdDSA")
MAX_TOKEN_BYTES = 16 * 1024
# A key set is fetched (or read) again for an unknown key ID at most this often.
REFRESH_SECONDS = 60.0
_VERIFIED_HELD = 4096
MAX_JWKS_BYTES = 1 << 20
# Fetches a JWKS URL: the body (raises ProxyError when it cannot).
Fetch = Callable[[str], Awaitable[bytes]]


class TokenRefused(Unauthorized):
    """A token that does not verify (401); result: the tfproxy_auth_total result."""

    def __init__(self, message: str, result: str = "invalid") -> None:
        super().__init__(message)
        self.result = result


class KeySet:
    """One provider's signing keys, from its file or URL."""

    def __init__(self, provider: OidcProvider, fetch: Fetch | None) -> None:
        self._provider = provider
        self._fetch = fetch
        self._keys: jwt.PyJWKSet | None = None
        self._file_seen: FileIdentity | None = None
        # Reads for want of a key are at most one a minute, so that random key IDs cost one
        # read a minute (the last read for a key ID it lacked), and so does a failing URL
        # (the last read that failed).
        self._refreshed_at = float("-inf")
        self._failed_at = float("-inf")
        self._loads: SingleFlight[jwt.PyJWKSet | None] = SingleFlight()

    async def key(self, key_id: str | None) -> jwt.PyJWK | None:
        """The key named key_id (the only one, when the token names none); looked up once
        more in a fresh copy of the set when it is not there (rate-limited)."""
        keys = await self._current()
        found = _pick(keys, key_id)
        if found is None and keys is not None and \
                time.monotonic() - self._refreshed_at >= REFRESH_SECONDS:
            self._refreshed_at = time.monotonic()
            found = _pick(await self._load(), key_id)
        return found

    async def _current(self) -> jwt.PyJWKSet | None:
        if self._provider.jwks_file is not None:
            seen = await quick(_file_identity, self._provider.jwks_file)
            if seen != self._file_seen:  # written since: rotation picked up at once
                return await self._load(seen)
        if self._keys is None and time.monotonic() - self._failed_at >= REFRESH_SECONDS:
            return await self._load()
        return self._keys

    async def _load(self, seen: FileIdentity | None = None) -> jwt.PyJWKSet | None:
        """The keys read again (requests at the same time share one read)."""
        return await self._loads.run("keys", lambda: self._read(seen))

    async def _read(self, seen: FileIdentity | None) -> jwt.PyJWKSet | None:
        provider = self._provider
        try:
            if provider.jwks_file is not None:
                self._file_seen = seen or await quick(_file_identity, provider.jwks_file)
                body = await quick(provider.jwks_file.read_bytes)
            else:
                assert self._fetch is not None and provider.jwks_url is not None
                body = await self._fetch(provider.jwks_url)
            self._keys = jwt.PyJWKSet.from_dict(json.loads(body))
        except Exception as exc:  # the old keys (if any) keep working
            self._failed_at = time.monotonic()
            log.warning("auth.oidc %r: cannot read its keys (%s): %s", provider.name,
                        provider.jwks_file or provider.jwks_url, exc)
        return self._keys


def _file_identity(path: os.PathLike[str]) -> FileIdentity | None:
    try:
        return identity_of(os.stat(path))
    except OSError:
        return None


def _pick(keys: jwt.PyJWKSet | None, key_id: str | None) -> jwt.PyJWK | None:
    if keys is None:
        return None
    if key_id is None:
        return keys.keys[0] if len(keys.keys) == 1 else None
    return next((key for key in keys.keys if key.key_id == key_id), None)


class OidcVerifier:
    """Verifies OIDC tokens against every configured provider."""

    def __init__(self, providers: tuple[OidcProvider, ...], fetch: Fetch | None = None) -> None:
        self._providers = providers
        self._keys = {provider.name: KeySet(provider, fetch) for provider in providers}
        # Verified tokens, by digest, with how long they stay good (exp and the leeway).
        self._verified: OrderedDict[bytes, tuple[Identity, float]] = OrderedDict()

    async def identify(self, token: str) -> Identity:
        """The identity token proves; TokenRefused (401) when it does not verify, Forbidden
        (403) when it does but matches no rule."""
        if len(token) > MAX_TOKEN_BYTES:
            raise TokenRefused("the token is longer than 16 KiB: refused unread")
        digest = hashlib.sha256(token.encode()).digest()
        held = self._verified.get(digest)
        if held is not None and time.time() < held[1]:
            return held[0]
        try:
            header = jwt.get_unverified_header(token)
            claims = jwt.decode(token, options={"verify_signature": False})
        except jwt.PyJWTError:
            raise TokenRefused("not a valid JWT") from None
        algorithm = header.get("alg")
        if algorithm not in ALGORITHMS:
            raise TokenRefused(f"tokens signed with {str(algorithm)[:20]!r} are refused "
                               f"(accepted: {', '.join(ALGORITHMS)})")
        issuer = claims.get("iss")
        providers = [p for p in self._providers if p.issuer == issuer]
        if not providers:
            raise TokenRefused(f"no auth.oidc provider trusts the issuer {str(issuer)[:120]!r}")
        failure: TokenRefused | None = None
        for provider in providers:
            try:
                identity = await self._verify(provider, token, header, algorithm)
            except TokenRefused as exc:
                failure = failure or exc
                continue
            assert identity.expires_at is not None
            keep_recent(self._verified, digest, (identity, identity.expires_at + provider.leeway),
                        _VERIFIED_HELD)
            return identity
        assert failure is not None
        raise failure

    async def _verify(self, provider: OidcProvider, token: str, header: dict[str, Any],
                      algorithm: str) -> Identity:
        key_id = header.get("kid")
        key = await self._keys[provider.name].key(key_id if isinstance(key_id, str) else None)
        if key is None:
            raise TokenRefused(f"auth.oidc {provider.name!r} has no key {str(key_id)[:64]!r} "
                               "(its key set was read again)")
        try:
            claims = jwt.decode(token, key.key, algorithms=[algorithm],
                                audience=list(provider.audiences), issuer=provider.issuer,
                                leeway=provider.leeway,
                                options={"require": ["exp", "iat", "iss", "aud"]})
        except jwt.ExpiredSignatureError:
            raise TokenRefused(f"the {provider.name} token has expired", "expired") from None
        except jwt.ImmatureSignatureError:
            raise TokenRefused(f"the {provider.name} token is not valid yet (nbf or iat in "
                               "the future)") from None
        except jwt.InvalidAudienceError:
            raise TokenRefused(f"the {provider.name} token is not for this proxy (aud is "
                               f"not one of {', '.join(provider.audiences)})") from None
        except jwt.PyJWTError as exc:
            raise TokenRefused(f"the {provider.name} token does not verify: {exc}") from None
        return _admitted(provider, claims)


def rule_label(provider: OidcProvider, number: int) -> str:
    """How an identity names the rule that admitted it (OCI tokens issued to it are bound
    to this text)."""
    return f"auth.oidc {provider.name!r} rule {number}"


def _admitted(provider: OidcProvider, claims: dict[str, Any]) -> Identity:
    """The identity of verified claims under the first rule they match; Forbidden if none."""
    subject = str(claims.get("sub", ""))
    for number, rule in enumerate(provider.rules, 1):
        values = {name: _claim_text(claims.get(name)) for name in rule.claims}
        if all(value is not None and fnmatch.fnmatchcase(value, pattern)
               for value, pattern in zip(values.values(), rule.claims.values(), strict=True)):
            return Identity(name=f"{provider.name}:{subject}"[:200], method="oidc",
                            rules=rule_label(provider, number),
                            allow=rule.allow, issuer=provider.issuer, subject=subject,
                            claims={k: v for k, v in values.items() if v is not None},
                            expires_at=float(claims["exp"]))
    raise Forbidden(f"the {provider.name} token of {subject[:120]!r} matches no rule of "
                    f"auth.oidc {provider.name!r}: it may pull nothing")


def _claim_text(value: object) -> str | None:
    """A claim as a string rules can match (booleans and numbers as JSON writes them)."""
    if isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        return json.dumps(value)
    return None


def looks_like_jwt(value: str) -> bool:
    """Whether value has a JWT's shape (three base64url parts), not a static token's."""
    with contextlib.suppress(ValueError):
        head, payload, _signature = value.split(".")
        return bool(head) and bool(payload) and head.startswith("eyJ")
    return False
