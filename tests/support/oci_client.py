"""A plain OCI client that makes exactly the requests OpenTofu's `oci_mirror` makes for a
provider install, and checks what OpenTofu and its HTTP layer (oras-go) check.

Sequence (opentofu internal/getproviders/oci_registry_mirror_source.go and
package_location_oci_blob_archive.go; oras-go registry/remote/repository.go and auth/):
tags/list following `Link`, HEAD of the tag's manifest, the index by digest, the platform's
image manifest by digest, the layer blob. Auth is oras-go's: the first request unauthenticated,
a 401's `Bearer realm=...,service=...` challenge answered with a token fetched with Basic
credentials, the token sent from then on. Every check raises OciCheckFailed with what
OpenTofu would have refused."""

from __future__ import annotations

import base64
import hashlib
import json
import re
import ssl
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INDEX = "application/vnd.oci.image.index.v1+json"
MANIFEST = "application/vnd.oci.image.manifest.v1+json"
PROVIDER = "application/vnd.opentofu.provider"
TARGET = "application/vnd.opentofu.provider-target"
MODULE = "application/vnd.opentofu.modulepkg"
# oras-go's manifest Accept (registry/remote: defaultManifestMediaTypes).
MANIFEST_ACCEPT = ", ".join([
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    MANIFEST, INDEX, "application/vnd.oci.artifact.manifest.v1+json"])
MANIFEST_LIMIT = 4 << 20
_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')
_LINK = re.compile(r"<([^>]*)>")


class OciCheckFailed(AssertionError):
    """An answer OpenTofu would refuse."""


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes


@dataclass
class OpenTofuOciClient:
    """OpenTofu's requests against one registry (https://HOST:PORT), trusting ca_file."""

    registry: str
    ca_file: Path
    username: str = ""
    password: str = ""
    requests: list[tuple[str, str]] = field(default_factory=list)
    _token: str | None = None

    def _context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def _send(self, method: str, url: str, headers: dict[str, str]) -> Answer:
        request = urllib.request.Request(url, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, context=self._context(), timeout=60) as r:
                return Answer(r.status, {k.lower(): v for k, v in r.headers.items()}, r.read())
        except urllib.error.HTTPError as error:
            return Answer(error.code, {k.lower(): v for k, v in error.headers.items()},
                          error.read())

    def request(self, method: str, path: str, accept: str = "") -> Answer:
        """One request as oras-go sends it: the token once it has one; on a 401, the token
        flow, then the request once more."""
        self.requests.append((method, urllib.parse.urlsplit(path).path))
        headers = {"Accept": accept} if accept else {}
        if self._token:
            headers["Authorization"] = f"Bearer {self._token}"
        answer = self._send(method, self.registry + path, headers)
        if answer.status == 401 and self._token is None:
            self._token = self._fetch_token(answer.headers.get("www-authenticate", ""))
            headers["Authorization"] = f"Bearer {self._token}"
            answer = self._send(method, self.registry + path, headers)
        return answer

    def _fetch_token(self, challenge: str) -> str:
        if not challenge.startswith("Bearer "):
            raise OciCheckFailed(f"401 without a Bearer challenge: {challenge!r}")
        fields = dict(_CHALLENGE.findall(challenge))
        query = {"service": fields.get("service", "")}
        if "scope" in fields:
            query["scope"] = fields["scope"]
        basic = base64.b64encode(f"{self.username}:{self.password}".encode()).decode()
        answer = self._send("GET", f"{fields['realm']}?{urllib.parse.urlencode(query)}",
                            {"Authorization": f"Basic {basic}"})
        if answer.status != 200:
            raise OciCheckFailed(f"token endpoint answered {answer.status}: {answer.body[:300]!r}")
        issued = json.loads(answer.body)
        token = issued.get("token") or issued.get("access_token")
        if not token:
            raise OciCheckFailed(f"no token in {issued}")
        return str(token)

    # --- the steps -------------------------------------------------------------------------

    def tags(self, repository: str) -> list[str]:
        """Every tag, following the first `<...>` of each `Link` (oras-go ignores rel),
        which must stay on this registry."""
        found: list[str] = []
        path: str | None = f"/v2/{repository}/tags/list"
        while path:
            answer = self.request("GET", path)
            if answer.status != 200:
                raise OciCheckFailed(f"tags/list: {answer.status} {answer.body[:300]!r}")
            found += json.loads(answer.body).get("tags") or []
            link = _LINK.match(answer.headers.get("link", ""))
            path = None
            if link:
                target = urllib.parse.urlsplit(link.group(1))
                if target.netloc and f"https://{target.netloc}" != self.registry:
                    raise OciCheckFailed(f"Link to another origin: {link.group(1)}")
                path = urllib.parse.urlunsplit(("", "", target.path, target.query, ""))
        return found

    def resolve(self, repository: str, tag: str, media_type: str = INDEX,
                artifact_type: str = PROVIDER) -> dict[str, Any]:
        """HEAD by tag: the descriptor of the index (a provider version) or image manifest (a
        module), from Content-Type, Content-Length and Docker-Content-Digest (all required by
        oras-go for a HEAD by tag); OpenTofu fills in the artifactType it wants."""
        answer = self.request("HEAD", f"/v2/{repository}/manifests/{tag}", MANIFEST_ACCEPT)
        if answer.status != 200:
            raise OciCheckFailed(f"HEAD manifests/{tag}: {answer.status}")
        if answer.body:
            raise OciCheckFailed("a HEAD answer carried a body")
        if answer.headers.get("content-type", "") != media_type:
            raise OciCheckFailed(f"tag resolves to {answer.headers.get('content-type')!r}, "
                                 f"not {media_type}")
        size = int(answer.headers.get("content-length", "-1"))
        digest = answer.headers.get("docker-content-digest", "")
        if size <= 0 or size > MANIFEST_LIMIT or not digest.startswith("sha256:"):
            raise OciCheckFailed(f"HEAD descriptor incomplete: size {size}, digest {digest!r}")
        return {"mediaType": media_type, "digest": digest, "size": size,
                "artifactType": artifact_type}

    def fetch(self, repository: str, descriptor: dict[str, Any], kind: str) -> bytes:
        """GET by digest, checked as oras-go and OpenTofu check it: status, Content-Type
        equal to the descriptor's media type (manifests), Content-Length and
        Docker-Content-Digest equal to the descriptor's, exactly size bytes with that
        sha256."""
        digest = descriptor["digest"]
        accept = descriptor["mediaType"] if kind == "manifests" else ""
        answer = self.request("GET", f"/v2/{repository}/{kind}/{digest}", accept)
        if answer.status != 200:
            raise OciCheckFailed(f"GET {kind}/{digest}: {answer.status} {answer.body[:300]!r}")
        if kind == "manifests" and answer.headers.get("content-type") != descriptor["mediaType"]:
            raise OciCheckFailed(f"{digest}: Content-Type {answer.headers.get('content-type')!r}"
                                 f" is not {descriptor['mediaType']!r}")
        length = answer.headers.get("content-length")
        if length is not None and int(length) != descriptor["size"]:
            raise OciCheckFailed(f"{digest}: Content-Length {length} != {descriptor['size']}")
        said = answer.headers.get("docker-content-digest")
        if said is not None and said != digest:
            raise OciCheckFailed(f"{digest}: Docker-Content-Digest {said}")
        if len(answer.body) != descriptor["size"]:
            raise OciCheckFailed(f"{digest}: {len(answer.body)} bytes, not {descriptor['size']}")
        if "sha256:" + hashlib.sha256(answer.body).hexdigest() != digest:
            raise OciCheckFailed(f"{digest}: the bytes have another digest")
        return answer.body

    def index(self, repository: str, descriptor: dict[str, Any]) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(self.fetch(repository, descriptor, "manifests"))
        if document.get("mediaType") != INDEX or document.get("artifactType") != PROVIDER:
            raise OciCheckFailed(f"index: mediaType {document.get('mediaType')!r}, "
                                 f"artifactType {document.get('artifactType')!r}")
        return document

    @staticmethod
    def select(index: dict[str, Any], os: str, arch: str) -> dict[str, Any]:
        """selectOCIImageManifest: entries of another artifactType are skipped; ours must be
        image manifests with a platform; exactly one for the target."""
        chosen = []
        for entry in index.get("manifests", []):
            if entry.get("artifactType") != TARGET:
                continue
            if entry.get("mediaType") != MANIFEST:
                raise OciCheckFailed(f"provider-target entry of media type {entry['mediaType']}")
            platform = entry.get("platform")
            if not platform:
                raise OciCheckFailed("provider-target entry without platform")
            if platform.get("os.version") or platform.get("os") != os or \
                    platform.get("architecture") != arch:
                continue
            chosen.append(entry)
        if len(chosen) != 1:
            raise OciCheckFailed(f"{len(chosen)} manifests for {os}_{arch}")
        return chosen[0]

    def image(self, repository: str, descriptor: dict[str, Any],
              artifact_type: str = TARGET) -> dict[str, Any]:
        """An image manifest (a provider platform's, a module's) and its one archive/zip
        layer (sha256 digest)."""
        manifest: dict[str, Any] = json.loads(self.fetch(repository, descriptor, "manifests"))
        if manifest.get("mediaType") != MANIFEST or \
                manifest.get("artifactType") != artifact_type:
            raise OciCheckFailed(f"image manifest: {manifest.get('mediaType')!r} "
                                 f"{manifest.get('artifactType')!r}")
        zips = [layer for layer in manifest.get("layers", [])
                if layer.get("mediaType") == "archive/zip"]
        if len(zips) != 1 or not zips[0]["digest"].startswith("sha256:"):
            raise OciCheckFailed(f"layers: {manifest.get('layers')}")
        return dict(zips[0])

    def install(self, repository: str, version: str, os: str, arch: str) -> tuple[bytes, str]:
        """The whole install: the zip and the `zh:` hash OpenTofu records for it."""
        tag = version.replace("+", "_")
        if tag not in self.tags(repository):
            raise OciCheckFailed(f"{version} is not among the tags")
        index = self.index(repository, self.resolve(repository, tag))
        layer = self.image(repository, self.select(index, os, arch))
        return self.fetch(repository, layer, "blobs"), "zh:" + layer["digest"][len("sha256:"):]

    def install_module(self, repository: str, tag: str) -> bytes:
        """`oci://REGISTRY/REPOSITORY?tag=TAG` as OpenTofu's module installer fetches it
        (internal/getmodules/oci_getter.go): the tag resolved to an image manifest, that
        manifest by digest, its one archive/zip layer; the zip's bytes."""
        descriptor = self.resolve(repository, tag, MANIFEST, MODULE)
        layer = self.image(repository, descriptor, MODULE)
        return self.fetch(repository, layer, "blobs")
