"""Client of an upstream provider registry (`providers.v1`).

https://developer.hashicorp.com/terraform/internals/provider-registry-protocol
"""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager

from proxy.core.errors import NotFound, UpstreamNotFound
from proxy.core.models import Platform, ProviderAddress
from proxy.upstream.discovery import Discovery
from proxy.upstream.documents import DownloadInfo, VersionEntry, parse_download, parse_versions
from proxy.upstream.http import Download, UpstreamHTTP

_MAX_SUMS_BYTES = 1 << 20
_MAX_SIGNATURE_BYTES = 64 << 10


class ProviderRegistryClient:
    """Fetches provider metadata and signature material from the origin registry."""

    def __init__(self, http: UpstreamHTTP, discovery: Discovery) -> None:
        self._http = http
        self._discovery = discovery

    async def _base(self, provider: ProviderAddress) -> str:
        return await self._discovery.service_url(provider.hostname, "providers.v1")

    async def list_versions(self, provider: ProviderAddress) -> list[VersionEntry]:
        """`GET :namespace/:type/versions`."""
        base = await self._base(provider)
        try:
            _url, document = await self._http.get_json(
                f"{base}{provider.namespace}/{provider.type}/versions", provider.hostname,
                authenticate=True)
        except UpstreamNotFound:
            raise NotFound(f"upstream has no provider {provider}") from None
        return parse_versions(document)

    async def download_info(self, provider: ProviderAddress, version: str,
                            platform: Platform) -> DownloadInfo:
        """`GET :namespace/:type/:version/download/:os/:arch`."""
        base = await self._base(provider)
        url = (f"{base}{provider.namespace}/{provider.type}/{version}/download/"
               f"{platform.os}/{platform.arch}")
        final_url, document = await self._http.get_json(url, provider.hostname,
                                                         authenticate=True)
        return parse_download(document, final_url, platform)

    async def shasums(self, provider: ProviderAddress, info: DownloadInfo) -> tuple[bytes, bytes]:
        """The SHA256SUMS file and its detached signature, as upstream published them."""
        sums, signature = await asyncio.gather(
            self._http.get_bytes(info.shasums_url, provider.hostname, _MAX_SUMS_BYTES),
            self._http.get_bytes(info.shasums_signature_url, provider.hostname,
                                 _MAX_SIGNATURE_BYTES))
        return sums, signature

    def open_package(self, provider: ProviderAddress, download_url: str,
                     max_bytes: int) -> AbstractAsyncContextManager[Download]:
        """Stream the package zip from its (verified download document's) URL."""
        return self._http.stream(download_url, provider.hostname, max_bytes)
