"""What a bundle manifest says the bundle carries (provider packages, module archives,
version lists), checked field by field before any of it names a file, a cache key or a word
on the operator's terminal: addresses are normalized as the proxy normalizes requests, each
member has one role, each package and module version appears once. Pure: no I/O."""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from proxy.airgap.manifest import MANIFEST, BundleError
from proxy.core.errors import BadRequest, NotFound
from proxy.core.models import (
    ModuleAddress,
    Platform,
    ProviderAddress,
    parse_module_version,
    parse_version,
)
from proxy.core.releases import Product, parse_release_version, product_named
from proxy.store import layout
from proxy.verification.packages import SUMS_ID

_SHASUM = re.compile(r"[0-9a-f]{64}")
_H1 = re.compile(r"h1:[A-Za-z0-9+/]{43}=")
_MAX_TEXT = 4096
_MAX_KEYS = 16


def shown(value: object) -> str:
    """A value from the manifest as a message may show it: quoted and escaped (a string
    could carry terminal control sequences), cut short; other types by their kind only."""
    if isinstance(value, str):
        return repr(value[:100]) + ("..." if len(value) > 100 else "")
    return f"a JSON {_KINDS.get(type(value), type(value).__name__)}"


_KINDS = {dict: "object", list: "array", str: "string", int: "number", float: "number",
          bool: "boolean", type(None): "null"}


@dataclass(frozen=True)
class ProviderEntry:
    """One provider package, and the members that hold its zip, SHA256SUMS and signature."""

    provider: ProviderAddress
    version: str
    platform: Platform
    filename: str
    shasum: str
    h1: str | None
    sums_id: str
    zip: str
    sums: str
    signature: str
    document: dict[str, Any] | None
    signing_keys: tuple[str, ...]  # armored, from the download document

    def __str__(self) -> str:
        return f"{self.provider} {self.version} {self.platform.key}"

    @property
    def record_key(self) -> str:
        """The index key of the package's verified facts."""
        return layout.package_record(self.provider, self.version, self.platform)

    @property
    def sums_key(self) -> str:
        """The index key of its SHA256SUMS and signature."""
        return layout.sums_record(self.provider, self.version, self.sums_id)

    @property
    def archive_key(self) -> str:
        """The store key of the zip."""
        return layout.provider_archive(self.provider, self.version, self.platform)


@dataclass(frozen=True)
class ModuleEntry:
    """One module archive."""

    module: ModuleAddress
    version: str
    archive: str  # the member
    # When the exporting proxy first saw the version in upstream's list (epoch seconds;
    # None: not known): the version policy's cooldown counts from it.
    first_seen: float | None = None

    def __str__(self) -> str:
        return f"{self.module} {self.version}"

    @property
    def archive_key(self) -> str:
        """The store key of the archive."""
        return layout.module_archive(self.module, self.version)


@dataclass(frozen=True)
class ReleaseEntry:
    """One archive of a CLI release, and the members holding its SHA256SUMS and the
    signature files served with it (by file name)."""

    product: Product
    version: str
    filename: str
    sha256: str
    archive: str
    sums: str
    signatures: dict[str, str]
    extras: dict[str, str]

    def __str__(self) -> str:
        return f"{self.product.name} {self.version} {self.filename}"

    @property
    def archive_key(self) -> str:
        """The store key of the archive."""
        return layout.release_file(self.product.name, self.version, self.filename)


@dataclass(frozen=True)
class VersionList:
    """A provider's version list as the exporter held it (entries rebuilt from checked
    fields: version, protocols, platform keys)."""

    provider: ProviderAddress
    entries: tuple[dict[str, Any], ...]


@dataclass(frozen=True)
class BundleContents:
    """Everything the manifest says the bundle carries."""

    providers: tuple[ProviderEntry, ...]
    modules: tuple[ModuleEntry, ...]
    versions: tuple[VersionList, ...]
    releases: tuple[ReleaseEntry, ...] = ()


class _Fields:
    """Typed access to one JSON object of the manifest; errors name where it is."""

    def __init__(self, value: object, where: str) -> None:
        if not isinstance(value, dict):
            raise BundleError(f"{MANIFEST}: {where} is {shown(value)}, not an object")
        self.value: dict[str, Any] = value
        self.where = where

    def fail(self, key: str, why: str) -> BundleError:
        """An error naming the field."""
        return BundleError(f"{MANIFEST}: {self.where}.{key}: {why}")

    def text(self, key: str, pattern: re.Pattern[str] | None = None) -> str:
        """A string field (matching pattern, when given)."""
        value = self.value.get(key)
        if not isinstance(value, str) or not value or len(value) > _MAX_TEXT:
            raise self.fail(key, f"{shown(value)} is not a valid string")
        if pattern is not None and not pattern.fullmatch(value):
            raise self.fail(key, f"{shown(value)} is not valid")
        return value

    def parsed(self, key: str, parse: Any) -> Any:
        """A string field through a models parser (BadRequest: invalid)."""
        raw = self.text(key)
        try:
            return parse(raw)
        except BadRequest as exc:
            raise self.fail(key, exc.message) from None


def parse_contents(manifest: dict[str, Any], listed: Collection[str]) -> BundleContents:
    """The manifest's providers, modules and versions, every field checked; BundleError names
    the first problem (the entry, the field, the value escaped)."""
    providers, modules = manifest.get("providers"), manifest.get("modules")
    versions = manifest.get("versions", {})
    if not isinstance(providers, list) or not isinstance(modules, list) \
            or not isinstance(versions, dict):
        wrong = next(f"{name} is {shown(value)}, not a JSON {kind}" for name, value, kind in (
            ("providers", providers, "array"), ("modules", modules, "array"),
            ("versions", versions, "object")) if not isinstance(
                value, list if kind == "array" else dict))
        raise BundleError(f"{MANIFEST}: {wrong}")
    releases = manifest.get("releases", [])
    if not isinstance(releases, list):
        raise BundleError(f"{MANIFEST}: releases is {shown(releases)}, not a JSON array")
    roles = _Roles(listed)
    parsed_providers = [_provider(item, f"providers[{i}]", roles)
                        for i, item in enumerate(providers)]
    parsed_modules = [_module(item, f"modules[{i}]", roles) for i, item in enumerate(modules)]
    parsed_releases = [_release(item, f"releases[{i}]", roles)
                       for i, item in enumerate(releases)]
    roles.all_used()
    _refuse_repeats([(p.record_key, str(p)) for p in parsed_providers]
                    + [(m.archive_key, str(m)) for m in parsed_modules]
                    + [(r.archive_key, str(r)) for r in parsed_releases])
    held = {p.provider for p in parsed_providers}
    lists: dict[ProviderAddress, VersionList] = {}
    for address, entries in versions.items():
        version_list = _version_list(address, entries)
        if version_list.provider not in held:
            raise BundleError(f"{MANIFEST}: versions: {version_list.provider} has a version "
                              "list but no package in the bundle")
        if version_list.provider in lists:
            raise BundleError(f"{MANIFEST}: versions: {version_list.provider} listed twice")
        lists[version_list.provider] = version_list
    return BundleContents(tuple(parsed_providers), tuple(parsed_modules),
                          tuple(lists.values()), tuple(parsed_releases))


class _Roles:
    """Which role each member plays: one each (a zip, a module archive, the SHA256SUMS or the
    signature of one release, which its platforms share), and every listed member one."""

    def __init__(self, listed: Collection[str]) -> None:
        self._listed = listed
        self._roles: dict[str, tuple[str, bool]] = {}

    def claim(self, fields: _Fields, key: str, role: str, shared: bool = False) -> str:
        """The member fields[key] names, now playing role."""
        member = fields.value.get(key)
        if not isinstance(member, str) or member not in self._listed:
            raise fields.fail(key, f"{shown(member)} is not a member listed in files")
        previous = self._roles.get(member)
        if previous is not None and (previous != (role, True) or not shared):
            raise BundleError(f"{member}: used as {previous[0]} and as {role}")
        self._roles[member] = (role, shared)
        return member

    def all_used(self) -> None:
        """Every listed member plays a role."""
        for member in self._listed:
            if member not in self._roles:
                raise BundleError(f"{member}: listed in files but used by no entry")


def _refuse_repeats(keys: list[tuple[str, str]]) -> None:
    seen: set[str] = set()
    for key, label in keys:
        if key in seen:
            raise BundleError(f"{MANIFEST}: {label} is listed twice")
        seen.add(key)


def _provider(item: object, where: str, roles: _Roles) -> ProviderEntry:
    fields = _Fields(item, where)
    try:
        provider = ProviderAddress.parse(fields.text("hostname"), fields.text("namespace"),
                                         fields.text("type"))
    except BadRequest as exc:
        raise BundleError(f"{MANIFEST}: {where}: {exc.message}") from None
    version: str = fields.parsed("version", parse_version)
    platform: Platform = fields.parsed("platform", Platform.from_key)
    label = f"{where} ({provider} {version} {platform.key})"
    fields.where = label
    filename = fields.text("filename")
    # The signature binds file name to checksum; the file name binds version and platform.
    if filename != provider.archive_filename(version, platform):
        raise fields.fail("filename", f"{shown(filename)} is not the package of {version} "
                          f"{platform.key}")
    shasum = fields.text("shasum", _SHASUM)
    h1 = fields.value.get("h1")
    if h1 is not None:
        h1 = fields.text("h1", _H1)
    sums_id = fields.text("sums_id", SUMS_ID)
    release = f"{provider} {version} ({sums_id})"
    document, keys = _document(fields, filename, shasum, platform)
    return ProviderEntry(
        provider, version, platform, filename, shasum, h1, sums_id,
        zip=roles.claim(fields, "zip", f"the zip of {provider} {version} {platform.key}"),
        sums=roles.claim(fields, "sums", f"the SHA256SUMS of {release}", shared=True),
        signature=roles.claim(fields, "signature", f"the SHA256SUMS signature of {release}",
                              shared=True),
        document=document, signing_keys=keys)


def _document(fields: _Fields, filename: str, shasum: str, platform: Platform,
              ) -> tuple[dict[str, Any] | None, tuple[str, ...]]:
    """The download document (None: none carried) and the armored keys it carries."""
    document = fields.value.get("document")
    if document is None or document == {}:
        return None, ()
    if not isinstance(document, dict):
        raise fields.fail("document", f"{shown(document)}, not an object")
    if (document.get("filename"), document.get("shasum"), document.get("os"),
            document.get("arch")) != (filename, shasum, platform.os, platform.arch):
        raise fields.fail("document", "the download document does not describe this "
                          "package")
    # As a live fill reads them: keys in any other shape are not keys.
    block = document.get("signing_keys")
    listed = block.get("gpg_public_keys") if isinstance(block, dict) else None
    keys = tuple(key["ascii_armor"] for key in (listed or [])[:_MAX_KEYS]
                 if isinstance(key, dict) and isinstance(key.get("ascii_armor"), str)) \
        if isinstance(listed, list) else ()
    return document, keys


def _module(item: object, where: str, roles: _Roles) -> ModuleEntry:
    fields = _Fields(item, where)
    try:
        module = ModuleAddress.parse(fields.text("hostname"), fields.text("namespace"),
                                     fields.text("name"), fields.text("system"))
    except BadRequest as exc:
        raise BundleError(f"{MANIFEST}: {where}: {exc.message}") from None
    version: str = fields.parsed("version", parse_module_version)
    fields.where = f"{where} ({module} {version})"
    first_seen = fields.value.get("first_seen")
    if first_seen is not None and (isinstance(first_seen, bool) or
                                   not isinstance(first_seen, int | float) or first_seen < 0):
        raise fields.fail("first_seen", f"{shown(first_seen)} is not a time (epoch seconds)")
    return ModuleEntry(module, version, roles.claim(
        fields, "archive", f"the archive of module {module} {version}"),
        None if first_seen is None else float(first_seen))


def _release(item: object, where: str, roles: _Roles) -> ReleaseEntry:
    fields = _Fields(item, where)
    try:
        product = product_named(fields.text("product"))
    except NotFound as exc:
        raise fields.fail("product", exc.message) from None
    version: str = fields.parsed("version", parse_release_version)
    filename = fields.text("filename")
    fields.where = f"{where} ({product.name} {version})"
    if product.platform_of(version, filename) is None:
        raise fields.fail("filename", f"{shown(filename)} is not an archive of {product.name} "
                          f"{version}")
    release = f"{product.name} {version}"

    def named(key: str, kinds: tuple[str, ...]) -> dict[str, str]:
        value = fields.value.get(key, {})
        if not isinstance(value, dict) or len(value) > _MAX_KEYS:
            raise fields.fail(key, f"{shown(value)} is not an object of file names")
        members = {}
        for name in value:
            try:
                kind = product.kind_of(version, str(name))
            except NotFound:
                kind = ""
            if kind not in kinds:
                raise fields.fail(key, f"{shown(name)} is not such a file of {release}")
            members[str(name)] = roles.claim(_Fields(value, f"{fields.where}.{key}"), name,
                                             f"{name} of {release}", shared=True)
        return members

    return ReleaseEntry(
        product, version, filename, fields.text("sha256", _SHASUM),
        archive=roles.claim(fields, "archive", f"the archive {filename}"),
        sums=roles.claim(fields, "sums", f"the SHA256SUMS of {release}", shared=True),
        signatures=named("signatures", ("signature",)), extras=named("extras", ("extra",)))


def _version_list(address: str, entries: object) -> VersionList:
    where = f"versions[{shown(address)}]"
    parts = address.split("/")
    try:
        if len(parts) != 3:
            raise BadRequest("not HOSTNAME/NAMESPACE/TYPE")
        provider = ProviderAddress.parse(*parts)
    except BadRequest as exc:
        raise BundleError(f"{MANIFEST}: {where}: {exc.message}") from None
    if not isinstance(entries, list):
        raise BundleError(f"{MANIFEST}: {where} is {shown(entries)}, not an array")
    checked = []
    for i, item in enumerate(entries):
        fields = _Fields(item, f"{where}[{i}]")
        version = fields.parsed("version", parse_version)
        protocols, platforms = fields.value.get("protocols"), fields.value.get("platforms")
        if not isinstance(protocols, list) or not all(
                isinstance(p, str) and 0 < len(p) <= 32 and p.isprintable()
                for p in protocols):
            raise fields.fail("protocols", "not an array of protocol versions")
        if not isinstance(platforms, list) or not all(isinstance(p, str) for p in platforms):
            raise fields.fail("platforms", "not an array of OS_ARCH strings")
        try:
            keys = list(dict.fromkeys(Platform.from_key(p).key for p in platforms))
        except BadRequest as exc:
            raise fields.fail("platforms", exc.message) from None
        checked.append({"version": version, "protocols": list(protocols), "platforms": keys})
    return VersionList(provider, tuple(checked))
