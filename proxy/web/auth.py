"""Optional client authentication. Metadata (mirror and module documents) needs a bearer
token; archives need a signed, expiring URL (which the metadata hands out) or a token;
health, readiness, discovery and metrics stay anonymous (clients treat a 401 on discovery as
fatal)."""

from __future__ import annotations

import hmac
import os
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from proxy.config.settings import AuthConfig
from proxy.core.errors import Unauthorized
from proxy.web.url_signing import EXPIRES, SIGNATURE, UrlSigner

SIGNER_KEY = web.AppKey("url_signer", UrlSigner)
_ANONYMOUS_ROUTES = frozenset({"healthz", "readyz", "discovery", "metrics"})
Authenticate = Callable[[web.Request], None]
_ARCHIVE_SUFFIXES = (".zip", ".tar.gz")
_KEY_BYTES = 32


class SigningKeyError(ValueError):
    """The URL signing key cannot be read or created: the proxy cannot start (the message
    names the file and what to do)."""


def load_signing_key(path: Path) -> bytes:
    """The URL signing key, created (0600) on first use; kept so that URLs handed out stay
    valid across restarts and are valid in every process sharing the state directory.
    Raises SigningKeyError if it is unusable."""
    try:
        try:
            return _read_signing_key(path)
        except FileNotFoundError:
            pass
        return _create_signing_key(path)
    except OSError as exc:
        raise SigningKeyError(f"cannot read or create the URL signing key {path}: "
                              f"{exc.strerror or exc}") from None


def _create_signing_key(path: Path) -> bytes:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # Several processes (workers) may get here at once. Each writes a whole key to its own
    # temp file and links it to the final name, which only the first one can do; everyone
    # then reads the key that won, and no reader ever sees half a key.
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(secrets.token_bytes(_KEY_BYTES))
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(temp, path)
        except FileExistsError:
            pass
    finally:
        os.unlink(temp)
    return _read_signing_key(path)


def _read_signing_key(path: Path) -> bytes:
    key = path.read_bytes()
    if len(key) < _KEY_BYTES:
        raise SigningKeyError(f"the URL signing key {path} holds {len(key)} bytes, not "
                              f"{_KEY_BYTES}: delete it to have a new one created (URLs "
                              "signed with the old one stop working)")
    return key


def _bearer_ok(request: web.Request, tokens: tuple[bytes, ...]) -> bool:
    header = request.headers.get("Authorization", "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not presented:
        return False
    given = presented.strip().encode()
    # Compare against every token, so the time taken does not say which one nearly matched.
    return sum(hmac.compare_digest(given, token) for token in tokens) > 0


def route_authentication(config: AuthConfig, route: str) -> Authenticate | None:
    """The check each request to route must pass (it raises Unauthorized); None where
    clients need not authenticate: authentication is off, or route is anonymous."""
    if not config.enabled or route in _ANONYMOUS_ROUTES:
        return None
    tokens = tuple(t.value.encode() for t in config.tokens)
    sums = route == "provider_sums"

    def authenticate(request: web.Request) -> None:
        if _bearer_ok(request, tokens):
            return
        if sums or request.path.endswith(_ARCHIVE_SUFFIXES):
            signer = request.app[SIGNER_KEY]
            if signer.valid(request.path, request.query.get(EXPIRES),
                            request.query.get(SIGNATURE)):
                return
            raise Unauthorized("this archive URL is not validly signed or has expired: ask "
                               "for the version document again")
        raise Unauthorized("a bearer token is required (Terraform: a credentials block or "
                           "TF_TOKEN_ variable for this proxy's hostname)")

    return authenticate
