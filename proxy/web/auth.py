"""Optional client authentication. Metadata (mirror and module documents) needs a bearer
token; archives need a signed, expiring URL (which the metadata hands out) or a token;
health, readiness, discovery and metrics stay anonymous (clients treat a 401 on discovery as
fatal)."""

from __future__ import annotations

import base64
import binascii
import hmac
import os
import secrets
import tempfile
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from proxy.config.settings import AuthConfig
from proxy.core.errors import Unauthorized
from proxy.web.oci_tokens import issued_token_name
from proxy.web.url_signing import EXPIRES, SIGNATURE, SIGNED_FOR, UrlSigner

SIGNER_KEY = web.AppKey("url_signer", UrlSigner)
# The name of the token a request authenticated with (never the token: see AuthConfig).
TOKEN_NAME_KEY = web.RequestKey("token_name", str)
# The binding (UrlSigner.binding) of the token a request authenticated with.
TOKEN_BINDING_KEY = web.RequestKey("token_binding", str)
# The release keys are public keys: tenv fetches a key URL without the credentials it sends
# to the remote (TFENV_HASHICORP_PGP_KEY, TOFUENV_OPENTOFU_PGP_KEY).
_ANONYMOUS_ROUTES = frozenset({"healthz", "readyz", "discovery", "metrics", "releases_keys"})
# Pages for people: a browser cannot send a bearer token, but asks for a user name and
# password when challenged with Basic; the password is the token.
BASIC_ROUTES = frozenset({"status_page", "status_json", "status_cache", "status_cache_json"})
# The OCI distribution API: registry clients and pull-through caches log in with a user name
# and password (the token, as Basic or through the token flow at /v2/token: oci_tokens).
OCI_ROUTES = frozenset({"oci_base", "oci_token", "oci_tags", "oci_manifest", "oci_blob",
                        "oci_module_tags", "oci_module_manifest", "oci_module_blob"})
# The CLI releases mirror: version managers send Basic credentials (tenv's TFENV_REMOTE_USER
# and _PASSWORD, a user:password@ in the remote URL) or a bearer token; no signed URLs.
RELEASE_ROUTES = frozenset({"releases_keys", "releases_list", "releases_index",
                            "releases_version", "releases_version_index", "releases_file",
                            "releases_tofu_list", "releases_tofudl", "releases_tofu_file"})
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


def _bearer_match(request: web.Request, tokens: tuple[bytes, ...]) -> int | None:
    """The index of the token the request presents, None if none."""
    header = request.headers.get("Authorization", "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() != "bearer" or not presented:
        return None
    return _index_of(presented.strip().encode(), tokens)


def _index_of(given: bytes, tokens: tuple[bytes, ...]) -> int | None:
    # Compare against every token, so the time taken does not say which one nearly matched.
    matches = [hmac.compare_digest(given, token) for token in tokens]
    return matches.index(True) if True in matches else None


def _basic_match(request: web.Request, tokens: tuple[bytes, ...]) -> int | None:
    """The index of the token given as a Basic password (any user name), None if none."""
    header = request.headers.get("Authorization", "")
    scheme, _, encoded = header.partition(" ")
    if scheme.lower() != "basic" or not encoded:
        return None
    try:
        _user, _, given = base64.b64decode(encoded.strip(), validate=True).partition(b":")
    except (binascii.Error, ValueError):
        return None
    return _index_of(given, tokens)


def _token_ok(request: web.Request, tokens: tuple[bytes, ...], config: AuthConfig,
              basic: bool = False) -> bool:
    """Whether the request presents one of tokens (as a bearer token, or as a Basic password
    where basic); notes its name on the request."""
    index = _bearer_match(request, tokens)
    if index is None and basic:
        index = _basic_match(request, tokens)
    if index is None:
        return False
    request[TOKEN_NAME_KEY] = config.name_of(index)
    request[TOKEN_BINDING_KEY] = request.app[SIGNER_KEY].binding(tokens[index])
    return True


def _issued_token_ok(request: web.Request, tokens: tuple[bytes, ...]) -> bool:
    """Whether the request presents a bearer token issued by /v2/token (still valid, for a
    token still configured); notes the name of the token it was issued for."""
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return False
    signer = request.app[SIGNER_KEY]
    name = issued_token_name(signer, presented.strip(),
                             frozenset(signer.binding(token) for token in tokens))
    if name is None:
        return False
    if name:
        request[TOKEN_NAME_KEY] = name
    return True


def route_authentication(config: AuthConfig, route: str) -> Authenticate | None:
    """The check each request to route must pass (it raises Unauthorized); None where
    clients need not authenticate: authentication is off, or route is anonymous."""
    if not config.enabled or route in _ANONYMOUS_ROUTES:
        return None
    tokens = tuple(t.value.encode() for t in config.tokens)
    sums = route == "provider_sums"
    oci = route in OCI_ROUTES
    release = route in RELEASE_ROUTES
    basic = route in BASIC_ROUTES or oci or release

    def authenticate(request: web.Request) -> None:
        if _token_ok(request, tokens, config, basic):
            return
        if oci:
            if route != "oci_token" and _issued_token_ok(request, tokens):
                return
            raise Unauthorized("credentials are required: log in with any user name and one "
                               "of the proxy's tokens as the password")
        if sums or (not release and request.path.endswith(_ARCHIVE_SUFFIXES)):
            signer = request.app[SIGNER_KEY]
            signed_for = request.query.get(SIGNED_FOR)
            if signer.valid(request.path, request.query.get(EXPIRES),
                            request.query.get(SIGNATURE), signed_for=signed_for):
                if signed_for:
                    request[TOKEN_NAME_KEY] = signed_for
                return
            raise Unauthorized("this archive URL is not validly signed or has expired: ask "
                               "for the version document again")
        if basic:
            raise Unauthorized("a token is required: a bearer token, or in a browser the "
                               "token as the password (any user name)")
        raise Unauthorized("a bearer token is required (Terraform: a credentials block or "
                           "TF_TOKEN_ variable for this proxy's hostname)")

    return authenticate
