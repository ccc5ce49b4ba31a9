"""Audit lines for the requests that name an artifact: who asked (client address, token
name) for the work the request starts, a `served` line per package or module archive sent,
and a `refused` line per error answer. Requests whose path names no valid artifact are left
to the access log."""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler

from proxy.core.audit import (
    REQUESTER,
    SERVED_FACTS,
    AuditLog,
    Requester,
    ServedFacts,
    refusal,
)
from proxy.core.errors import IntegrityError, ProxyError
from proxy.web.access_log import CACHE_RESULT_KEY
from proxy.web.artifacts import ARTIFACT_ROUTES, Named, named_artifact
from proxy.web.auth import IDENTITY_KEY, TOKEN_NAME_KEY

# What a served archive's answer may be: whole, a range, or a redirect to the stored object.
_SENT = (200, 206, 302)


def audited(route: str, handler: Handler, audit: AuditLog) -> Handler:
    """handler, writing the audit lines of route's requests (handler itself when the audit
    log is off, or route names no artifact)."""
    if not audit.enabled or route not in ARTIFACT_ROUTES:
        return handler

    def artifact(request: web.Request) -> Named | None:
        return named_artifact(route, request.match_info)

    async def wrapped(request: web.Request) -> web.StreamResponse:
        requester = requester_of(request)
        # Fills this request starts carry it along (the first requester of a fill).
        current = REQUESTER.set(requester)
        facts = ServedFacts()
        current_facts = SERVED_FACTS.set(facts)
        try:
            response = await handler(request)
        except ProxyError as exc:
            named = artifact(request)
            if named is not None:
                audit.record("refused", named.artifact, outcome=refusal(exc), requester=requester,
                             status=exc.status, reason=exc.message,
                             cache=request.get(CACHE_RESULT_KEY),
                             **_signature_details(exc), **exc.audit_details())
            raise
        finally:
            SERVED_FACTS.reset(current_facts)
            REQUESTER.reset(current)
        if request.method == "GET" and response.status in _SENT:
            named = artifact(request)
            if named is not None and named.is_file:
                audit.record("served", facts.artifact or named.artifact, requester=requester,
                             status=response.status, bytes=response.content_length,
                             cache=request.get(CACHE_RESULT_KEY), sha256=facts.sha256,
                             key_id=facts.key_id)
        return response

    return wrapped


def requester_of(request: web.Request) -> Requester:
    """Who sent request, as audit lines name them."""
    identity = request.get(IDENTITY_KEY)
    return Requester(request.remote, request.get(TOKEN_NAME_KEY),
                     None if identity is None else identity.audit_details())


def _signature_details(exc: ProxyError) -> dict[str, object]:
    """A failed signature check's key IDs: the one that signed, the ones tried."""
    if not isinstance(exc, IntegrityError) or not exc.keys_tried:
        return {}
    return {"key_id": exc.signed_by, "keys_tried": list(exc.keys_tried)}
