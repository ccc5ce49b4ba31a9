"""HTTP handlers of the OCI distribution API (read-only): `/v2/`, the token endpoint, the
provider repositories `/v2/providers/HOST/NAMESPACE/TYPE/...` and the module repositories
`/v2/modules/HOST/NAMESPACE/NAME/SYSTEM/...`
(https://github.com/opencontainers/distribution-spec/blob/main/spec.md)."""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from urllib.parse import quote

from aiohttp import hdrs, web

from proxy.core.errors import BadRequest
from proxy.core.models import ModuleAddress, ProviderAddress
from proxy.core.redaction import mask_secrets
from proxy.core.spool import GrowingFile
from proxy.protocols.oci_distribution import OciProviders, provider_repository
from proxy.protocols.oci_manifests import EMPTY_CONFIG, EMPTY_CONFIG_BLOB, Document
from proxy.protocols.oci_modules import OciModules, module_repository
from proxy.protocols.oci_records import BlobUnknown, DigestInvalid, ManifestUnknown
from proxy.store.protocol import BlobInfo
from proxy.web.auth import IDENTITY_KEY, SIGNER_KEY, TOKEN_BINDING_KEY, TOKEN_NAME_KEY
from proxy.web.oci_tokens import issue_token
from proxy.web.responses import send_file
from proxy.web.routes import ARCHIVES_KEY, METRICS_KEY, RouteAdder, public_base

OCI_KEY = web.AppKey("oci_providers", OciProviders)
OCI_MODULES_KEY = web.AppKey("oci_modules", OciModules)
PROVIDER_REPOSITORY = "/v2/providers/{hostname}/{namespace}/{type}"
MODULE_REPOSITORY = "/v2/modules/{hostname}/{namespace}/{name}/{system}"
# Sent with every /v2 answer: Docker clients and Distribution check it on `GET /v2/`.
API_VERSION = {"Docker-Distribution-API-Version": "registry/2.0"}
SERVICE = "tf-registry-proxy"
_BLOB_TYPE = "application/octet-stream"
_MAX_PAGE = 10_000
_PAGE_SIZE = re.compile(r"[0-9]{1,6}")  # ASCII digits only: str.isdigit takes "²"
# A repository name as the distribution spec allows it: anything else stays out of a header.
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_REPOSITORY_NAME = re.compile(f"{_COMPONENT}(?:/{_COMPONENT})*")
_COMPONENT_NAME = re.compile(_COMPONENT)


def add_oci_routes(get: RouteAdder) -> None:
    """The OCI routes, their errors in the OCI shape."""
    get("/v2/", base, "oci_base", oci_error)
    get("/v2/token", token, "oci_token", oci_error)
    for repository, kind in ((PROVIDER_REPOSITORY, ""), (MODULE_REPOSITORY, "module_")):
        get(repository + "/tags/list", tags_list, f"oci_{kind}tags", oci_error)
        get(repository + "/manifests/{reference}", manifest, f"oci_{kind}manifest", oci_error)
        get(repository + "/blobs/{digest}", blob, f"oci_{kind}blob", oci_error)


async def base(_request: web.Request) -> web.Response:
    """`GET /v2/`: this is a registry (and, with auth on, these credentials are good)."""
    return web.json_response({}, headers=API_VERSION)


async def token(request: web.Request) -> web.Response:
    """The token endpoint a Bearer challenge names: a short-lived token for the credentials
    given (auth off: none needed, an anonymous one)."""
    signer = request.app.get(SIGNER_KEY)
    if signer is None:
        issued, expires_in = "anonymous", 3600
    else:
        identity = request.get(IDENTITY_KEY)
        issued, expires_in = issue_token(
            signer, request.get(TOKEN_NAME_KEY), request.get(TOKEN_BINDING_KEY),
            None if identity is None else identity.expires_at)
    now = datetime.now(UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    return web.json_response({"token": issued, "access_token": issued,
                              "expires_in": expires_in, "issued_at": now},
                             headers={**API_VERSION, "Cache-Control": "no-store"})


class PaginationInvalid(BadRequest):
    """`n` is not a number of tags (OCI: PAGINATION_NUMBER_INVALID)."""


@dataclass(frozen=True)
class _Repository:
    """The repository a request names: a provider's or a module's, and its operations."""

    name: str
    require_served: Callable[[], None]
    tags: Callable[[], Awaitable[list[str]]]
    manifest: Callable[[str], Awaitable[Document]]
    blob: Callable[[str], Awaitable[BlobInfo | GrowingFile[BlobInfo]]]
    served_kind: str  # the tfproxy_served_bytes kind of its blobs


class NameInvalid(BadRequest):
    """A repository name outside the distribution spec's grammar (OCI: NAME_INVALID)."""


def _repository(request: web.Request) -> _Repository:
    """The repository the path names; NameInvalid, before anything is looked up, for a name
    the distribution spec does not allow (upper case among them: `[a-z0-9]` and separators
    only), as Distribution refuses it."""
    info = request.match_info
    kind = "modules" if "system" in info else "providers"
    segments = [info[part] for part in ("hostname", "namespace", "type", "name", "system")
                if part in info]
    if not all(_COMPONENT_NAME.fullmatch(segment) for segment in segments):
        named = "/".join([kind, *segments])
        raise NameInvalid(f"invalid repository name {named[:200]!r}: OCI repository names "
                          "are lower case (letters, digits and . _ __ - between them), e.g. "
                          f"{named.lower()[:200]!r}")
    if "system" in info:
        module = ModuleAddress.parse(info["hostname"], info["namespace"], info["name"],
                                     info["system"])
        modules = request.app[OCI_MODULES_KEY]
        return _Repository(module_repository(module),
                           partial(modules.require_served, module), partial(modules.tags, module),
                           partial(modules.manifest, module), partial(modules.blob, module),
                           "module")
    provider = ProviderAddress.parse(info["hostname"], info["namespace"], info["type"])
    providers = request.app[OCI_KEY]
    return _Repository(provider_repository(provider),
                       partial(providers.require_served, provider),
                       partial(providers.tags, provider), partial(providers.manifest, provider),
                       partial(providers.blob, provider), "package")


async def tags_list(request: web.Request) -> web.Response:
    """`tags/list`, paginated by `n` and `last` with a `Link` to the next page."""
    repository = _repository(request)
    tags = await repository.tags()
    last = request.query.get("last")
    if last:
        tags = [tag for tag in tags if tag > last]
    headers = dict(API_VERSION)
    wanted = request.query.get("n")
    if wanted is not None:
        if not _PAGE_SIZE.fullmatch(wanted):
            raise PaginationInvalid(f"n must be a number of tags, not {wanted[:20]!r}")
        count = min(int(wanted), _MAX_PAGE)
        if len(tags) > count > 0:
            # oras-go follows the first <...> whatever its rel; others follow rel="next".
            headers["Link"] = (f'</v2/{repository.name}/tags/list?n={count}&last='
                               f'{quote(tags[count - 1])}>; rel="next"')
        tags = tags[:count]
    return web.json_response({"name": repository.name, "tags": tags}, headers=headers)


async def manifest(request: web.Request) -> web.Response:
    """`manifests/<tag|digest>` (GET and HEAD): the document's exact bytes, its media type
    and digest."""
    document = await _repository(request).manifest(request.match_info["reference"])
    return web.Response(body=document.body, headers={
        **API_VERSION, hdrs.CONTENT_TYPE: document.media_type,
        "Docker-Content-Digest": document.digest, hdrs.ETAG: f'"{document.digest}"'})


async def blob(request: web.Request) -> web.StreamResponse:
    """`blobs/<digest>` (GET and HEAD, Range): the empty config, or the verified zip."""
    repository = _repository(request)
    digest = request.match_info["digest"]
    headers = {**API_VERSION, "Docker-Content-Digest": digest}
    if digest == EMPTY_CONFIG["digest"]:
        repository.require_served()
        return web.Response(body=EMPTY_CONFIG_BLOB, content_type=_BLOB_TYPE, headers=headers)
    app = request.app
    served = app[METRICS_KEY].served_bytes.labels(repository.served_kind)
    return await send_file(request, lambda: repository.blob(digest), _BLOB_TYPE,
                           app[ARCHIVES_KEY], served, headers)


def oci_error(request: web.Request, status: int, message: str,
              exc: Exception) -> web.Response:
    """An error in the OCI shape, `{"errors": [{"code", "message", "detail"}]}`; a 401
    challenges for a bearer token from our token endpoint."""
    body = {"errors": [{"code": _code(request, status, exc), "message": mask_secrets(message),
                        "detail": None}]}
    response = web.Response(status=status, body=json.dumps(body).encode(),
                            content_type="application/json", headers=API_VERSION)
    if status == 401:
        response.headers[hdrs.WWW_AUTHENTICATE] = _challenge(request)
    if isinstance(exc, web.HTTPException) and hdrs.ALLOW in exc.headers:
        response.headers[hdrs.ALLOW] = exc.headers[hdrs.ALLOW]
    return response


def _challenge(request: web.Request) -> str:
    """The Bearer challenge: our token endpoint, and on a repository's routes the scope to
    ask for (the distribution token spec's form; clients that compute their own ignore it)."""
    challenge = f'Bearer realm="{public_base(request)}v2/token",service="{SERVICE}"'
    info = request.match_info
    if "type" in info or "system" in info:
        repository = (f"modules/{info['hostname']}/{info['namespace']}/{info['name']}/"
                      f"{info['system']}" if "system" in info else
                      f"providers/{info['hostname']}/{info['namespace']}/{info['type']}")
        if _REPOSITORY_NAME.fullmatch(repository):
            challenge += f',scope="repository:{repository}:pull"'
    return challenge


_BY_STATUS = {401: "UNAUTHORIZED", 403: "DENIED", 405: "UNSUPPORTED", 429: "TOOMANYREQUESTS",
              502: "UNAVAILABLE", 503: "UNAVAILABLE", 504: "UNAVAILABLE"}


def _code(request: web.Request, status: int, exc: Exception) -> str:
    """The OCI error code for an answer of status to request."""
    if isinstance(exc, DigestInvalid):
        return "DIGEST_INVALID"
    if isinstance(exc, PaginationInvalid):
        return "PAGINATION_NUMBER_INVALID"
    if isinstance(exc, NameInvalid):
        return "NAME_INVALID"
    if isinstance(exc, ManifestUnknown):
        return "MANIFEST_UNKNOWN"
    if isinstance(exc, BlobUnknown):
        return "BLOB_UNKNOWN"
    if status == 404:
        route = (request.match_info.route.name or "").replace("oci_module_", "oci_")
        return {"oci_manifest": "MANIFEST_UNKNOWN", "oci_blob": "BLOB_UNKNOWN"}.get(
            route, "NAME_UNKNOWN")
    if status == 400:
        return "NAME_INVALID"
    return _BY_STATUS.get(status, "UNKNOWN")

