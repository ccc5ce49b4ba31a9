"""HTTP handlers of the CLI releases mirror under `/releases/`: releases.hashicorp.com's tree
for Terraform (`TFENV_REMOTE=https://PROXY/releases`), OpenTofu's GitHub release layout
(`TOFUENV_REMOTE=https://PROXY/releases`: `opentofu/opentofu/releases/download/vVERSION/`),
TofuDL's `tofu/api.json`, and the release keys under `keys/`."""

from __future__ import annotations

from urllib.parse import urlsplit

from aiohttp import web

from proxy.core.errors import NotFound
from proxy.core.releases import OPENTOFU, TERRAFORM, Product, parse_release_version
from proxy.protocols import release_documents as documents
from proxy.protocols.releases import CliReleases
from proxy.web.responses import json_response, send_file
from proxy.web.routes import ARCHIVES_KEY, METRICS_KEY, RouteAdder, public_base

RELEASES_KEY = web.AppKey("cli_releases", CliReleases)
TERRAFORM_TREE = "/releases/terraform"
OPENTOFU_TREE = "/releases/opentofu/opentofu/releases/download"
# The files given out as the release keys (TFENV_HASHICORP_PGP_KEY, TOFUENV_OPENTOFU_PGP_KEY
# and gpgv keyrings can point at them).
KEY_FILES = {"hashicorp.asc": TERRAFORM, "opentofu.asc": OPENTOFU}
_TYPES = {"sums": "text/plain", "signature": "application/octet-stream",
          "extra": "application/octet-stream"}


def add_release_routes(get: RouteAdder) -> None:
    """The routes of the releases mirror (errors in the proxy's JSON shape)."""
    get("/releases/keys/{file}", release_keys, "releases_keys", None)
    # tfenv asks for `terraform/`, tenv for `terraform`: both, one route.
    get(TERRAFORM_TREE + "{slash:/?}", terraform_versions_page, "releases_list", None)
    get(OPENTOFU_TREE + "{slash:/?}", opentofu_versions_page, "releases_tofu_list", None)
    get(TERRAFORM_TREE + "/index.json", terraform_index, "releases_index", None)
    get(TERRAFORM_TREE + "/{version}/", terraform_files_page, "releases_version", None)
    get(TERRAFORM_TREE + "/{version}/index.json", terraform_version_index,
        "releases_version_index", None)
    get(TERRAFORM_TREE + "/{version}/{file}", terraform_file, "releases_file", None)
    get(OPENTOFU_TREE + "/{tag}/{file}", opentofu_file, "releases_tofu_file", None)
    get("/releases/tofu/api.json", tofudl_list, "releases_tofudl", None)


def _base_path(request: web.Request) -> str:
    """The proxy's base as a path: pages link by path, as releases.hashicorp.com does (tfenv
    greps version numbers out of the whole page, so no host name or address may be in it)."""
    return urlsplit(public_base(request)).path


def _version(request: web.Request, key: str = "version") -> str:
    return parse_release_version(request.match_info[key])


async def release_keys(request: web.Request) -> web.Response:
    """The armored public keys a product's SHA256SUMS must be signed by."""
    product = KEY_FILES.get(request.match_info["file"])
    if product is None:
        raise NotFound(f"no key file {request.match_info['file'][:60]!r} (hashicorp.asc, "
                       "opentofu.asc)")
    keys = request.app[RELEASES_KEY].keys(product)
    return web.Response(text=keys.text, content_type="application/pgp-keys")


async def _page(request: web.Request, product: Product) -> web.Response:
    listing = await request.app[RELEASES_KEY].listing(product)
    return web.Response(text=documents.versions_page(product, listing, _base_path(request)),
                        content_type="text/html")


async def terraform_versions_page(request: web.Request) -> web.Response:
    """`terraform/`: every version, newest first (tfenv list-remote, tenv html mode)."""
    return await _page(request, TERRAFORM)


async def opentofu_versions_page(request: web.Request) -> web.Response:
    """`opentofu/opentofu/releases/download/`: every version as a `vVERSION/` link."""
    return await _page(request, OPENTOFU)


async def terraform_index(request: web.Request) -> web.Response:
    """`terraform/index.json` (tenv api mode)."""
    listing = await request.app[RELEASES_KEY].listing(TERRAFORM)
    return json_response(documents.versions_document(TERRAFORM, listing,
                                                     public_base(request)))


async def _files(request: web.Request, product: Product, version: str) -> list[str]:
    listing = await request.app[RELEASES_KEY].listing(product)
    files = listing.get(version)
    if files is None:
        raise NotFound(f"{product.name} has no release {version}")
    return files


async def terraform_files_page(request: web.Request) -> web.Response:
    """`terraform/VERSION/`: that version's files."""
    version = _version(request)
    files = await _files(request, TERRAFORM, version)
    return web.Response(text=documents.files_page(TERRAFORM, version, files,
                                                  _base_path(request)),
                        content_type="text/html")


async def terraform_version_index(request: web.Request) -> web.Response:
    """`terraform/VERSION/index.json` (tenv api mode installs from its build URLs)."""
    version = _version(request)
    files = await _files(request, TERRAFORM, version)
    return json_response(documents.version_document(TERRAFORM, version, files,
                                                    public_base(request)))


async def tofudl_list(request: web.Request) -> web.Response:
    """TofuDL's `api.json` (tofudl mirrors, tenv mirror mode)."""
    listing = await request.app[RELEASES_KEY].listing(OPENTOFU)
    return json_response(documents.tofudl_document(listing))


async def _file(request: web.Request, product: Product, version: str) -> web.StreamResponse:
    filename = request.match_info["file"]
    releases = request.app[RELEASES_KEY]
    kind = product.kind_of(version, filename)
    if kind != "archive":
        return web.Response(body=await releases.small_file(product, version, filename),
                            content_type=_TYPES[kind])
    content_type = "application/zip" if filename.endswith(".zip") else "application/gzip"
    app = request.app
    return await send_file(request, lambda: releases.archive(product, version, filename),
                           content_type, app[ARCHIVES_KEY],
                           app[METRICS_KEY].served_bytes.labels("release"))


async def terraform_file(request: web.Request) -> web.StreamResponse:
    """`terraform/VERSION/FILE`: an archive, the SHA256SUMS or a signature."""
    return await _file(request, TERRAFORM, _version(request))


async def opentofu_file(request: web.Request) -> web.StreamResponse:
    """`opentofu/opentofu/releases/download/vVERSION/FILE`."""
    tag = request.match_info["tag"]
    if not tag.startswith("v"):
        raise NotFound(f"OpenTofu release tags start with v, not {tag[:40]!r}")
    return await _file(request, OPENTOFU, _version(request, "tag"))
