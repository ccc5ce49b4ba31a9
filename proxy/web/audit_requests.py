"""Audit lines for the requests that name an artifact: who asked (client address, token
name) for the work the request starts, a `served` line per package or module archive sent,
and a `refused` line per error answer. Requests whose path names no valid artifact are left
to the access log."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler

from proxy.core.audit import (
    REQUESTER,
    SERVED_FACTS,
    Artifact,
    AuditLog,
    Requester,
    ServedFacts,
    refusal,
)
from proxy.core.errors import BadRequest, IntegrityError, ProxyError
from proxy.core.models import (
    ModuleAddress,
    Platform,
    ProviderAddress,
    parse_module_version,
    parse_version,
)
from proxy.web.access_log import CACHE_RESULT_KEY
from proxy.web.auth import TOKEN_NAME_KEY

# What a served archive's answer may be: whole, a range, or a redirect to the stored object.
_SENT = (200, 206, 302)


def _provider(info: web.UrlMappingMatchInfo) -> ProviderAddress:
    return ProviderAddress.parse(info["hostname"], info["namespace"], info["type"])


def _module(info: web.UrlMappingMatchInfo) -> ModuleAddress:
    return ModuleAddress.parse(info["hostname"], info["namespace"], info["name"],
                               info["system"])


def _mirror(info: web.UrlMappingMatchInfo) -> tuple[Artifact, bool]:
    provider, name = _provider(info), info["name"]
    if name.endswith(".zip"):
        version, platform = provider.parse_archive_filename(name)
        return Artifact.provider(provider, version, platform), True
    if name.endswith(".json") and name != "index.json":
        return Artifact.provider(provider, parse_version(name.removesuffix(".json"))), False
    return Artifact.provider(provider), False


def _download(info: web.UrlMappingMatchInfo) -> tuple[Artifact, bool]:
    return Artifact.provider(_provider(info), parse_version(info["version"]),
                             Platform.parse(info["os"], info["arch"])), False


def _module_file(info: web.UrlMappingMatchInfo) -> tuple[Artifact, bool]:
    module = _module(info)
    version = parse_module_version(info["version"])
    archive = info["action"] == f"{module.name}-{module.system}-{version}.tar.gz"
    return Artifact.module(module, version), archive


# Per route: the artifact its path names, and whether the answer is that artifact's file.
_IDENTIFY: dict[str, Callable[[web.UrlMappingMatchInfo], tuple[Artifact, bool]]] = {
    "mirror": _mirror,
    "provider_versions": lambda info: (Artifact.provider(_provider(info)), False),
    "provider_download": _download,
    "provider_sums": lambda info: (Artifact.provider(_provider(info),
                                                     parse_version(info["version"])), False),
    "module_versions": lambda info: (Artifact.module(_module(info)), False),
    "module": _module_file,
}


def audited(route: str, handler: Handler, audit: AuditLog) -> Handler:
    """handler, writing the audit lines of route's requests (handler itself when the audit
    log is off, or route names no artifact)."""
    identify = _IDENTIFY.get(route)
    if not audit.enabled or identify is None:
        return handler

    def artifact(request: web.Request) -> tuple[Artifact, bool] | None:
        try:
            return identify(request.match_info)
        except BadRequest:  # names no valid artifact
            return None

    async def wrapped(request: web.Request) -> web.StreamResponse:
        requester = Requester(request.remote, request.get(TOKEN_NAME_KEY))
        # Fills this request starts carry it along (the first requester of a fill).
        current = REQUESTER.set(requester)
        facts = ServedFacts()
        current_facts = SERVED_FACTS.set(facts)
        try:
            response = await handler(request)
        except ProxyError as exc:
            named = artifact(request)
            if named is not None:
                audit.record("refused", named[0], outcome=refusal(exc), requester=requester,
                             status=exc.status, reason=exc.message,
                             cache=request.get(CACHE_RESULT_KEY),
                             **_signature_details(exc))
            raise
        finally:
            SERVED_FACTS.reset(current_facts)
            REQUESTER.reset(current)
        if request.method == "GET" and response.status in _SENT:
            named = artifact(request)
            if named is not None and named[1]:
                audit.record("served", named[0], requester=requester, status=response.status,
                             bytes=response.content_length,
                             cache=request.get(CACHE_RESULT_KEY), sha256=facts.sha256,
                             key_id=facts.key_id)
        return response

    return wrapped


def _signature_details(exc: ProxyError) -> dict[str, object]:
    """A failed signature check's key IDs: the one that signed, the ones tried."""
    if not isinstance(exc, IntegrityError) or not exc.keys_tried:
        return {}
    return {"key_id": exc.signed_by, "keys_tried": list(exc.keys_tried)}
