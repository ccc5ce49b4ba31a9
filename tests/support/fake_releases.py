"""Terraform and OpenTofu CLI releases as their publishers lay them out, served by the fake
upstream (tests/support/fake_registry.py): releases.hashicorp.com's tree under `/hashicorp/`,
OpenTofu's GitHub release assets under `/github/opentofu/opentofu/releases/download/`, and
TofuDL's release list at `/get-opentofu/tofu/api.json`. Real zips holding an executable that
prints its version, a real SHA256SUMS and real detached OpenPGP signatures.

The keyed signature is named `NAME.72D7468F.sig` whoever signed it: HashiCorp's key ID, as
releases.hashicorp.com names it and as an internal mirror re-signed with a company's own key
keeps it (tfenv asks for that name, hardcoded); the tests sign with keys of their own.

Faults (the registry's fault set): "tamper-release" serves every archive with one byte
changed, "badsig-release" serves signatures made by another key, "badsig-plain" only the
plain `.sig` (as releases before 2021 have one by a key since revoked), "badsig-keyed" only
the keyed `.72D7468F.sig`."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from tests.support.gpg import GpgKey

RELEASE_PLATFORMS = ("linux_amd64", "darwin_arm64", "windows_amd64")
# What each product's binary prints for `version`, as the real ones begin.
BANNERS = {"terraform": "Terraform v{}", "opentofu": "OpenTofu v{}"}
PREFIXES = {"terraform": "terraform", "opentofu": "tofu"}
HASHICORP_KEY_ID = "72D7468F"


def _zip(name: str, script: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        info = zipfile.ZipInfo(name, date_time=(2025, 1, 1, 0, 0, 0))
        info.external_attr = 0o755 << 16
        archive.writestr(info, script)
        archive.writestr(zipfile.ZipInfo("LICENSE", date_time=(2025, 1, 1, 0, 0, 0)),
                         b"fake license\n")
    return buffer.getvalue()


def _tar_gz(name: str, script: bytes) -> bytes:
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as zipped, \
            tarfile.open(fileobj=zipped, mode="w") as tar:
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(script), 0o755
        tar.addfile(info, io.BytesIO(script))
    return buffer.getvalue()


@dataclass
class CliRelease:
    """One release of a CLI: its files by name."""

    product: str
    version: str
    files: dict[str, bytes] = field(default_factory=dict)
    signer_fingerprint: str = ""

    @property
    def prefix(self) -> str:
        return PREFIXES[self.product]

    @property
    def sums_name(self) -> str:
        return f"{self.prefix}_{self.version}_SHA256SUMS"

    def archive(self, platform: str, suffix: str = ".zip") -> str:
        """The name of a platform's archive."""
        return f"{self.prefix}_{self.version}_{platform}{suffix}"

    def sha256(self, name: str) -> str:
        return hashlib.sha256(self.files[name]).hexdigest()

    @property
    def keyed_signature(self) -> str:
        """HashiCorp's `NAME.72D7468F.sig` (its key ID, whichever key signed)."""
        return f"{self.sums_name}.{HASHICORP_KEY_ID}.sig"


class CliReleases:
    """The releases a fake upstream publishes, and its routes."""

    def __init__(self, signer: GpgKey, impostor: GpgKey,
                 faults: Callable[[], set[str]]) -> None:
        self.signer = signer
        self.impostor = impostor
        # The upstream's fault switches as they are now (a test may replace the set).
        self._faults = faults
        self.releases: dict[tuple[str, str], CliRelease] = {}
        self._bad_signatures: dict[tuple[str, str], dict[str, bytes]] = {}
        self.url = ""  # the upstream's base URL, set when it starts

    def add(self, product: str, version: str,
            platforms: tuple[str, ...] = RELEASE_PLATFORMS,
            signed_at: float | None = None) -> CliRelease:
        """Publish a release: archives for platforms (OpenTofu: a .tar.gz for linux_amd64
        too), SHA256SUMS and signatures made at signed_at (epoch seconds) if given
        (OpenTofu: `.gpgsig`, plus cosign's `.sig` and `.pem` as opaque files)."""
        release = CliRelease(product, version, signer_fingerprint=self.signer.fingerprint)
        binary = "terraform" if product == "terraform" else "tofu"
        script = (f"#!/bin/sh\necho '{BANNERS[product].format(version)}'\n"
                  f"echo 'on {{os_arch}}'\n").encode()
        for platform in platforms:
            name = binary + (".exe" if platform.startswith("windows") else "")
            release.files[release.archive(platform)] = _zip(
                name, script.replace(b"{os_arch}", platform.encode()))
        if product == "opentofu":
            release.files[release.archive("linux_amd64", ".tar.gz")] = _tar_gz(binary, script)
        sums = "".join(f"{hashlib.sha256(data).hexdigest()}  {name}\n"
                       for name, data in sorted(release.files.items())).encode()
        release.files[release.sums_name] = sums
        at = None if signed_at is None else str(int(signed_at))
        good, bad = self.signer.detach_sign(sums, at), self.impostor.detach_sign(sums, at)
        names = [f"{release.sums_name}.gpgsig"] if product == "opentofu" else \
            [release.keyed_signature, f"{release.sums_name}.sig"]
        for name in names:
            release.files[name] = good
        self._bad_signatures[(product, version)] = {name: bad for name in names}
        if product == "opentofu":
            release.files[f"{release.sums_name}.sig"] = b"cosign signature (opaque)\n"
            release.files[f"{release.sums_name}.pem"] = b"-----BEGIN CERTIFICATE-----\n"
        self.releases[(product, version)] = release
        return release

    def add_routes(self, app: web.Application) -> None:
        """Serve every release as its publisher does."""
        app.router.add_get("/hashicorp/terraform/index.json", self._terraform_index)
        app.router.add_get("/hashicorp/terraform/{version}/index.json", self._version_index)
        app.router.add_get("/hashicorp/terraform/{version}/{name}", self._terraform_file)
        app.router.add_get("/github/opentofu/opentofu/releases/download/{tag}/{name}",
                           self._opentofu_file)
        app.router.add_get("/get-opentofu/tofu/api.json", self._tofudl)

    def toml(self, keys_file: Path) -> str:
        """The proxy's `[releases]` table for this upstream, the signer's key in keys_file."""
        return (f'[releases]\nterraform_url = "{self.url}/hashicorp/"\n'
                f'opentofu_url = "{self.url}/github/opentofu/opentofu/releases/download/"\n'
                f'opentofu_list_url = "{self.url}/get-opentofu/tofu/api.json"\n'
                f'terraform_keys = "{keys_file}"\nopentofu_keys = "{keys_file}"\n')

    def _of(self, product: str) -> list[CliRelease]:
        return [r for (p, _v), r in sorted(self.releases.items()) if p == product]

    def _entry(self, release: CliRelease) -> dict[str, object]:
        builds = [{"name": "terraform", "version": release.version, "os": name.split("_")[2],
                   "arch": name.split("_")[3].removesuffix(".zip"), "filename": name,
                   "url": f"{self.url}/hashicorp/terraform/{release.version}/{name}"}
                  for name in sorted(release.files) if name.endswith(".zip")]
        return {"name": "terraform", "version": release.version,
                "shasums": release.sums_name, "shasums_signature": f"{release.sums_name}.sig",
                "shasums_signatures": [release.keyed_signature, f"{release.sums_name}.sig"],
                "builds": builds}

    async def _terraform_index(self, _request: web.Request) -> web.Response:
        return web.json_response({"name": "terraform", "versions": {
            r.version: self._entry(r) for r in self._of("terraform")}})

    async def _version_index(self, request: web.Request) -> web.Response:
        release = self.releases.get(("terraform", request.match_info["version"]))
        if release is None:
            raise web.HTTPNotFound()
        return web.json_response(self._entry(release))

    async def _tofudl(self, _request: web.Request) -> web.Response:
        return web.json_response({"versions": [
            {"id": r.version, "files": sorted(r.files)} for r in reversed(self._of("opentofu"))]})

    async def _terraform_file(self, request: web.Request) -> web.Response:
        return self._file("terraform", request.match_info["version"], request.match_info["name"])

    async def _opentofu_file(self, request: web.Request) -> web.Response:
        tag = request.match_info["tag"]
        if not tag.startswith("v"):
            raise web.HTTPNotFound()
        return self._file("opentofu", tag[1:], request.match_info["name"])

    def _file(self, product: str, version: str, name: str) -> web.Response:
        release = self.releases.get((product, version))
        if release is None or name not in release.files:
            raise web.HTTPNotFound()
        data = release.files[name]
        faults = self._faults()
        if "badsig-release" in faults or ("badsig-plain" in faults and name.endswith(
                "_SHA256SUMS.sig")) or ("badsig-keyed" in faults and name.endswith(
                f".{HASHICORP_KEY_ID}.sig")):
            data = self._bad_signatures[(product, version)].get(name, data)
        if "tamper-release" in faults and name.endswith((".zip", ".tar.gz")):
            data = data[:-30] + bytes([data[-30] ^ 0xFF]) + data[-29:]
        return web.Response(body=data, content_type="application/octet-stream")


def release_requests(requests: list[tuple[str, str]]) -> list[str]:
    """The paths of the releases' archives the upstream was asked for."""
    return [path for _method, path in requests
            if path.endswith((".zip", ".tar.gz")) and path.startswith(("/hashicorp/", "/github/"))]
