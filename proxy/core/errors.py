"""The error taxonomy: every error a client can see carries its HTTP status."""

from __future__ import annotations

from typing import Literal, get_args

from proxy.core.redaction import mask_secrets

# Why an artifact failed verification: the `kind` label of tfproxy_integrity_failures_total.
# signature: SHA256SUMS not signed by upstream's keys; sha256sums: the download document and
# SHA256SUMS disagree; checksum: the bytes are not the listed sha256; archive: not a valid
# zip; changed: upstream now describes a verified version differently; stored: a file in the
# cache no longer matches its verified checksum.
IntegrityKind = Literal["signature", "sha256sums", "checksum", "archive", "changed", "stored"]
INTEGRITY_KINDS: tuple[IntegrityKind, ...] = get_args(IntegrityKind)


class ProxyError(Exception):
    """Base of all errors that become a JSON error response."""

    status: int = 500

    def __init__(self, message: str) -> None:
        # Messages go to clients and logs, and often quote an upstream URL or git's output:
        # masked once here, whoever raised them.
        message = mask_secrets(message)
        super().__init__(message)
        self.message = message


class BadRequest(ProxyError):
    """The client sent something malformed."""

    status = 400


class Unauthorized(ProxyError):
    """The client did not authenticate (or its signed URL is invalid or expired)."""

    status = 401


class NotFound(ProxyError):
    """The proxy cannot serve this address (unknown host, provider, version or file)."""

    status = 404


class UpstreamNotFound(NotFound):
    """Upstream answered 404."""


class Offline(NotFound):
    """The proxy is in offline mode and does not hold what was asked for."""


class Unavailable(ProxyError):
    """The proxy cannot answer this right now; the same request may succeed later."""

    status = 503


class UpstreamError(ProxyError):
    """Upstream failed or answered something the proxy cannot use."""

    status = 502


class IntegrityError(UpstreamError):
    """Upstream bytes failed verification (checksum, SHA256SUMS entry or signature)."""

    def __init__(self, kind: IntegrityKind, message: str) -> None:
        super().__init__(message)
        self.kind: IntegrityKind = kind


class UpstreamTimeout(UpstreamError):
    """Upstream did not answer in time."""

    status = 504


class InsufficientStorage(ProxyError):
    """The cache's disk is full: an artifact could not be stored, so it cannot be served.
    507 says exactly that; clients retry it like any 5xx."""

    status = 507
