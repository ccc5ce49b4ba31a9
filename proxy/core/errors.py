"""The error taxonomy: every error a client can see carries its HTTP status, and what the
operator or the user can do about it (`advice`: Terraform shows only the status, so the
proxy's log line has to say it)."""

from __future__ import annotations

from typing import Literal, get_args

from proxy.core.redaction import mask_secrets

# Why an artifact failed verification: the `kind` label of tfproxy_integrity_failures_total.
# signature: SHA256SUMS not signed by upstream's keys; sha256sums: the download document and
# SHA256SUMS disagree; checksum: the bytes are not the listed sha256; archive: not a valid
# zip; changed: upstream now describes a verified version differently; stored: a file in the
# cache no longer matches its verified checksum; hot_copy: a replica's local copy of a shared
# store's blob was written to since it was checked (dropped and fetched again from the store).
IntegrityKind = Literal["signature", "sha256sums", "checksum", "archive", "changed", "stored",
                        "hot_copy"]
INTEGRITY_KINDS: tuple[IntegrityKind, ...] = get_args(IntegrityKind)


class ProxyError(Exception):
    """Base of all errors that become a JSON error response."""

    status: int = 500
    advice: str = "a fault in the proxy: see the ERROR line with its traceback"

    def __init__(self, message: str) -> None:
        # Messages go to clients and logs, and often quote an upstream URL or git's output:
        # masked once here, whoever raised them.
        message = mask_secrets(message)
        super().__init__(message)
        self.message = message

    def audit_outcome(self) -> str | None:
        """The audit log's outcome word for this refusal, where the class says more than
        its type does (None: the audit log decides from the type)."""
        return None

    def audit_details(self) -> dict[str, object]:
        """More fields for the audit line of this refusal."""
        return {}


class BadRequest(ProxyError):
    """The client sent something malformed."""

    status = 400
    advice = ("fix the request: Terraform and OpenTofu never send it, a script or a "
              "hand-written URL did")


class Unauthorized(ProxyError):
    """The client did not authenticate (or its signed URL is invalid or expired)."""

    status = 401
    advice = ("give the client one of auth.tokens for the proxy's hostname (a credentials block "
              "or TF_TOKEN_<host>); an expired signed archive URL: run init again")


class Forbidden(ProxyError):
    """The client authenticated, but what it asks for is not allowed for its identity."""

    status = 403
    advice = ("the identity's rules (auth.tokens allow, auth.oidc rules) do not allow it: "
              "change the rules, or use an identity they allow")


class NotFound(ProxyError):
    """The proxy cannot serve this address (unknown host, provider, version or file)."""

    status = 404
    advice = ("check the address, the version and the platform against what the origin "
              "registry publishes (a typo in the source address, a yanked version)")


class UnknownVersion(NotFound):
    """The version asked for is not one the registry lists."""


class UpstreamNotFound(NotFound):
    """Upstream answered 404."""


class HostNotServed(NotFound):
    """The address names an upstream host the proxy does not serve (nor contact)."""

    advice = ("add the host to upstream.allowed_hosts (or an [upstream.hosts] table) in the "
              "proxy's config, or fix the source address")


class FilteredOut(NotFound):
    """The operator's [filters] leave this provider, module or platform out."""

    advice = ("the proxy's [filters] leave it out: change filters in its config, or use an "
              "allowed provider, module or platform")


class Offline(NotFound):
    """The proxy is in offline mode and does not hold what was asked for."""

    advice = ("the proxy is offline: warm this artifact on a connected machine "
              "(tf-registry-proxy warm/export) and import the bundle here")


class Unavailable(ProxyError):
    """The proxy cannot answer this right now; the same request may succeed later."""

    status = 503
    advice = "retry; if it lasts, check the cache's object store or disk (/readyz says why)"


class UpstreamError(ProxyError):
    """Upstream failed or answered something the proxy cannot use."""

    status = 502
    advice = ("the origin registry failed or cannot be reached: check its status and the "
              "proxy's outbound network (HTTPS_PROXY, DNS, upstream.ca_bundle), then retry; "
              "what is cached is still served")


class IntegrityError(UpstreamError):
    """Upstream bytes failed verification (checksum, SHA256SUMS entry or signature)."""

    advice = ("upstream's bytes did not verify and nothing was cached: do not work around it; "
              "retry later or report it to the provider's publisher")

    def __init__(self, kind: IntegrityKind, message: str, *, signed_by: str | None = None,
                 keys_tried: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.kind: IntegrityKind = kind
        # For a signature that does not verify: the key ID that made it, and those tried.
        self.signed_by = signed_by
        self.keys_tried = keys_tried


class UpstreamTimeout(UpstreamError):
    """Upstream did not answer in time."""

    status = 504
    advice = ("the origin registry answered too slowly: retry; if it is always slow, raise "
              "upstream.metadata_timeout or upstream.download_timeout")


class InsufficientStorage(ProxyError):
    """The cache's disk is full: an artifact could not be stored, so it cannot be served.
    507 says exactly that; clients retry it like any 5xx."""

    status = 507
    advice = ("the cache disk is full: free space, lower cache.max_size or run "
              "tf-registry-proxy prune")
