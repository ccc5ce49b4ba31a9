"""The upstream of CLI releases: releases.hashicorp.com's layout for Terraform
(`terraform/index.json`, `terraform/VERSION/FILE`), OpenTofu's GitHub release assets
(`vVERSION/FILE`) and its TofuDL release list (`api.json`). Only what a product publishes,
by names checked in proxy.core.releases, is ever asked for."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit

from proxy.config.settings import ReleasesConfig
from proxy.core.errors import BadRequest, NotFound, UpstreamError, UpstreamNotFound
from proxy.core.releases import OPENTOFU, TERRAFORM, Product, parse_release_version
from proxy.upstream.http import Download, UpstreamHTTP

# releases.hashicorp.com/terraform/index.json lists every build of every version (MBs).
MAX_LIST_BYTES = 64 << 20
MAX_SMALL_FILE = 1 << 20  # SHA256SUMS, signatures, certificates
_MAX_VERSIONS = 10_000

# Versions and the files each has, as upstream lists them (names checked).
Listing = dict[str, list[str]]


class ReleasesClient:
    """Fetches release lists and files for the products configured."""

    def __init__(self, http: UpstreamHTTP, config: ReleasesConfig, max_size: int) -> None:
        self._http = http
        self._config = config
        self._max_size = max_size
        self._bases = {TERRAFORM.name: config.terraform_url,
                       OPENTOFU.name: config.opentofu_url}

    def serves(self, product: Product) -> bool:
        """Whether an upstream is configured for product."""
        return bool(self._bases[product.name])

    def require_served(self, product: Product) -> None:
        """NotFound unless an upstream is configured for product."""
        if not self.serves(product):
            raise NotFound(f"{product.name} releases are not served by this proxy "
                           f"(releases.{product.name}_url is empty)")

    def origin(self, product: Product) -> str:
        """The upstream host of product's files (its name in metrics and messages)."""
        return urlsplit(self._bases[product.name]).hostname or product.name

    def file_url(self, product: Product, version: str, filename: str) -> str:
        """Where upstream publishes one file of a version."""
        base = self._bases[product.name]
        if product is TERRAFORM:
            return f"{base}terraform/{version}/{filename}"
        return f"{base}v{version}/{filename}"

    async def listing(self, product: Product) -> Listing:
        """Every version upstream lists, with the files it lists for each."""
        self.require_served(product)
        if product is TERRAFORM:
            url = f"{self._config.terraform_url}terraform/index.json"
        else:
            url = self._config.opentofu_list_url
            if not url:
                raise NotFound("releases.opentofu_list_url is empty: OpenTofu versions are "
                               "not listed")
        origin = urlsplit(url).hostname or product.name
        fetched = await self._http.get(url, origin, MAX_LIST_BYTES)
        if fetched.status != 200:
            raise UpstreamError(f"upstream {origin} answered {fetched.status} for the "
                                f"{product.name} release list")
        try:
            document = json.loads(fetched.body)
        except (ValueError, RecursionError):
            raise UpstreamError(f"upstream {origin} answered invalid JSON for the "
                                f"{product.name} release list") from None
        return terraform_listing(document) if product is TERRAFORM \
            else opentofu_listing(document)

    async def small_file(self, product: Product, version: str, filename: str) -> bytes | None:
        """A SHA256SUMS, signature or certificate; None when upstream has none (404)."""
        fetched = await self._http.get(self.file_url(product, version, filename),
                                       self.origin(product), MAX_SMALL_FILE, accept="*/*")
        if fetched.status == 404:
            return None
        if fetched.status != 200:
            raise UpstreamError(f"upstream {self.origin(product)} answered {fetched.status} "
                                f"for {filename}")
        return fetched.body

    async def sums(self, product: Product, version: str) -> bytes:
        """A version's SHA256SUMS (UpstreamNotFound: no such release)."""
        found = await self.small_file(product, version, product.sums_name(version))
        if found is None:
            raise UpstreamNotFound(f"{product.name} has no release {version} upstream "
                                   f"({self.origin(product)})")
        return found

    @asynccontextmanager
    async def open(self, product: Product, version: str,
                   filename: str) -> AsyncIterator[Download]:
        """Stream one archive of a version."""
        async with self._http.stream(self.file_url(product, version, filename),
                                     self.origin(product), self._max_size) as download:
            yield download


def _version(raw: object) -> str | None:
    try:
        return parse_release_version(raw) if isinstance(raw, str) else None
    except BadRequest:
        return None


def _published(product: Product, version: str, names: object) -> list[str]:
    """The names of a listing entry that are the product's files of that version."""
    found: list[str] = []
    for name in names if isinstance(names, list) else []:
        if isinstance(name, str) and name not in found:
            try:
                product.kind_of(version, name)
            except NotFound:
                continue
            found.append(name)
    return found


def terraform_listing(document: object) -> Listing:
    """releases.hashicorp.com's `terraform/index.json`: `{"versions": {V: {"builds":
    [{"filename": ...}], "shasums": ..., "shasums_signatures": [...]}}}`."""
    versions = document.get("versions") if isinstance(document, dict) else None
    if not isinstance(versions, dict):
        raise UpstreamError("the terraform release list has no versions object")
    listing: Listing = {}
    for raw, entry in list(versions.items())[:_MAX_VERSIONS]:
        version = _version(raw)
        if version is None or not isinstance(entry, dict):
            continue
        builds = entry.get("builds")
        names = [b.get("filename") for b in builds if isinstance(b, dict)] \
            if isinstance(builds, list) else []
        signatures = entry.get("shasums_signatures")
        names += [entry.get("shasums"), *(signatures if isinstance(signatures, list) else [])]
        listing[version] = _published(TERRAFORM, version, names)
    return listing


def opentofu_listing(document: object) -> Listing:
    """The TofuDL release list (get.opentofu.org/tofu/api.json): `{"versions": [{"id": V,
    "files": [...]}]}`."""
    versions = document.get("versions") if isinstance(document, dict) else None
    if not isinstance(versions, list):
        raise UpstreamError("the OpenTofu release list has no versions array")
    listing: Listing = {}
    for entry in versions[:_MAX_VERSIONS]:
        version = _version(entry.get("id")) if isinstance(entry, dict) else None
        if version is not None:
            listing[version] = _published(OPENTOFU, version, entry.get("files"))
    return listing
