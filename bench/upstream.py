"""The upstream every figure is measured against: the tests' fake registry (real zips,
SHA256SUMS and OpenPGP signatures) on loopback, with the releases the figure groups need."""

from __future__ import annotations

import hashlib
import io
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import trustme

from tests.support.fake_registry import FakeRegistry
from tests.support.gpg import GpgKey, generate_key, stop_agent

HOST = "registry.terraform.io"
# The providers of the `terraform init` figure (hashicorp/<type> 3.2.1) and its module.
TERRAFORM_PROVIDERS = ("null", "random", "local", "tls")
TERRAFORM_VERSION = "3.2.1"
MODULE = ("acme", "net", "aws", "1.0.0")
# The JSON figures' releases: one with every platform's zip fetched (its documents complete),
# one with a platform never fetched (incomplete, the normal case).
DOCUMENT_PLATFORMS = ("linux_amd64", "darwin_arm64")
DOCUMENT_STATES = {"complete": "full", "incomplete": "partial"}


def big_zip(size: int, seed: str) -> bytes:
    """A stored (not deflated) provider zip of about size bytes: its size is the real one."""
    chunk = hashlib.sha256(seed.encode()).digest()
    block = b"".join(hashlib.sha256(chunk + i.to_bytes(4, "big")).digest() for i in range(2048))
    binary = (block * (size // len(block) + 1))[:size]
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        info = zipfile.ZipInfo(f"terraform-provider-{seed}_v1.0.0", (2024, 1, 1, 0, 0, 0))
        info.external_attr = 0o755 << 16
        archive.writestr(info, binary)
    return buffer.getvalue()


def module_tarball() -> bytes:
    """The bench module's source: one output, gzipped tar."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        content = b'output "name" {\n  value = "net"\n}\n'
        info = tarfile.TarInfo("main.tf")
        info.size = len(content)
        tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


@dataclass(frozen=True)
class Package:
    """One provider release the bench asks for, and where the proxy and upstream serve it."""

    namespace: str
    type: str
    version: str

    def mirror(self, name: str) -> str:
        """A network mirror path under the proxy (and under nginx's copy of it)."""
        return f"/mirror/{HOST}/{self.namespace}/{self.type}/{name}"

    def zip_name(self, platform: str = "linux_amd64") -> str:
        return f"terraform-provider-{self.type}_{self.version}_{platform}.zip"

    @property
    def index(self) -> str:
        return self.mirror("index.json")

    @property
    def document(self) -> str:
        return self.mirror(f"{self.version}.json")

    def archive(self, platform: str = "linux_amd64") -> str:
        return self.mirror(self.zip_name(platform))

    def upstream_document(self, platform: str = "linux_amd64") -> str:
        """The package's download document on the fake registry (providers.v1)."""
        system, arch = platform.split("_")
        return (f"/v1/providers/{self.namespace}/{self.type}/{self.version}/download/"
                f"{system}/{arch}")

    def upstream_archive(self, platform: str = "linux_amd64") -> str:
        """The zip's path on the fake registry (a direct download)."""
        return f"/files/{self.namespace}/{self.type}/{self.version}/{self.zip_name(platform)}"


BIG = Package("bench", "big", "1.0.0")
DOCUMENTS = {state: Package("bench", type_, "1.0.0") for state, type_ in DOCUMENT_STATES.items()}
TERRAFORM = [Package("hashicorp", type_, TERRAFORM_VERSION) for type_ in TERRAFORM_PROVIDERS]


class Upstream:
    """The fake registry and its keys, serving only the packages asked for (the big zip is built
    only when a figure needs it)."""

    def __init__(self, work: Path, big: int | None) -> None:
        self.ca = trustme.CA()
        self.ca_file = work / "upstream-ca.pem"
        self.ca.cert_pem.write_to_path(str(self.ca_file))
        self._keys: list[GpgKey] = [generate_key(work / "gpg-signer", "Bench Signer"),
                                    generate_key(work / "gpg-impostor", "Bench Impostor")]
        self.registry = FakeRegistry(self.ca, *self._keys)
        self.sizes: dict[Package, int] = {}
        if big is not None:
            self._publish_big(BIG, big)
        for state in DOCUMENT_STATES.values():
            self.registry.add_release("bench", state, "1.0.0", platforms=DOCUMENT_PLATFORMS)
        for package in TERRAFORM:
            self.registry.add_release(package.namespace, package.type, package.version,
                                      platforms=("linux_amd64",))
        self.registry.add_module_archive("net-1.0.0.tar.gz", module_tarball())
        self.registry.add_module(*MODULE, location="")
        self.registry.start()
        # The module's location names the registry's port, known once it listens.
        self.registry.modules[MODULE].location = f"{self.registry.url}/archives/net-1.0.0.tar.gz"

    def _publish_big(self, package: Package, size: int) -> None:
        release = self.registry.add_release(package.namespace, package.type, package.version,
                                            platforms=("linux_amd64",))
        release.zips["linux_amd64"] = big_zip(size, package.type)
        release.sums = (f"{release.sha256('linux_amd64')}  "
                        f"{release.filename('linux_amd64')}\n").encode()
        release.signature = self.registry.signer.detach_sign(release.sums)
        self.sizes[package] = len(release.zips["linux_amd64"])

    def zip_bytes(self, package: Package, platform: str = "linux_amd64") -> bytes:
        """The zip upstream serves (the very bytes the proxy verifies and serves)."""
        return self.registry.releases[(package.namespace, package.type,
                                       package.version)].zips[platform]

    def url(self, path: str) -> str:
        return self.registry.url + path

    def downloads_of(self, package: Package) -> int:
        """How many times upstream was asked for the package's zip so far."""
        return sum(1 for path in self.registry.archive_requests()
                   if path == package.upstream_archive())

    def stop(self) -> None:
        self.registry.stop()
        for key in self._keys:
            stop_agent(key)
