"""HTTP handlers: path parameters -> models -> service call -> response."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from proxy.config import Config
from proxy.core.access import pull_target
from proxy.core.audit import NO_AUDIT, Artifact, AuditLog
from proxy.core.errors import Forbidden, NotFound
from proxy.core.executors import quick
from proxy.core.held import Derived
from proxy.core.json_bodies import JsonBody, json_body
from proxy.core.metrics import CONTENT_TYPE_LATEST, Metrics
from proxy.core.models import (
    ModuleAddress,
    Platform,
    ProviderAddress,
    parse_module_version,
    parse_version,
)
from proxy.protocols.inventory import Inventory
from proxy.protocols.module_registry import ModuleRegistry
from proxy.protocols.network_mirror import ProviderMirror
from proxy.protocols.provider_registry import ProviderRegistryService
from proxy.protocols.status import StatusReport
from proxy.protocols.version_policy import VersionPolicy, module_target, provider_target
from proxy.store.protocol import BlobStore
from proxy.verification.packages import SUMS_ID
from proxy.web.artifacts import ARTIFACT_ROUTES, named_artifact
from proxy.web.audit_requests import audited, requester_of
from proxy.web.auth import IDENTITY_KEY, SIGNER_KEY, TOKEN_NAME_KEY, check_allowed
from proxy.web.middleware import UNMATCHED, ErrorShape, Guard, json_error
from proxy.web.pulls import counted
from proxy.web.quick_answers import QuickAnswers
from proxy.web.responses import json_body_response, json_response, send_file
from proxy.web.status_page import (
    CONTENT_SECURITY_POLICY,
    render_inventory_page,
    render_status_page,
)
from proxy.web.url_signing import UrlSigner

log = logging.getLogger(__name__)
MIRROR_PREFIX = "/mirror/"
MODULES_PREFIX = "/modules/"
PROVIDERS_PREFIX = "/providers/"
METRICS_KEY = web.AppKey("metrics", Metrics)
MIRROR_KEY = web.AppKey("provider_mirror", ProviderMirror)
MODULES_KEY = web.AppKey("module_registry", ModuleRegistry)
REGISTRY_KEY = web.AppKey("provider_registry", ProviderRegistryService)
ARCHIVES_KEY = web.AppKey("archives", BlobStore)
CONFIG_KEY = web.AppKey("config", Config)
AUDIT_KEY = web.AppKey("audit_log", AuditLog)
STATUS_KEY = web.AppKey("status_report", StatusReport)
INVENTORY_KEY = web.AppKey("inventory", Inventory)
POLICY_KEY = web.AppKey("version_policy", VersionPolicy)
# Answers that are a held document plus the request's own signed URLs or base URL.
BODIES_KEY = web.AppKey("request_bodies", Derived[JsonBody])
# Answers kept by path, served before routing (absent where clients authenticate).
QUICK_KEY = web.AppKey("quick_answers", QuickAnswers)
_HELD_BODIES = 4096
_PAGE_NUMBER = re.compile(r"[0-9]{1,6}")  # ASCII digits only
# What adds one GET (and HEAD) route: path, handler, name, and how its errors are answered.
RouteAdder = Callable[[str, Handler, str, ErrorShape | None], None]
# The routes whose answers stream a file: a failure mid-body cuts them off (aborted_responses).
FILE_ROUTES = ("mirror", "module", "oci_blob", "oci_module_blob", "releases_file",
               "releases_tofu_file")


async def healthz(_request: web.Request) -> web.Response:
    """Liveness: the process answers."""
    return json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    """Readiness: the configuration is loaded and this replica's cache directory takes writes
    (and, after its disk filled up, has room again for what did not fit). A shared store
    (S3) that cannot be reached leaves it ready, degraded: what this replica holds is still
    served, and a dependency every replica shares must not take them all out of service at
    once (misses then get a 503 naming the store)."""
    if ARCHIVES_KEY not in request.app:
        return _still_starting()
    archives = request.app[ARCHIVES_KEY]
    problem = await quick(archives.health_problem)
    if problem:
        return json_response({"errors": [problem]}, status=503)
    store = archives.store_problem()
    if store:
        return json_response({"status": "degraded", "store": "unreachable", "problem": store})
    return json_response({"status": "ready"})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus exposition."""
    archives = request.app.get(ARCHIVES_KEY)
    if archives is not None:  # the cache's size as every process sharing it left it
        await quick(archives.reread_usage)
    body = request.app[METRICS_KEY].render()
    response = web.Response(body=body)
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


async def status_json(request: web.Request) -> web.Response:
    """The status document, for scripts (fields: README, "Status page")."""
    report = request.app.get(STATUS_KEY)
    if report is None:
        return _still_starting()
    return _fresh_json(await report.document())


async def inventory_json(request: web.Request) -> web.Response:
    """What the cache holds, one page (`q`: a search, `page`: from 1), for scripts."""
    inventory = request.app.get(INVENTORY_KEY)
    if inventory is None:
        return _still_starting()
    return _fresh_json(await inventory.page(*_inventory_query(request)))


async def inventory_page(request: web.Request) -> web.Response:
    """What the cache holds, as a page for people: searched and paged on the server."""
    inventory = request.app.get(INVENTORY_KEY)
    if inventory is None:
        return _still_starting()
    return _page(render_inventory_page(await inventory.page(*_inventory_query(request))))


def _still_starting() -> web.Response:
    return json_response({"errors": ["still starting"]}, status=503)


def _fresh_json(document: dict[str, Any]) -> web.Response:
    """A document of the proxy's state now: never kept by a cache on the way."""
    response = json_response(document)
    response.headers["Cache-Control"] = "no-store"
    return response


def _inventory_query(request: web.Request) -> tuple[str, int]:
    number = request.query.get("page", "1")
    return request.query.get("q", ""), int(number) if _PAGE_NUMBER.fullmatch(number) else 1


def _page(html: str) -> web.Response:
    response = web.Response(text=html, content_type="text/html", charset="utf-8")
    response.headers.update({"Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
                             "Content-Security-Policy": CONTENT_SECURITY_POLICY,
                             "Referrer-Policy": "no-referrer"})
    return response


async def status_page(request: web.Request) -> web.Response:
    """The status document as a page for people."""
    report = request.app.get(STATUS_KEY)
    if report is None:
        return _still_starting()
    return _page(render_status_page(await report.document()))


async def mirror_file(request: web.Request) -> web.StreamResponse:
    """`:hostname/:namespace/:type/(index.json | VERSION.json | package.zip)`."""
    info = request.match_info
    provider = ProviderAddress.parse(info["hostname"], info["namespace"], info["type"])
    name = info["name"]
    app = request.app
    mirror = app[MIRROR_KEY]
    if name == "index.json":
        body = await mirror.list_versions_body(provider)
        _tell_hidden(request, "provider", str(provider), provider_target(provider))
        return _held_answer(request, "mirror", body)
    if name.endswith(".json"):
        version = parse_version(name.removesuffix(".json"))
        signer = app.get(SIGNER_KEY)
        if signer is None:
            body = await mirror.version_document_body(provider, version)
            return _held_answer(request, "mirror", body,
                                held=mirror.holds_document(provider, version, body))
        # Archives are fetched without credentials: each answer carries its own signed URLs,
        # for the path as this client spelled it (what its archive requests will be).
        document = await mirror.version_document(provider, version)
        expires = _expiry(request, signer)
        directory = request.path.rsplit("/", 1)[0]
        return json_body_response(request, _request_body(
            request, (request.path, request.get(TOKEN_NAME_KEY)), document, expires,
            lambda: _with_signed_archives(request, document, directory, expires)))
    if name.endswith(".zip"):
        return await send_file(request, lambda: mirror.archive(provider, name),
                               "application/zip", app[ARCHIVES_KEY],
                               app[METRICS_KEY].served_bytes.labels("package"))
    raise NotFound(f"no such mirror document {name[:120]!r}")


def _held_answer(request: web.Request, route: str, document: JsonBody,
                 held: bool = True) -> web.Response:
    """The answer of a document that depends on nothing but the request's path (no
    credentials, no signed URLs), kept to answer that path again before routing while it is
    held (one that is not is built again for the next request) and no version policy is in
    force (a policy's answers change with time)."""
    quick = request.app.get(QUICK_KEY)
    if quick is not None and held:
        policy = request.app.get(POLICY_KEY)
        if policy is None or not policy.config.active:
            quick.keep(request, route, document)
    return json_body_response(request, document)


def _expiry(request: web.Request, signer: UrlSigner) -> int:
    """When the URLs signed for this request expire: a URL handed to an identity whose
    token expires (OIDC) does not outlive it by more than auth.signed_url_ttl."""
    identity = request.get(IDENTITY_KEY)
    return signer.expiry(credential_expires=None if identity is None
                         else identity.expires_at)


def _request_body(request: web.Request, key: Hashable, source: object, tag: Hashable,
                  build: Callable[[], dict[str, Any]]) -> JsonBody:
    """The answer for key, built from the held document source by build() (once per source
    and tag, e.g. the expiry signed into it). key names everything else that goes into it."""
    bodies = request.app[BODIES_KEY]
    held = bodies.get(key, source, tag)
    return held if held is not None else bodies.put(key, source, json_body(build()), tag)


def _with_signed_archives(request: web.Request, document: dict[str, Any], directory: str,
                          expires: int) -> dict[str, Any]:
    """A VERSION.json document whose archive URLs (relative to directory) are signed until
    expires; document itself is left as it is."""
    archives = {platform: {**archive, "url": _signed(request, f"{directory}/{archive['url']}",
                                                     archive["url"], expires)}
                for platform, archive in document["archives"].items()}
    return {**document, "archives": archives}


def public_base(request: web.Request) -> str:
    """The https base URL clients reach us at: `server.public_url`, else the request's Host
    (what this client used to reach us), so absolute URLs work behind any name."""
    configured = request.app[CONFIG_KEY].server.public_url
    if configured:
        return configured if configured.endswith("/") else configured + "/"
    return f"https://{request.host}/"


def _signed(request: web.Request, path: str, url: str, expires: int | None = None) -> str:
    """url, which leads to our path, with the query that lets a client fetch it without
    credentials (Terraform sends none to the URLs in these documents) when clients must
    authenticate: until expires (default: the expiry of a URL signed now)."""
    signer = request.app.get(SIGNER_KEY)
    if signer is None:
        return url
    # For the token that asked: the audit log names it when the archive is fetched.
    return f"{url}?{signer.query(path, expires=expires, signed_for=request.get(TOKEN_NAME_KEY))}"


def _public_url(request: web.Request, path: str, expires: int | None = None) -> str:
    """The absolute URL of our path (see public_base), signed when clients authenticate."""
    return _signed(request, path, public_base(request) + path.lstrip("/"), expires)


async def discovery(request: web.Request) -> web.Response:
    """Our own service discovery: modules and providers addressed to the proxy's hostname
    come from the default upstream host. Served anonymously, from memory (clients treat 401
    as fatal)."""
    default_host = request.app[CONFIG_KEY].modules.default_host
    return json_response({"modules.v1": f"{MODULES_PREFIX}{default_host}/",
                          "providers.v1": f"{PROVIDERS_PREFIX}{default_host}/"})


def _provider(request: web.Request) -> ProviderAddress:
    info = request.match_info
    return ProviderAddress.parse(info["hostname"], info["namespace"], info["type"])


async def provider_versions(request: web.Request) -> web.Response:
    """providers.v1 `:namespace/:type/versions`."""
    registry, provider = request.app[REGISTRY_KEY], _provider(request)
    body = await registry.list_versions_body(provider)
    _tell_hidden(request, "provider", str(provider), provider_target(provider))
    return _held_answer(request, "provider_versions", body)


async def provider_download(request: web.Request) -> web.Response:
    """providers.v1 `:namespace/:type/:version/download/:os/:arch`: upstream's document with
    its three URLs pointing at the proxy (signed when clients must authenticate)."""
    provider = _provider(request)
    version = parse_version(request.match_info["version"])
    platform = Platform.parse(request.match_info["os"], request.match_info["arch"])
    facts = await request.app[REGISTRY_KEY].download_document(provider, version, platform)
    signer = request.app.get(SIGNER_KEY)
    expires = None if signer is None else _expiry(request, signer)

    def build() -> dict[str, Any]:
        document, sums = dict(facts[0]), facts[1]
        sums_path = f"{PROVIDERS_PREFIX}{provider}/{version}/sums/{sums}/SHA256SUMS"
        document["download_url"] = _public_url(
            request, f"{MIRROR_PREFIX}{provider}/{provider.archive_filename(version, platform)}",
            expires)
        document["shasums_url"] = _public_url(request, sums_path, expires)
        document["shasums_signature_url"] = _public_url(request, sums_path + ".sig", expires)
        return document

    # The URLs are absolute: on the base this client reached us at.
    return json_body_response(request, _request_body(
        request, (request.path, public_base(request), request.get(TOKEN_NAME_KEY)), facts,
        expires, build))


async def provider_sums(request: web.Request) -> web.Response:
    """The SHA256SUMS file or its signature, byte for byte as upstream published them."""
    provider = _provider(request)
    version = parse_version(request.match_info["version"])
    name, file = request.match_info["sums"], request.match_info["file"]
    if not SUMS_ID.fullmatch(name) or file not in ("SHA256SUMS", "SHA256SUMS.sig"):
        raise NotFound("no such file")
    sums, signature = await request.app[REGISTRY_KEY].signed_sums(provider, version, name)
    if file == "SHA256SUMS":
        return web.Response(body=sums, content_type="text/plain")
    return web.Response(body=signature, content_type="application/octet-stream")


def _module(request: web.Request) -> ModuleAddress:
    info = request.match_info
    return ModuleAddress.parse(info["hostname"], info["namespace"], info["name"],
                               info["system"])


async def module_versions(request: web.Request) -> web.Response:
    """`:namespace/:name/:system/versions`."""
    registry, module = request.app[MODULES_KEY], _module(request)
    body = await registry.list_versions_body(module)
    _tell_hidden(request, "module", str(module), module_target(module))
    return _held_answer(request, "module_versions", body)


async def module_version_file(request: web.Request) -> web.StreamResponse:
    """`:namespace/:name/:system/:version/download` (points at our archive as soon as the
    version is known to exist) and the archive itself (GET and HEAD wait for its fill)."""
    module = _module(request)
    version = parse_module_version(request.match_info["version"])
    action = request.match_info["action"]
    registry = request.app[MODULES_KEY]
    if action == "download":
        await registry.download(module, version)
        archive_path = (f"{MODULES_PREFIX}{module}/{version}/"
                        f"{module.name}-{module.system}-{version}.tar.gz")
        location = _public_url(request, archive_path)
        # Terraform reads the header (204 or 200), OpenTofu the JSON body of a 200.
        response = json_response({"location": location})
        response.headers["X-Terraform-Get"] = location
        return response
    if action == f"{module.name}-{module.system}-{version}.tar.gz":
        return await send_file(request, lambda: registry.archive(module, version),
                               "application/gzip", request.app[ARCHIVES_KEY],
                               request.app[METRICS_KEY].served_bytes.labels("module"))
    raise NotFound(f"no such module document {action[:120]!r}")


async def unmatched(request: web.Request) -> web.StreamResponse:
    """What no route serves: 405 naming the methods allowed where a route serves the path,
    else 404 (as aiohttp's router answers)."""
    allowed: set[str] = set()
    for resource in request.app.router.resources():
        if resource.name != UNMATCHED:
            allowed |= (await resource.resolve(request))[1]
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, allowed)
    raise web.HTTPNotFound()


def allowed(route: str, handler: Handler) -> Handler:
    """handler, after the checks that the request's identity may pull what route names and
    that the version policy serves the version it names: a 403 before anything is looked up,
    written to the audit log as a refusal."""
    if route not in ARTIFACT_ROUTES:
        return handler

    async def checked(request: web.Request) -> web.StreamResponse:
        try:
            check_allowed(request, route)
        except Forbidden:
            identity = request[IDENTITY_KEY]
            request.app[METRICS_KEY].auth_requests.labels(identity.method, "forbidden").inc()
            raise
        policy = request.app.get(POLICY_KEY)
        if policy is not None and policy.config.active:
            named = named_artifact(route, request.match_info)
            if named is not None and named.artifact.version is not None:
                await _require_policy(policy, named.artifact)
        return await handler(request)

    return checked


def _tell_hidden(request: web.Request, kind: str, address: str, target: str) -> None:
    """Say (log, audit) which versions the version policy left out of a list just answered."""
    policy = request.app.get(POLICY_KEY)
    if policy is not None and policy.config.active:
        policy.tell_hidden(kind, address, target, requester_of(request))


async def _require_policy(policy: VersionPolicy, artifact: Artifact) -> None:
    """PolicyRefused unless the policy serves artifact's version now."""
    assert artifact.version is not None
    address = "/".join(part for part in (artifact.host, artifact.namespace, artifact.name,
                                         artifact.system) if part)
    target = pull_target(artifact.kind, artifact.host, artifact.namespace, artifact.name)
    platform = f" {artifact.os}_{artifact.arch}" if artifact.os and artifact.arch else ""
    await policy.require(artifact.kind, address, target, artifact.version,
                         f"{address} {artifact.version}{platform}")


def add_routes(app: web.Application, guard: Guard, audit: AuditLog = NO_AUDIT,
               more: Sequence[Callable[[RouteAdder], None]] = (),
               unmatched_shapes: Mapping[str, ErrorShape] | None = None) -> None:
    """Every route the proxy serves, each handler wrapped by guard once (see route_guard);
    those that name an artifact write audit lines (inside the guard: after authentication,
    before errors become answers). more: functions that add the routes of other APIs;
    unmatched_shapes: the error shape of paths no route serves, by path prefix (an API's
    own shape under its prefix)."""
    app[BODIES_KEY] = Derived(_HELD_BODIES)

    def get(path: str, handler: Handler, name: str, shape: ErrorShape | None = None) -> None:
        app.router.add_get(path, guard(name, counted(name, audited(
            name, allowed(name, handler), audit)), shape), name=name)

    get("/healthz", healthz, "healthz")
    get("/readyz", readyz, "readyz")
    get("/metrics", metrics, "metrics")
    get("/", status_page, "status_page")
    get("/status.json", status_json, "status_json")
    get("/status/cache", inventory_page, "status_cache")
    get("/status/cache.json", inventory_json, "status_cache_json")
    get("/.well-known/terraform.json", discovery, "discovery")
    get(MIRROR_PREFIX + "{hostname}/{namespace}/{type}/{name}", mirror_file, "mirror")
    provider = PROVIDERS_PREFIX + "{hostname}/{namespace}/{type}"
    get(provider + "/versions", provider_versions, "provider_versions")
    get(provider + "/{version}/download/{os}/{arch}", provider_download, "provider_download")
    get(provider + "/{version}/sums/{sums}/{file}", provider_sums, "provider_sums")
    module = MODULES_PREFIX + "{hostname}/{namespace}/{name}/{system}"
    get(module + "/versions", module_versions, "module_versions")
    get(module + "/{version}/{action}", module_version_file, "module")
    for add in more:
        add(get)
    # Last, and indexed under "/": the router tries it only after every route above, so
    # unmatched paths get the guard's odd-path check, JSON answer and count too. Any
    # character, a decoded newline as well: [\s\S].
    app.router.add_route("*", "/{path:[\\s\\S]*}",
                         guard(UNMATCHED, unmatched, _by_prefix(unmatched_shapes or {})),
                         name=UNMATCHED)


def _by_prefix(shapes: Mapping[str, ErrorShape]) -> ErrorShape | None:
    """The error shape of the first prefix a path starts with; the plain JSON error else."""
    if not shapes:
        return None

    def shape(request: web.Request, status: int, message: str,
              exc: Exception) -> web.Response:
        for prefix, chosen in shapes.items():
            if request.path.startswith(prefix):
                return chosen(request, status, message, exc)
        return json_error(status, message)

    return shape
