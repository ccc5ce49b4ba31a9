"""Optional client authentication. Metadata (mirror and module documents) needs a bearer
token (a static token of auth.tokens, or an OIDC token: proxy.web.oidc); archives need a
signed, expiring URL (which the metadata hands out) or a token; health, readiness, discovery
and metrics stay anonymous (clients treat a 401 on discovery as fatal). What an identity may
pull follows its rule (proxy.core.access): anything else is a 403 before it is looked up."""

from __future__ import annotations

import base64
import binascii
import hmac
import os
import secrets
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path

from aiohttp import web

from proxy.config.settings import AuthConfig
from proxy.core.access import Identity, pull_target
from proxy.core.errors import Forbidden, Unauthorized
from proxy.web.artifacts import named_artifact
from proxy.web.oci_tokens import issued_token
from proxy.web.oidc import OidcVerifier, TokenRefused, looks_like_jwt, rule_label
from proxy.web.url_signing import EXPIRES, SIGNATURE, SIGNED_FOR, UrlSigner

SIGNER_KEY = web.AppKey("url_signer", UrlSigner)
# The name of the token a request authenticated with (never the token: see AuthConfig).
TOKEN_NAME_KEY = web.RequestKey("token_name", str)
# The binding (UrlSigner.binding) of the token a request authenticated with.
TOKEN_BINDING_KEY = web.RequestKey("token_binding", str)
# Who the request authenticated as, and what it may pull (absent: a signed archive URL).
IDENTITY_KEY = web.RequestKey("identity", Identity)
OIDC_KEY = web.AppKey("oidc_verifier", OidcVerifier)
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
Authenticate = Callable[[web.Request], Awaitable[None]]
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


def _presented(request: web.Request, basic: bool) -> str | None:
    """The credential the request presents: a bearer token, or (where basic) the password of
    Basic credentials (any user name); None if none."""
    scheme, _, value = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        return value.strip()
    if basic and scheme.lower() == "basic" and value.strip():
        try:
            _user, _, given = base64.b64decode(value.strip(), validate=True).partition(b":")
            return given.decode()
        except (binascii.Error, ValueError):
            return None
    return None


def _index_of(given: bytes, tokens: tuple[bytes, ...]) -> int | None:
    # Compare against every token, so the time taken does not say which one nearly matched.
    matches = [hmac.compare_digest(given, token) for token in tokens]
    return matches.index(True) if True in matches else None


def static_identity(config: AuthConfig, index: int) -> Identity:
    """The identity of the static token at index."""
    name = config.name_of(index)
    return Identity(name=name, method="token", rules=f"auth.tokens {name!r}",
                    allow=config.allow_of(index))


def _rule_binding(signer: UrlSigner, identity: Identity) -> str:
    """What an OCI token issued to an OIDC identity carries: a MAC of the rule that admitted
    it, so that it stops working once that rule changes."""
    return signer.binding(f"oidc\n{identity.rules}\n{identity.allow}".encode())


class Authenticator:
    """Who a request is (IDENTITY_KEY, TOKEN_NAME_KEY), from a static token, an OIDC token
    (OIDC_KEY), an OCI token issued by /v2/token, or a signed archive URL; and whether that
    identity may pull what the route names. Counts tfproxy_auth_total{method,result}."""

    def __init__(self, config: AuthConfig, count: Callable[[str, str], None]) -> None:
        self._config = config
        self._tokens = tuple(t.value.encode() for t in config.tokens)
        self._count = count
        # The identities OCI tokens may be issued to, by binding: made once per URL signer.
        self._issuable: tuple[UrlSigner, dict[str, Identity]] | None = None

    def for_route(self, route: str) -> Authenticate | None:
        """The check each request to route must pass; None where clients need not
        authenticate: authentication is off, or route is anonymous."""
        if not self._config.enabled or route in _ANONYMOUS_ROUTES:
            return None
        sums = route == "provider_sums"
        oci = route in OCI_ROUTES
        release = route in RELEASE_ROUTES
        basic = route in BASIC_ROUTES or oci or release

        async def authenticate(request: web.Request) -> None:
            identity = await self._identity(request, basic)
            if identity is None and oci and route != "oci_token":
                identity = self._issued(request)
            if identity is not None:
                return
            if oci:
                self._count("token", "missing")
                raise Unauthorized("credentials are required: log in with any user name and "
                                   "one of the proxy's tokens (or an OIDC token) as password")
            if sums or (not release and request.path.endswith(_ARCHIVE_SUFFIXES)):
                self._signed(request)
                return
            self._count("token", "missing")
            if basic:
                raise Unauthorized("a token is required: a bearer token, or in a browser the "
                                   "token as the password (any user name)")
            raise Unauthorized("a bearer token is required (Terraform: a credentials block "
                               "or TF_TOKEN_ variable for this proxy's hostname)")

        return authenticate

    async def _identity(self, request: web.Request, basic: bool) -> Identity | None:
        """The identity a static or OIDC token presented proves; None if none is presented
        (or one that is neither). Raises Unauthorized or Forbidden for an OIDC token that
        does not verify or matches no rule."""
        presented = _presented(request, basic)
        if presented is None:
            return None
        signer = request.app[SIGNER_KEY]
        index = _index_of(presented.encode(), self._tokens)
        if index is not None:
            identity = static_identity(self._config, index)
            request[TOKEN_BINDING_KEY] = signer.binding(self._tokens[index])
        else:
            verifier = request.app.get(OIDC_KEY)
            if verifier is None or not looks_like_jwt(presented):
                return None
            try:
                identity = await verifier.identify(presented)
            except TokenRefused as exc:
                self._count("oidc", exc.result)
                raise
            except Forbidden:
                self._count("oidc", "forbidden")
                raise
            request[TOKEN_BINDING_KEY] = _rule_binding(signer, identity)
        self._count(identity.method, "ok")
        request[IDENTITY_KEY] = identity
        request[TOKEN_NAME_KEY] = identity.name
        return identity

    def _issued(self, request: web.Request) -> Identity | None:
        """The identity an OCI bearer token issued by /v2/token was given to, if the request
        presents one that is still valid, for a token or rule still configured."""
        scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer":
            return None
        signer = request.app[SIGNER_KEY]
        known = self._issuable_to(signer)
        issued = issued_token(signer, presented.strip(), known.keys())
        if issued is None:
            return None
        binding, name = issued
        identity = replace(known[binding], name=name or known[binding].name, method="issued")
        self._count("issued", "ok")
        request[IDENTITY_KEY] = identity
        if name:
            request[TOKEN_NAME_KEY] = name
        return identity

    def _issuable_to(self, signer: UrlSigner) -> dict[str, Identity]:
        """Every static token's identity and every OIDC rule's, by the binding an OCI token
        issued to it carries."""
        if self._issuable is not None and self._issuable[0] is signer:
            return self._issuable[1]
        known = {signer.binding(token): static_identity(self._config, index)
                 for index, token in enumerate(self._tokens)}
        for provider in self._config.oidc:
            for number, rule in enumerate(provider.rules, 1):
                admitted = Identity(name="", method="oidc", rules=rule_label(provider, number),
                                    allow=rule.allow)
                known[_rule_binding(signer, admitted)] = admitted
        self._issuable = (signer, known)
        return known

    def _signed(self, request: web.Request) -> None:
        """A signed archive URL (clients send no credentials there): valid, or 401."""
        signer = request.app[SIGNER_KEY]
        signed_for = request.query.get(SIGNED_FOR)
        if signer.valid(request.path, request.query.get(EXPIRES),
                        request.query.get(SIGNATURE), signed_for=signed_for):
            self._count("signed_url", "ok")
            if signed_for:
                request[TOKEN_NAME_KEY] = signed_for
            return
        self._count("signed_url", "invalid")
        raise Unauthorized("this archive URL is not validly signed or has expired: ask for "
                           "the version document again")


def check_allowed(request: web.Request, route: str) -> None:
    """Forbidden when the request's identity may not pull what route names (its allow
    list); nothing for an identity that may pull everything, or a signed archive URL (the
    document that handed it out was allowed)."""
    identity = request.get(IDENTITY_KEY)
    if identity is None or identity.allow is None:
        return
    named = named_artifact(route, request.match_info)
    if named is None:
        return
    artifact = named.artifact
    target = pull_target(artifact.kind, artifact.host, artifact.namespace, artifact.name)
    if not identity.may_pull(target):
        raise Forbidden(f"{identity.name} may not pull {target}: {identity.rules} allows "
                        f"only {', '.join(identity.allow) or 'nothing'}")
