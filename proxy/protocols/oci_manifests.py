"""OpenTofu providers as OCI artifacts: tags, the per-platform image manifests and the index
that names them, built from verified package facts
(https://opentofu.org/docs/cli/oci_registries/provider-mirror/, and OpenTofu's
internal/getproviders/oci_registry_mirror_source.go for what the client checks).

Every document is serialized one way only (fixed key order, no spaces), so its digest is the
same in every process, replica and restart: a digest a client or a registry's pull-through
cache saw yesterday still names the same bytes today."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from proxy.core.errors import BadRequest
from proxy.core.models import Platform

INDEX_MEDIA_TYPE = "application/vnd.oci.image.index.v1+json"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
PROVIDER_ARTIFACT_TYPE = "application/vnd.opentofu.provider"
TARGET_ARTIFACT_TYPE = "application/vnd.opentofu.provider-target"
MODULE_ARTIFACT_TYPE = "application/vnd.opentofu.modulepkg"
ZIP_LAYER_MEDIA_TYPE = "archive/zip"
# The OCI "empty" config: the two bytes `{}`; OpenTofu never reads it.
EMPTY_CONFIG = {"mediaType": "application/vnd.oci.empty.v1+json",
                "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a",
                "size": 2, "data": "e30="}
# Its bytes, served as the config blob of every manifest.
EMPTY_CONFIG_BLOB = b"{}"
_SHA256_HEX = frozenset("0123456789abcdef")


@dataclass(frozen=True)
class Document:
    """A serialized manifest or index: its bytes, digest and media type."""

    body: bytes
    media_type: str

    @property
    def digest(self) -> str:
        """`sha256:HEX` of the bytes, as `Docker-Content-Digest` and descriptors say."""
        return "sha256:" + hashlib.sha256(self.body).hexdigest()


@dataclass(frozen=True)
class PlatformPackage:
    """What a platform manifest needs: the verified zip's sha256 (from the signed
    SHA256SUMS) and its size in bytes."""

    platform: Platform
    sha256: str
    size: int


def tag_of(version: str) -> str:
    """The OCI tag of a provider version: `+` is not allowed in tags, OpenTofu reads `_`."""
    return version.replace("+", "_")


def version_of(tag: str) -> str:
    """The provider version a tag names (the reverse of tag_of)."""
    return tag.replace("_", "+")


def _serialized(document: dict[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=True).encode()


def _check_layer(sha256: str, size: int) -> None:
    if len(sha256) != 64 or not set(sha256) <= _SHA256_HEX:
        raise BadRequest(f"not a sha256 hex digest: {sha256[:80]!r}")
    if size <= 0:
        raise BadRequest(f"a layer cannot be {size} bytes")


def _zip_manifest(artifact_type: str, sha256: str, size: int) -> Document:
    """An image manifest of artifact_type: the empty config and one archive/zip layer."""
    _check_layer(sha256, size)
    return Document(_serialized({
        "schemaVersion": 2,
        "mediaType": MANIFEST_MEDIA_TYPE,
        "artifactType": artifact_type,
        "config": EMPTY_CONFIG,
        "layers": [{"mediaType": ZIP_LAYER_MEDIA_TYPE, "digest": f"sha256:{sha256}",
                    "size": size}],
    }), MANIFEST_MEDIA_TYPE)


def platform_manifest(package: PlatformPackage) -> Document:
    """The image manifest of one platform: the empty config and one archive/zip layer whose
    digest is the package's sha256 (so OpenTofu's `zh:` equals a direct install's)."""
    return _zip_manifest(TARGET_ARTIFACT_TYPE, package.sha256, package.size)


def module_manifest(sha256: str, size: int) -> Document:
    """The image manifest of a module version, as OpenTofu's `oci://` module source takes
    it: the empty config and the module as one archive/zip layer."""
    return _zip_manifest(MODULE_ARTIFACT_TYPE, sha256, size)


def provider_index(manifests: Iterable[tuple[Platform, Document]]) -> Document:
    """The index of a version: one entry per platform manifest, in os_arch order (the
    order is part of the digest)."""
    entries = sorted(manifests, key=lambda pair: pair[0].key)
    keys = [platform.key for platform, _ in entries]
    if len(set(keys)) != len(keys):  # OpenTofu refuses two entries for one platform
        raise ValueError(f"platforms listed twice: {sorted(keys)}")
    return Document(_serialized({
        "schemaVersion": 2,
        "mediaType": INDEX_MEDIA_TYPE,
        "artifactType": PROVIDER_ARTIFACT_TYPE,
        "manifests": [{"mediaType": document.media_type, "digest": document.digest,
                       "size": len(document.body),
                       "platform": {"architecture": platform.arch, "os": platform.os},
                       "artifactType": TARGET_ARTIFACT_TYPE}
                      for platform, document in entries],
    }), INDEX_MEDIA_TYPE)
