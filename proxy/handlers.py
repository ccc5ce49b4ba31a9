"""HTTP handlers: path parameters -> models -> service call -> response."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter

from proxy.archives import ArchiveStore, GrowingFile
from proxy.config import Config
from proxy.errors import NotFound, ProxyError
from proxy.metrics import CONTENT_TYPE_LATEST, Metrics
from proxy.models import ModuleAddress, ProviderAddress, parse_module_version, parse_version
from proxy.module_registry import ModuleRegistry
from proxy.provider_mirror import ProviderMirror

log = logging.getLogger(__name__)
MIRROR_PREFIX = "/mirror/"
MODULES_PREFIX = "/modules/"
METRICS_KEY = web.AppKey("metrics", Metrics)
MIRROR_KEY = web.AppKey("provider_mirror", ProviderMirror)
MODULES_KEY = web.AppKey("module_registry", ModuleRegistry)
ARCHIVES_KEY = web.AppKey("archives", ArchiveStore)
CONFIG_KEY = web.AppKey("config", Config)


def json_response(document: dict[str, Any]) -> web.Response:
    """Serialize a protocol document as application/json."""
    return web.Response(body=json.dumps(document, separators=(",", ":")).encode(),
                        content_type="application/json")


async def healthz(_request: web.Request) -> web.Response:
    """Liveness: the process answers."""
    return json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    """Prometheus exposition."""
    body = request.app[METRICS_KEY].render()
    response = web.Response(body=body)
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


async def mirror_file(request: web.Request) -> web.StreamResponse:
    """`:hostname/:namespace/:type/(index.json | VERSION.json | package.zip)`."""
    info = request.match_info
    provider = ProviderAddress.parse(info["hostname"], info["namespace"], info["type"])
    name = info["name"]
    mirror = request.app[MIRROR_KEY]
    if name == "index.json":
        return json_response(await mirror.list_versions(provider))
    if name.endswith(".json"):
        version = parse_version(name.removesuffix(".json"))
        return json_response(await mirror.version_document(provider, version))
    if name.endswith(".zip"):
        source = await mirror.archive(provider, name)
        return await send_file(request, source, "application/zip")
    raise NotFound(f"no such mirror document {name[:120]!r}")


async def send_file(request: web.Request, source: Path | GrowingFile,
                    content_type: str) -> web.StreamResponse:
    """A stored file by sendfile, or a download under way as its bytes arrive. A download
    that fails verification ends the connection mid-body: never a clean end of bad bytes."""
    store = request.app[ARCHIVES_KEY]
    if isinstance(source, GrowingFile) and request.method == "HEAD":
        source = await source.wait_done()  # noqa: ASYNC240 - not a pathlib call
    if isinstance(source, Path):
        store.touch(source)
        return _InUseFileResponse(source, store, headers={"Content-Type": content_type})
    streamed = web.StreamResponse(headers={"Content-Type": content_type})
    if source.size is not None:
        streamed.content_length = source.size
    await streamed.prepare(request)
    try:
        async with contextlib.aclosing(source.chunks()) as chunks:
            async for chunk in chunks:
                await streamed.write(chunk)
    except ProxyError as exc:
        log.warning("aborting %s mid-body: %s", request.path, exc.message)
        if request.transport is not None:
            request.transport.close()
        return streamed
    await streamed.write_eof()
    return streamed


def public_base(request: web.Request) -> str:
    """The https base URL clients reach us at: `server.public_url`, else the request's Host
    (what this client used to reach us), so absolute URLs work behind any name."""
    configured = request.app[CONFIG_KEY].server.public_url
    if configured:
        return configured if configured.endswith("/") else configured + "/"
    return f"https://{request.host}/"


async def discovery(request: web.Request) -> web.Response:
    """Our own service discovery: modules addressed to the proxy's hostname come from the
    default upstream host. Served anonymously, from memory (clients treat 401 as fatal)."""
    default_host = request.app[CONFIG_KEY].modules.default_host
    return json_response({"modules.v1": f"{MODULES_PREFIX}{default_host}/"})


def _module(request: web.Request) -> ModuleAddress:
    info = request.match_info
    return ModuleAddress.parse(info["hostname"], info["namespace"], info["name"],
                               info["system"])


async def module_versions(request: web.Request) -> web.Response:
    """`:namespace/:name/:system/versions`."""
    return json_response(await request.app[MODULES_KEY].list_versions(_module(request)))


async def module_version_file(request: web.Request) -> web.StreamResponse:
    """`:namespace/:name/:system/:version/download` (fills the cache, then points at our
    archive) and the archive itself."""
    module = _module(request)
    version = parse_module_version(request.match_info["version"])
    action = request.match_info["action"]
    registry = request.app[MODULES_KEY]
    if action == "download":
        await registry.archive(module, version)
        location = (f"{public_base(request)}{MODULES_PREFIX.lstrip('/')}{module}/{version}/"
                    f"{module.name}-{module.system}-{version}.tar.gz")
        # Terraform reads the header (204 or 200), OpenTofu the JSON body of a 200.
        response = json_response({"location": location})
        response.headers["X-Terraform-Get"] = location
        return response
    if action == f"{module.name}-{module.system}-{version}.tar.gz":
        path = await registry.archive(module, version)
        return await send_file(request, path, "application/gzip")
    raise NotFound(f"no such module document {action[:120]!r}")


class _InUseFileResponse(web.FileResponse):
    """sendfile, with the file marked in use while it is sent (eviction leaves it alone)."""

    def __init__(self, path: Path, store: ArchiveStore, headers: dict[str, str]) -> None:
        super().__init__(path, headers=headers)
        self._in_use_path = path
        self._store = store

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        with self._store.using(self._in_use_path):
            return await super().prepare(request)


def add_routes(app: web.Application) -> None:
    """Every route the proxy serves."""
    app.router.add_get("/healthz", healthz, name="healthz")
    app.router.add_get("/metrics", metrics, name="metrics")
    app.router.add_get("/.well-known/terraform.json", discovery, name="discovery")
    app.router.add_get(MIRROR_PREFIX + "{hostname}/{namespace}/{type}/{name}", mirror_file,
                       name="mirror")
    module = MODULES_PREFIX + "{hostname}/{namespace}/{name}/{system}"
    app.router.add_get(module + "/versions", module_versions, name="module_versions")
    app.router.add_get(module + "/{version}/{action}", module_version_file, name="module")
