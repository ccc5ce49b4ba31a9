"""OCI manifests of OpenTofu providers: the shapes OpenTofu checks
(internal/getproviders/oci_registry_mirror_source.go), built the same way every time."""

from __future__ import annotations

import base64
import hashlib
import json

import pytest

from proxy.core.errors import BadRequest
from proxy.core.models import Platform
from proxy.protocols.oci_manifests import (
    EMPTY_CONFIG,
    PlatformPackage,
    platform_manifest,
    provider_index,
    tag_of,
    version_of,
)

LINUX = Platform("linux", "amd64")
DARWIN = Platform("darwin", "arm64")
ZIP_SHA = "ab" * 32


def test_the_empty_config_is_the_oci_empty_descriptor() -> None:
    assert base64.b64decode(EMPTY_CONFIG["data"]) == b"{}"
    assert EMPTY_CONFIG["digest"] == "sha256:" + hashlib.sha256(b"{}").hexdigest()


@pytest.mark.parametrize(("version", "tag"), [("1.2.3", "1.2.3"),
                                               ("1.0.0+build.5", "1.0.0_build.5"),
                                               ("2.0.0-rc.1", "2.0.0-rc.1")])
def test_versions_and_tags(version: str, tag: str) -> None:
    assert tag_of(version) == tag
    assert version_of(tag) == version


def test_a_platform_manifest_has_one_zip_layer_whose_digest_is_the_packages_sha256() -> None:
    manifest = platform_manifest(PlatformPackage(LINUX, ZIP_SHA, 268))
    assert json.loads(manifest.body) == {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "artifactType": "application/vnd.opentofu.provider-target",
        "config": EMPTY_CONFIG,
        "layers": [{"mediaType": "archive/zip", "digest": f"sha256:{ZIP_SHA}", "size": 268}],
    }
    assert manifest.digest == "sha256:" + hashlib.sha256(manifest.body).hexdigest()


@pytest.mark.parametrize(("sha256", "size"), [("AB" * 32, 1), ("ab" * 31, 1), ("zz" * 32, 1),
                                              (ZIP_SHA, 0)])
def test_a_manifest_is_only_built_from_a_real_digest_and_size(sha256: str, size: int) -> None:
    with pytest.raises(BadRequest):
        platform_manifest(PlatformPackage(LINUX, sha256, size))


def test_the_index_names_each_platform_manifest_in_a_fixed_order() -> None:
    linux = platform_manifest(PlatformPackage(LINUX, ZIP_SHA, 268))
    darwin = platform_manifest(PlatformPackage(DARWIN, "cd" * 32, 300))
    index = provider_index([(LINUX, linux), (DARWIN, darwin)])
    assert provider_index([(DARWIN, darwin), (LINUX, linux)]) == index  # order given: no matter
    document = json.loads(index.body)
    assert document["mediaType"] == "application/vnd.oci.image.index.v1+json"
    assert document["artifactType"] == "application/vnd.opentofu.provider"
    assert document["manifests"] == [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": darwin.digest,
         "size": len(darwin.body), "platform": {"architecture": "arm64", "os": "darwin"},
         "artifactType": "application/vnd.opentofu.provider-target"},
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": linux.digest,
         "size": len(linux.body), "platform": {"architecture": "amd64", "os": "linux"},
         "artifactType": "application/vnd.opentofu.provider-target"}]
    with pytest.raises(ValueError, match="twice"):  # OpenTofu refuses an ambiguous index
        provider_index([(LINUX, linux), (LINUX, linux)])


def test_digests_do_not_change_between_releases_of_the_proxy() -> None:
    # Clients and registries' pull-through caches keep digests: the serialization is fixed.
    manifest = platform_manifest(PlatformPackage(LINUX, ZIP_SHA, 268))
    assert manifest.body == (
        b'{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json",'
        b'"artifactType":"application/vnd.opentofu.provider-target","config":{"mediaType":'
        b'"application/vnd.oci.empty.v1+json","digest":"sha256:44136fa355b3678a1146ad16f7e8649'
        b'e94fb4fc21fe77e8310c060f61caaff8a","size":2,"data":"e30="},"layers":[{"mediaType":'
        b'"archive/zip","digest":"sha256:' + ZIP_SHA.encode() + b'","size":268}]}')
