"""The fake registry's hashicorp/null provider as the proxy's network mirror serves it."""

from __future__ import annotations

import io
import zipfile

from proxy.verification.hashes import h1_from_entries

BASE = "/mirror/registry.terraform.io/hashicorp/null"
ZIP = "terraform-provider-null_3.2.1_linux_amd64.zip"


def archive_path(platform: str, version: str = "3.2.1") -> str:
    """The mirror path of one platform's archive of hashicorp/null."""
    return f"{BASE}/terraform-provider-null_{version}_{platform}.zip"


def zip_h1(data: bytes) -> str:
    """The h1: hash of a provider zip, as Terraform records it in lock files."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        return h1_from_entries((i.filename, archive.read(i)) for i in archive.infolist())
