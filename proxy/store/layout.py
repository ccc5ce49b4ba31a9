"""The storage layout: every key the proxy stores blobs and index documents under is spelled
here, and nowhere else. Callers ask for keys by what they name; a backend maps keys to files,
dict entries or object names (see proxy.store.protocol).

Blobs: `archives/HOST/NAMESPACE/TYPE/VERSION/terraform-provider-TYPE_VERSION_OS_ARCH.zip`
`modules/HOST/NAMESPACE/NAME/SYSTEM/VERSION.tar.gz` (and `VERSION.zip`, the same module
as an OCI layer) and `releases/PRODUCT/VERSION/FILE` (CLI release archives). Index
documents: `package/...`, `sums/...`, `versions/...`, `module-archive/...`,
`module-versions/...`, `module-zip/...`, `oci-manifests/...`, `oci-layers/...`,
`release/...`, `release-file/...`, `release-versions/...`. These are the paths the cache
directory has always used: a cache written by an earlier release reads as is."""

from __future__ import annotations

from collections.abc import Iterable

from proxy.core.errors import BadRequest
from proxy.core.models import ModuleAddress, Platform, ProviderAddress
from proxy.store.protocol import BlobInfo

PROVIDER_AREA = "archives"
MODULE_AREA = "modules"
RELEASE_AREA = "releases"
# The blob areas, in the order the disk backend counts and evicts them.
AREAS = (PROVIDER_AREA, MODULE_AREA, RELEASE_AREA)
# Under cache.dir: where an object-store backend keeps its local hot copies.
HOT_COPIES_DIR = "s3"
_MODULE_SUFFIX = ".tar.gz"
_MODULE_ZIP_SUFFIX = ".zip"


# --- blobs ---------------------------------------------------------------------------------

def provider_prefix(provider: ProviderAddress) -> str:
    """The prefix of every stored package of a provider (its versions below it)."""
    return f"{PROVIDER_AREA}/{provider.hostname}/{provider.namespace}/{provider.type}/"


def provider_archive(provider: ProviderAddress, version: str, platform: Platform) -> str:
    """The key of a provider package's zip."""
    return f"{provider_prefix(provider)}{version}/{provider.archive_filename(version, platform)}"


def version_of_provider_archive(provider: ProviderAddress, key: str) -> str | None:
    """The version a key under provider_prefix(provider) is stored for; None if it is not
    a package's key."""
    rest = key.removeprefix(provider_prefix(provider))
    version, _, name = rest.partition("/")
    return version if rest != key and name and "/" not in name else None


def parse_provider_archive(key: str) -> tuple[ProviderAddress, str, Platform] | None:
    """The package a provider_archive key names; None for another key."""
    parts = key.split("/")
    if len(parts) != 6 or parts[0] != PROVIDER_AREA:
        return None
    provider = ProviderAddress(parts[1], parts[2], parts[3])
    try:
        version, platform = provider.parse_archive_filename(parts[5])
    except BadRequest:
        return None
    return (provider, version, platform) if version == parts[4] else None


def versions_held(provider: ProviderAddress, listed: Iterable[BlobInfo]) -> set[str]:
    """The versions of provider that a listing under provider_prefix(provider) holds at
    least one package of."""
    versions = (version_of_provider_archive(provider, info.key) for info in listed)
    return {version for version in versions if version is not None}


def module_archive(module: ModuleAddress, version: str) -> str:
    """The key of a module version's repacked archive."""
    return (f"{MODULE_AREA}/{module.hostname}/{module.namespace}/{module.name}/"
            f"{module.system}/{version}{_MODULE_SUFFIX}")


def module_archive_prefix() -> str:
    """The prefix of every stored module archive."""
    return f"{MODULE_AREA}/"


def parse_module_archive(key: str) -> tuple[ModuleAddress, str] | None:
    """The module and version a module archive key names; None for another key."""
    parts = key.split("/")
    if len(parts) != 6 or parts[0] != MODULE_AREA or not parts[5].endswith(_MODULE_SUFFIX):
        return None
    version = parts[5].removesuffix(_MODULE_SUFFIX)
    if not version:
        return None
    return ModuleAddress(parts[1], parts[2], parts[3], parts[4]), version


def release_file(product: str, version: str, filename: str) -> str:
    """The key of a CLI release's archive (product and file name already checked)."""
    return f"{RELEASE_AREA}/{product}/{version}/{filename}"


def release_prefix(product: str) -> str:
    """The prefix of every stored archive of a product's releases."""
    return f"{RELEASE_AREA}/{product}/"


def parse_release_file(key: str) -> tuple[str, str, str] | None:
    """The product, version and file name a release archive key names; None for another."""
    parts = key.split("/")
    if len(parts) != 4 or parts[0] != RELEASE_AREA or not all(parts[1:]):
        return None
    return parts[1], parts[2], parts[3]


# --- index documents -----------------------------------------------------------------------

PACKAGE_RECORDS = "package/"


def package_record(provider: ProviderAddress, version: str, platform: Platform) -> str:
    """The index key of a package's verified facts."""
    return f"{PACKAGE_RECORDS}{provider}/{version}/{platform.key}"


def parse_package_record(key: str) -> tuple[ProviderAddress, str, Platform] | None:
    """The package a package_record key names; None for another key."""
    parts = key.split("/")
    if len(parts) != 6 or f"{parts[0]}/" != PACKAGE_RECORDS:
        return None
    try:
        platform = Platform.from_key(parts[5])
    except BadRequest:
        return None
    return ProviderAddress(parts[1], parts[2], parts[3]), parts[4], platform


def sums_record(provider: ProviderAddress, version: str, sums_id: str) -> str:
    """The index key of a verified SHA256SUMS and its signature."""
    return f"sums/{provider}/{version}/{sums_id}"


def version_list_record(provider: ProviderAddress) -> str:
    """The index key of a provider's version list."""
    return f"versions/{provider}"


def module_archive_record(module: ModuleAddress, version: str) -> str:
    """The index key of what was recorded about a stored module archive: its sha256, size
    and identity (`sha256`, `size`, `stored_as`)."""
    return f"{MODULE_ARCHIVE_RECORDS}{module}/{version}"


def module_version_list_record(module: ModuleAddress) -> str:
    """The index key of a module's version list."""
    return f"module-versions/{module}"


def oci_document_record(repository: str, digest_hex: str) -> str:
    """The index key of an OCI manifest or index served for repository (`providers/...`,
    `modules/...`), by its sha256: a digest handed out once stays resolvable (by every
    replica, after restarts)."""
    return f"oci-manifests/{repository}/{digest_hex}"


def oci_layer_record(repository: str, sha256: str) -> str:
    """The index key naming what the OCI layer with this sha256 in repository is (a
    provider's version and platform, a module's version)."""
    return f"oci-layers/{repository}/{sha256}"


def module_zip(module: ModuleAddress, version: str) -> str:
    """The key of a module version as the zip its OCI layer is, made from its archive (not
    a module archive: the commands that list and verify archives leave it alone)."""
    return module_archive(module, version).removesuffix(_MODULE_SUFFIX) + _MODULE_ZIP_SUFFIX


def parse_module_zip(key: str) -> tuple[ModuleAddress, str] | None:
    """The module and version a module zip key names; None for another key."""
    if not key.endswith(_MODULE_ZIP_SUFFIX):
        return None
    return parse_module_archive(key.removesuffix(_MODULE_ZIP_SUFFIX) + _MODULE_SUFFIX)


def module_zip_record(module: ModuleAddress, version: str) -> str:
    """The index key of a module zip's sha256, size and stored identity."""
    return f"{MODULE_ZIP_RECORDS}{module}/{version}"


def record_of_blob(key: str) -> str | None:
    """The index key of the record that vouches for the blob at key (a package's verified
    facts, a module archive's sha256); None for a key that names no package or module."""
    package = parse_provider_archive(key)
    if package is not None:
        return package_record(*package)
    module = parse_module_archive(key)
    return None if module is None else module_archive_record(*module)


def blob_of_record(key: str) -> str | None:
    """The blob a record_of_blob key (or a module zip's record) vouches for; None for
    another key."""
    parts = key.split("/")
    if f"{parts[0]}/" == MODULE_ARCHIVE_RECORDS and len(parts) == 6 and parts[5]:
        return module_archive(ModuleAddress(*parts[1:5]), parts[5])
    if f"{parts[0]}/" == MODULE_ZIP_RECORDS and len(parts) == 6 and parts[5]:
        return module_zip(ModuleAddress(*parts[1:5]), parts[5])
    package = parse_package_record(key)
    return None if package is None else provider_archive(*package)


def vouching_sha256(key: str) -> tuple[str, str] | None:
    """Where the sha256 that a blob's bytes must have is recorded: the index key of the record
    that vouches for the blob at key and the record's field that holds it (a package's signed
    `shasum`, the `sha256` of a module archive, a module zip or a release archive); None for
    a key that names none of them."""
    package = parse_provider_archive(key)
    if package is not None:
        return package_record(*package), "shasum"
    module = parse_module_archive(key)
    if module is not None:
        return module_archive_record(*module), "sha256"
    module = parse_module_zip(key)
    if module is not None:
        return module_zip_record(*module), "sha256"
    release = parse_release_file(key)
    return None if release is None else (release_file_record(*release), "sha256")


MODULE_ARCHIVE_RECORDS = "module-archive/"
MODULE_ZIP_RECORDS = "module-zip/"
RELEASE_RECORDS = "release/"


def release_record(product: str, version: str) -> str:
    """The index key of a release's verified SHA256SUMS and the signatures served with it."""
    return f"{RELEASE_RECORDS}{product}/{version}"


def release_file_record(product: str, version: str, filename: str) -> str:
    """The index key of a stored release archive's sha256 and identity."""
    return f"release-file/{product}/{version}/{filename}"


def release_list_record(product: str) -> str:
    """The index key of a product's release list (versions and their files)."""
    return f"release-versions/{product}"
# Fill leases (`leases/NAME`, with an `expires_at`): what a replica that died mid-fill
# leaves behind, until prune removes it.
LEASE_RECORDS = "leases/"


# --- fill locks ----------------------------------------------------------------------------

def provider_fill(provider: ProviderAddress, version: str, platform: Platform) -> str:
    """The name of the lock one package's fill (or drop) holds."""
    return f"{provider}/{version}/{platform.key}"


def module_fill(module: ModuleAddress, version: str) -> str:
    """The name of the lock one module archive's fill (or drop) holds."""
    return f"module/{module}/{version}"


def module_zip_fill(module: ModuleAddress, version: str) -> str:
    """The fill-lock name of making one module version's zip."""
    return f"module-zip/{module}/{version}"


def release_fill(product: str, version: str, filename: str) -> str:
    """The fill-lock name of one release file (and of its SHA256SUMS check: the file name
    SHA256SUMS)."""
    return f"release/{product}/{version}/{filename}"


# --- release times (the version policy) --------------------------------------------------

SIGHTINGS_RECORDS = "sightings/"


def sightings_record(kind: str, address: str) -> str:
    """The index key of when this proxy (any replica) saw each version of an address in
    upstream's list: kind provider, module or cli; address as the artifact is named (a
    provider's or module's full address, the CLI's product)."""
    return f"{SIGHTINGS_RECORDS}{kind}/{address}"
