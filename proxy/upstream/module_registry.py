"""Client of an upstream module registry (`modules.v1`).

https://developer.hashicorp.com/terraform/internals/module-registry-protocol
"""

from __future__ import annotations

import json

from proxy.core.errors import NotFound, UnknownVersion, UpstreamError, UpstreamNotFound
from proxy.core.models import ModuleAddress, is_valid_module_version
from proxy.modules.sources import resolve_location
from proxy.upstream.discovery import Discovery
from proxy.upstream.http import MAX_JSON_BYTES, UpstreamHTTP


class ModuleRegistryClient:
    """Fetches module version lists and download locations from the origin registry."""

    def __init__(self, http: UpstreamHTTP, discovery: Discovery) -> None:
        self._http = http
        self._discovery = discovery

    async def _base(self, module: ModuleAddress) -> str:
        return await self._discovery.service_url(module.hostname, "modules.v1")

    async def list_versions(self, module: ModuleAddress) -> list[str]:
        """`GET :namespace/:name/:system/versions`; clients read only `modules[0]`."""
        base = await self._base(module)
        try:
            _url, document = await self._http.get_json(f"{base}{module.path}/versions",
                                                       module.hostname, authenticate=True)
        except UpstreamNotFound:
            raise NotFound(f"upstream has no module {module}") from None
        return parse_module_versions(document)

    async def download_location(self, module: ModuleAddress, version: str) -> str:
        """`GET :namespace/:name/:system/:version/download`: 204 + X-Terraform-Get, or
        200 with it or with a JSON `location` (registry.opentofu.org). Relative locations are
        resolved against the download URL."""
        base = await self._base(module)
        url = f"{base}{module.path}/{version}/download"
        fetched = await self._http.get(url, module.hostname, MAX_JSON_BYTES,
                                       authenticate=True)
        if fetched.status == 404:
            raise UnknownVersion(f"upstream has no version {version} of module {module}")
        if fetched.status not in (200, 204):
            raise UpstreamError(f"upstream {module.hostname} answered {fetched.status} for "
                                f"the download of {module} {version}")
        location = fetched.headers.get("X-Terraform-Get")
        if not location and fetched.status == 200:
            location = _json_location(fetched.body)
        if not location:
            raise UpstreamError(f"upstream gave no location for {module} {version}")
        return resolve_location(location, fetched.url)


def parse_module_versions(document: object) -> list[str]:
    """Versions from a module versions document; invalid entries dropped."""
    if not isinstance(document, dict) or not isinstance(document.get("modules"), list) \
            or not document["modules"] or not isinstance(document["modules"][0], dict):
        raise UpstreamError("upstream module versions document is malformed")
    raw = document["modules"][0].get("versions")
    if not isinstance(raw, list):
        raise UpstreamError("upstream module versions document has no versions array")
    versions: dict[str, None] = {}  # ordered, de-duplicated in linear time
    for item in raw:
        version = item.get("version") if isinstance(item, dict) else None
        if isinstance(version, str) and is_valid_module_version(version):
            versions[version] = None
    return list(versions)


def _json_location(body: bytes) -> str | None:
    try:
        document = json.loads(body)
    except (ValueError, RecursionError):
        return None
    location = document.get("location") if isinstance(document, dict) else None
    return location if isinstance(location, str) else None
