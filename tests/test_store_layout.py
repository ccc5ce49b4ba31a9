"""The storage layout: the keys are the paths and index keys earlier releases wrote (a cache
directory keeps working across the upgrade), and what parses a key reads back what built it."""

from __future__ import annotations

import pytest

from proxy.core.models import ModuleAddress, Platform, ProviderAddress
from proxy.store import layout
from proxy.store.file_identity import FileIdentity
from proxy.store.protocol import BlobInfo, check_key

PROVIDER = ProviderAddress("registry.terraform.io", "hashicorp", "null")
LINUX = Platform("linux", "amd64")
MODULE = ModuleAddress("registry.terraform.io", "acme", "net", "aws")


def test_keys_are_the_paths_and_index_keys_of_earlier_releases() -> None:
    assert layout.provider_archive(PROVIDER, "3.2.1", LINUX) == (
        "archives/registry.terraform.io/hashicorp/null/3.2.1/"
        "terraform-provider-null_3.2.1_linux_amd64.zip")
    assert layout.module_archive(MODULE, "1.2.0") == \
        "modules/registry.terraform.io/acme/net/aws/1.2.0.tar.gz"
    assert layout.package_record(PROVIDER, "3.2.1", LINUX) == \
        "package/registry.terraform.io/hashicorp/null/3.2.1/linux_amd64"
    assert layout.sums_record(PROVIDER, "3.2.1", "ab" * 16) == \
        f"sums/registry.terraform.io/hashicorp/null/3.2.1/{'ab' * 16}"
    assert layout.version_list_record(PROVIDER) == "versions/registry.terraform.io/hashicorp/null"
    assert layout.module_archive_record(MODULE, "1.2.0") == \
        "module-archive/registry.terraform.io/acme/net/aws/1.2.0"
    assert layout.module_version_list_record(MODULE) == \
        "module-versions/registry.terraform.io/acme/net/aws"
    for key in (layout.provider_archive(PROVIDER, "3.2.1", LINUX),
                layout.module_archive(MODULE, "1.2.0")):
        assert check_key(key) == key


def test_parsing_a_key_reads_back_what_built_it() -> None:
    assert layout.parse_package_record(layout.package_record(PROVIDER, "3.2.1", LINUX)) == \
        (PROVIDER, "3.2.1", LINUX)
    assert layout.parse_module_archive(layout.module_archive(MODULE, "1.2.0")) == \
        (MODULE, "1.2.0")


@pytest.mark.parametrize("key", [
    "package/registry.terraform.io/hashicorp/null/3.2.1",          # a segment short
    "package/registry.terraform.io/hashicorp/null/3.2.1/linux",    # not a platform
    "sums/registry.terraform.io/hashicorp/null/3.2.1/linux_amd64",  # another kind
])
def test_other_index_keys_are_not_package_records(key: str) -> None:
    assert layout.parse_package_record(key) is None


@pytest.mark.parametrize("key", [
    "modules/registry.terraform.io/acme/net/aws/.tar.gz",
    "modules/registry.terraform.io/acme/net/aws/1.2.0.zip",
    "modules/registry.terraform.io/acme/net/1.2.0.tar.gz",
    "archives/registry.terraform.io/acme/net/aws/1.2.0.tar.gz",
])
def test_other_blob_keys_are_not_module_archives(key: str) -> None:
    assert layout.parse_module_archive(key) is None


def test_versions_held_are_read_from_a_listing() -> None:
    def info(key: str) -> BlobInfo:
        return BlobInfo(key, 1, 0.0, FileIdentity(0, 0, 1, 0))

    listed = [info(layout.provider_archive(PROVIDER, version, LINUX))
              for version in ("3.1.0", "3.2.1", "3.2.1")]
    listed.append(info(layout.provider_prefix(PROVIDER) + "stray-file"))  # not a version dir
    assert layout.versions_held(PROVIDER, listed) == {"3.1.0", "3.2.1"}
