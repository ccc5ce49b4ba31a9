"""The artifact a request names, from its route and path parameters: one reading for the
audit log and the refusal warnings. None when the path names none, or not validly (a
scanner's or a typo's path), so neither writes a line for it."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from proxy.core import models
from proxy.core.audit import Artifact
from proxy.core.errors import BadRequest, NotFound
from proxy.core.releases import OPENTOFU, TERRAFORM, parse_release_version
from proxy.protocols.oci_manifests import EMPTY_CONFIG, version_of
from proxy.protocols.oci_records import digest_hex, is_digest
from proxy.verification.packages import SUMS_ID

_SUMS_FILES = ("SHA256SUMS", "SHA256SUMS.sig")
_PROVIDER_ROUTES = ("mirror", "provider_versions", "provider_download", "provider_sums")
_MODULE_ROUTES = ("module_versions", "module")
_OCI_ROUTES = ("oci_tags", "oci_manifest", "oci_blob")
_OCI_MODULE_ROUTES = ("oci_module_tags", "oci_module_manifest", "oci_module_blob")
_RELEASE_ROUTES = ("releases_file", "releases_tofu_file", "releases_version",
                   "releases_version_index")
# The routes that can name one.
ARTIFACT_ROUTES = frozenset(_PROVIDER_ROUTES + _MODULE_ROUTES + _OCI_ROUTES
                            + _OCI_MODULE_ROUTES + _RELEASE_ROUTES)


@dataclass(frozen=True)
class Named:
    """An artifact a request names, and whether the answer is that artifact's file."""

    artifact: Artifact
    is_file: bool = False


def named_artifact(route: str, params: Mapping[str, str]) -> Named | None:
    """What a request to route with these path parameters names; None if nothing validly."""
    try:
        if route in _PROVIDER_ROUTES:
            return _provider(route, params)
        if route in _MODULE_ROUTES:
            return _module(route, params)
        if route in _OCI_ROUTES or route in _OCI_MODULE_ROUTES:
            return _oci(route, params)
        if route in _RELEASE_ROUTES:
            return _release(route, params)
    except (BadRequest, NotFound):
        return None
    return None


def _provider(route: str, params: Mapping[str, str]) -> Named | None:
    provider = models.ProviderAddress.parse(params["hostname"], params["namespace"],
                                            params["type"])
    if route == "provider_versions":
        return Named(Artifact.provider(provider))
    if route == "provider_download":
        platform = models.Platform.parse(params["os"], params["arch"])
        return Named(Artifact.provider(provider, models.parse_version(params["version"]),
                                       platform))
    if route == "provider_sums":
        if not SUMS_ID.fullmatch(params["sums"]) or params["file"] not in _SUMS_FILES:
            return None
        return Named(Artifact.provider(provider, models.parse_version(params["version"])))
    name = params["name"]
    if name == "index.json":
        return Named(Artifact.provider(provider))
    if name.endswith(".zip"):
        version, platform = provider.parse_archive_filename(name)
        return Named(Artifact.provider(provider, version, platform), is_file=True)
    if name.endswith(".json"):
        return Named(Artifact.provider(provider,
                                       models.parse_version(name.removesuffix(".json"))))
    return None


def _module(route: str, params: Mapping[str, str]) -> Named | None:
    module = models.ModuleAddress.parse(params["hostname"], params["namespace"],
                                        params["name"], params["system"])
    if route == "module_versions":
        return Named(Artifact.module(module))
    version = models.parse_module_version(params["version"])
    archive = f"{module.name}-{module.system}-{version}.tar.gz"
    if params["action"] not in ("download", archive):
        return None
    return Named(Artifact.module(module, version), is_file=params["action"] == archive)


def _oci(route: str, params: Mapping[str, str]) -> Named | None:
    """A repository's tags, a version's index or manifest (by tag), a document by digest, or
    the repository's file (a blob other than the empty config: a package, a module's zip)."""
    of_version: Callable[[str], Artifact]
    if "system" in params:
        module = models.ModuleAddress.parse(params["hostname"], params["namespace"],
                                            params["name"], params["system"])
        whole = Artifact.module(module)

        def of_version(tag: str) -> Artifact:
            return Artifact.module(module, models.parse_module_version(version_of(tag)))
    else:
        provider = models.ProviderAddress.parse(params["hostname"], params["namespace"],
                                                params["type"])
        whole = Artifact.provider(provider)

        def of_version(tag: str) -> Artifact:
            return Artifact.provider(provider, models.parse_version(version_of(tag)))
    operation = route.removeprefix("oci_").removeprefix("module_")
    if operation == "tags":
        return Named(whole)
    if operation == "manifest":
        reference = params["reference"]
        if is_digest(reference):
            digest_hex(reference)
            return Named(whole)
        return Named(of_version(reference))
    digest = params["digest"]
    digest_hex(digest)
    return Named(whole, is_file=digest != EMPTY_CONFIG["digest"])


def _release(route: str, params: Mapping[str, str]) -> Named | None:
    """A CLI release (its index or files page), or one of its files (an archive: the file
    served)."""
    if route == "releases_tofu_file":
        product, tag = OPENTOFU, params["tag"]
        if not tag.startswith("v"):
            return None
        version = parse_release_version(tag)
    else:
        product, version = TERRAFORM, parse_release_version(params["version"])
    if route in ("releases_version", "releases_version_index"):
        return Named(Artifact.release(product.name, version))
    filename = params["file"]
    is_archive = product.kind_of(version, filename) == "archive"
    return Named(Artifact.release(product.name, version, product.platform_of(version, filename)),
                 is_file=is_archive)
