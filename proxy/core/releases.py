"""The Terraform and OpenTofu CLI releases: products, versions and the names of their files,
checked before any of them names a URL, a cache key or a line in a log. Pure: no I/O.

File names follow the publishers' layouts (releases.hashicorp.com, OpenTofu's GitHub
releases): `terraform_1.11.4_linux_amd64.zip`, `terraform_1.11.4_SHA256SUMS`,
`terraform_1.11.4_SHA256SUMS.sig`, `terraform_1.11.4_SHA256SUMS.72D7468F.sig`;
`tofu_1.9.0_linux_amd64.zip` (or `.tar.gz`), `tofu_1.9.0_SHA256SUMS`, `.gpgsig` (OpenPGP),
`.sig` and `.pem` (cosign)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from proxy.core.errors import BadRequest, NotFound
from proxy.core.models import version_sort_key

# A release version: MAJOR.MINOR.PATCH with an optional pre-release (no build metadata).
_VERSION = re.compile(r"(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})"
                      r"(?:-[0-9A-Za-z]+(?:[.-][0-9A-Za-z]+){0,7})?")
_MAX_VERSION = 64
_PLATFORM_PART = re.compile(r"[a-z0-9]{1,32}")
_KEY_SUFFIX = re.compile(r"\.[0-9A-F]{8}\.sig")
# HashiCorp's release key ID: releases.hashicorp.com publishes `..._SHA256SUMS.72D7468F.sig`,
# and tfenv asks for that name whatever key it verifies with (a mirror re-signed with a
# company's own key keeps the name).
HASHICORP_KEY_ID = "72D7468F"


@dataclass(frozen=True)
class Product:
    """A CLI whose releases the proxy serves."""

    name: str  # "terraform" or "opentofu": in URLs, cache keys and commands
    prefix: str  # of its file names: "terraform", "tofu"
    archive_suffixes: tuple[str, ...]
    # OpenPGP signatures over SHA256SUMS, by suffix ("": any of `.sig`, `.KEYID.sig`).
    signature_suffixes: tuple[str, ...]
    # Served as published but not checked by the proxy (cosign's signature and certificate).
    extra_suffixes: tuple[str, ...]

    def sums_name(self, version: str) -> str:
        """The name of a version's SHA256SUMS."""
        return f"{self.prefix}_{version}_SHA256SUMS"

    def platform_of(self, version: str, filename: str) -> str | None:
        """`os_arch` of one of the version's archives; None for another name."""
        stem = filename.removeprefix(f"{self.prefix}_{version}_")
        if stem == filename:
            return None
        for suffix in self.archive_suffixes:
            if stem.endswith(suffix):
                os, _, arch = stem.removesuffix(suffix).partition("_")
                if _PLATFORM_PART.fullmatch(os) and _PLATFORM_PART.fullmatch(arch):
                    return f"{os}_{arch}"
        return None

    def kind_of(self, version: str, filename: str) -> str:
        """What a file of the version is: "archive", "sums", "signature" or "extra";
        NotFound for a name this product does not publish."""
        sums = self.sums_name(version)
        if filename == sums:
            return "sums"
        if self.platform_of(version, filename) is not None:
            return "archive"
        suffix = filename.removeprefix(sums)
        if suffix != filename:
            if suffix in self.signature_suffixes or (
                    "" in self.signature_suffixes and _KEY_SUFFIX.fullmatch(suffix)):
                return "signature"
            if suffix in self.extra_suffixes:
                return "extra"
        raise NotFound(f"{self.name} {version} has no file {filename[:120]!r}")


TERRAFORM = Product("terraform", "terraform", (".zip",), (".sig", ""), ())
OPENTOFU = Product("opentofu", "tofu", (".zip", ".tar.gz"), (".gpgsig",), (".sig", ".pem"))
PRODUCTS = {product.name: product for product in (TERRAFORM, OPENTOFU)}


def product_named(name: str) -> Product:
    """The product called name (NotFound for any other)."""
    product = PRODUCTS.get(name)
    if product is None:
        raise NotFound(f"no CLI called {name[:40]!r} (terraform, opentofu)")
    return product


def parse_release_version(text: str) -> str:
    """A release version (`1.11.4`, `1.10.0-rc1`); a leading `v` is dropped, as the
    version managers drop it."""
    version = text.removeprefix("v")
    if len(version) > _MAX_VERSION or not _VERSION.fullmatch(version):
        raise BadRequest(f"invalid release version {text[:80]!r}")
    try:  # semver's rules too (no leading zero in a numeric pre-release): it must sort
        version_sort_key(version)
    except ValueError:
        raise BadRequest(f"invalid release version {text[:80]!r}") from None
    return version

