"""The documents version managers list CLI releases from, built from a release listing with
every URL on the proxy. Pure: no I/O.

- releases.hashicorp.com's `terraform/index.json` and `terraform/VERSION/index.json`
  (https://releases.hashicorp.com/docs/api/v1/ shape; tenv's `api` mode reads them);
- HTML indexes whose links carry the versions (tfenv's `list-remote` greps version numbers
  from `terraform/`, newest first; tenv's `html` mode reads each link's `href`);
- TofuDL's `api.json` (OpenTofu's mirror format: tofudl, tenv's `mirror` mode)."""

from __future__ import annotations

import html
from typing import Any

from proxy.core.releases import TERRAFORM, Product
from proxy.upstream.releases import Listing


def release_base(base_url: str, product: Product) -> str:
    """Where a product's tree is on the proxy (base_url: the proxy's URL or path, ending in
    /)."""
    if product is TERRAFORM:
        return f"{base_url}releases/terraform/"
    return f"{base_url}releases/opentofu/opentofu/releases/download/"


def version_directory(base_url: str, product: Product, version: str) -> str:
    """The URL of one version's files on the proxy."""
    tag = version if product is TERRAFORM else f"v{version}"
    return f"{release_base(base_url, product)}{tag}/"


def _builds(product: Product, version: str, files: list[str],
            base_url: str) -> list[dict[str, str]]:
    builds = []
    for name in files:
        platform = product.platform_of(version, name)
        if platform is not None:
            os, _, arch = platform.partition("_")
            builds.append({"name": product.name, "version": version, "os": os, "arch": arch,
                           "filename": name,
                           "url": version_directory(base_url, product, version) + name})
    return builds


def version_document(product: Product, version: str, files: list[str],
                     base_url: str) -> dict[str, Any]:
    """One version as `terraform/VERSION/index.json` describes it."""
    sums = product.sums_name(version)
    signatures = [name for name in files if name.startswith(sums + ".")
                  and product.kind_of(version, name) == "signature"]
    # The one signature tenv fetches: the plain `.sig` where it is listed (for a release the
    # proxy holds: where it verified), else a keyed one that is.
    plain = f"{sums}.sig"
    signature = plain if plain in signatures or not signatures else signatures[0]
    return {"name": product.name, "version": version, "shasums": sums,
            "shasums_signature": signature,
            "shasums_signatures": signatures or [plain],
            "builds": _builds(product, version, files, base_url)}


def versions_document(product: Product, listing: Listing, base_url: str) -> dict[str, Any]:
    """`terraform/index.json`: every version and its builds."""
    return {"name": product.name,
            "versions": {version: version_document(product, version, files, base_url)
                         for version, files in listing.items()}}


def tofudl_document(listing: Listing) -> dict[str, Any]:
    """TofuDL's `api.json`: versions newest first, each with its file names."""
    return {"versions": [{"id": version, "files": files} for version, files in listing.items()]}


def html_index(title: str, links: list[tuple[str, str]]) -> str:
    """A plain page listing links (href, text), as a release index is: no script, every
    value escaped."""
    items = "\n".join(f'  <li><a href="{html.escape(href)}">{html.escape(text)}</a></li>'
                      for href, text in links)
    return (f"<!DOCTYPE html>\n<html>\n<head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title></head>\n<body>\n<ul>\n{items}\n</ul>\n"
            "</body>\n</html>\n")


def versions_page(product: Product, listing: Listing, base_url: str) -> str:
    """The HTML index of a product's versions, newest first: Terraform's links read
    `terraform_VERSION`, OpenTofu's `vVERSION` (a GitHub tag)."""
    links = [(version_directory(base_url, product, version),
              f"{product.name}_{version}" if product is TERRAFORM else f"v{version}")
             for version in listing]
    return html_index(f"{product.name} releases", links)


def files_page(product: Product, version: str, files: list[str], base_url: str) -> str:
    """The HTML index of one version's files."""
    directory = version_directory(base_url, product, version)
    return html_index(f"{product.name} {version}",
                      [(directory + name, name) for name in sorted(files)])
