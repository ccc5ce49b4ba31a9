"""HTTP handlers: path parameters -> models -> service call -> response."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from proxy.errors import NotFound
from proxy.metrics import CONTENT_TYPE_LATEST, Metrics
from proxy.models import ProviderAddress, parse_version
from proxy.provider_mirror import ProviderMirror

MIRROR_PREFIX = "/mirror/"
METRICS_KEY = web.AppKey("metrics", Metrics)
MIRROR_KEY = web.AppKey("provider_mirror", ProviderMirror)


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
        path = await mirror.archive(provider, name)
        return web.FileResponse(path, headers={"Content-Type": "application/zip"})
    raise NotFound(f"no such mirror document {name[:120]!r}")


def add_routes(app: web.Application) -> None:
    """Every route the proxy serves."""
    app.router.add_get("/healthz", healthz, name="healthz")
    app.router.add_get("/metrics", metrics, name="metrics")
    app.router.add_get(MIRROR_PREFIX + "{hostname}/{namespace}/{type}/{name}", mirror_file,
                       name="mirror")
