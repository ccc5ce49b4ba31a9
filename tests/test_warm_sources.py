"""Reading what to warm: configurations, lock files and list files."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.airgap.sources import SourceError, read_sources


def test_configuration_with_local_modules(tmp_path: Path) -> None:
    (tmp_path / "main.tf").write_text('''
terraform {
  required_providers {
    null   = { source = "hashicorp/null", version = "~> 3.1" }
    random = {
      source  = "registry.terraform.io/hashicorp/random"
      version = ">= 3.0, < 4.0"
    }
  }
}
module "net" {
  source  = "acme/net/aws"
  version = "1.2.0"
}
module "inner" {
  source = "./modules/inner"
}
module "git" {
  source = "git::https://example.com/x.git"
}
module "github" {
  source = "github.com/hashicorp/example"
}
''')
    (tmp_path / "modules/inner").mkdir(parents=True)
    (tmp_path / "modules/inner/main.tf").write_text('''
terraform {
  required_providers {
    tls = { source = "hashicorp/tls" }
  }
}
module "sub" {
  source  = "registry.terraform.io/acme/tarball/aws"
  version = "~> 1.0"
}
''')
    found = {(str(r.address), r.constraint, r.kind) for r in read_sources([str(tmp_path)])}
    assert found == {
        ("registry.terraform.io/hashicorp/null", "~> 3.1", "provider"),
        ("registry.terraform.io/hashicorp/random", ">= 3.0, < 4.0", "provider"),
        ("registry.terraform.io/acme/net/aws", "1.2.0", "module"),
        ("registry.terraform.io/hashicorp/tls", "", "provider"),
        ("registry.terraform.io/acme/tarball/aws", "~> 1.0", "module"),
    }


def test_lock_file_and_list(tmp_path: Path) -> None:
    lock = tmp_path / ".terraform.lock.hcl"
    lock.write_text('provider "registry.terraform.io/hashicorp/null" {\n  version = "3.2.1"\n'
                    '  hashes = ["h1:x"]\n}\n')
    listing = tmp_path / "list.txt"
    listing.write_text("# wanted\nregistry.terraform.io/hashicorp/aws ~> 5.0\n"
                       "acme/net/aws 1.2.0\nhashicorp/random\n")
    found = {(str(r.address), r.constraint) for r in read_sources([str(lock), str(listing)])}
    assert found == {("registry.terraform.io/hashicorp/null", "3.2.1"),
                     ("registry.terraform.io/hashicorp/aws", "~> 5.0"),
                     ("registry.terraform.io/acme/net/aws", "1.2.0"),
                     ("registry.terraform.io/hashicorp/random", "")}


@pytest.mark.parametrize("content", ["not/a/valid/provider/address x", "../etc/passwd 1.0",
                                     "hashicorp/null ~> 1.x"])
def test_bad_list_lines(tmp_path: Path, content: str) -> None:
    listing = tmp_path / "list.txt"
    listing.write_text(content + "\n")
    with pytest.raises(SourceError):
        read_sources([str(listing)])


def test_missing_source() -> None:
    with pytest.raises(SourceError, match="no such file"):
        read_sources(["/nonexistent/dir"])
