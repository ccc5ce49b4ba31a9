"""A fake upstream registry over HTTPS that speaks the real protocols.

Real zips, a real SHA256SUMS and a real detached OpenPGP signature per release; discovery,
the provider registry protocol and file downloads; a log of every request; and fault switches
(down, corrupt, badsig, missing platforms, slow paths) that tests flip to break it on purpose.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import io
import random
import ssl
import tempfile
import threading
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import trustme
from aiohttp import web

from tests.support.fake_releases import CliReleases
from tests.support.gpg import GpgKey

DEFAULT_PLATFORMS = ("linux_amd64", "darwin_arm64", "windows_amd64")
# Other names the server's certificate is good for: tests route them to it (through the
# CONNECT proxy's routes, or a stand-in for DNS) to play public and internal hosts.
EXTRA_NAMES = ("releases.example.com", "git.example.com", "sneaky.example.com",
               "files.corp.example")


@dataclass
class ModuleRelease:
    """One module version: where the registry says its source is, and how it says it."""

    namespace: str
    name: str
    system: str
    version: str
    location: str
    style: str = "header"  # "header": 204 + X-Terraform-Get; "json": 200 + {"location"}


@dataclass
class Release:
    """One provider version as upstream publishes it."""

    namespace: str
    type: str
    version: str
    platforms: tuple[str, ...]
    zips: dict[str, bytes] = field(default_factory=dict)
    binaries: dict[str, bytes] = field(default_factory=dict)
    sums: bytes = b""
    signature: bytes = b""
    bad_signature: bytes = b""
    _digests: dict[str, tuple[bytes, str]] = field(default_factory=dict, repr=False)

    def filename(self, platform: str) -> str:
        return f"terraform-provider-{self.type}_{self.version}_{platform}.zip"

    @property
    def sums_name(self) -> str:
        return f"terraform-provider-{self.type}_{self.version}_SHA256SUMS"

    def sha256(self, platform: str) -> str:
        data = self.zips[platform]
        cached = self._digests.get(platform)
        if cached is None or cached[0] is not data:  # zips may be replaced: key on identity
            cached = (data, hashlib.sha256(data).hexdigest())
            self._digests[platform] = cached
        return cached[1]


def build_zip(members: dict[str, tuple[bytes, int]]) -> bytes:
    """A zip with the given (content, mode) members, like a provider release."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, (content, mode) in members.items():
            info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
            info.external_attr = mode << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            archive.writestr(info, content)
    return buffer.getvalue()


class FakeRegistry:
    """The upstream. Runs its own event loop in a thread so sync and async tests can share it."""

    def __init__(self, ca: trustme.CA, signer: GpgKey, impostor: GpgKey) -> None:
        self.ca = ca
        self.signer = signer
        self.impostor = impostor
        self.releases: dict[tuple[str, str, str], Release] = {}
        self.requests: list[tuple[str, str]] = []
        self._in_flight = 0
        self._last_request = 0.0
        self.faults: set[str] = set()
        # Terraform and OpenTofu CLI releases, on this server too (their own routes).
        self.cli = CliReleases(signer, impostor, lambda: self.faults)
        self.extra_versions: dict[tuple[str, str], list[object]] = {}
        self.modules: dict[tuple[str, str, str, str], ModuleRelease] = {}
        self.url_token = 0
        self.download_host: str | None = None  # names download URLs' host when set
        self.authorizations: list[tuple[str, str | None]] = []
        self.module_archives: dict[str, bytes] = {}
        # An OIDC issuer's published keys (a JWKS), at /oidc/jwks.
        self.jwks: dict[str, object] = {"keys": []}
        # Requests whose path starts with a key are answered that many seconds late (a slow
        # module source: e.g. a git repository's `/info/refs`, the first request of a clone).
        self.slow_paths: dict[str, float] = {}
        self.git_root = Path(tempfile.mkdtemp(prefix="fake-git-"))
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._runner: web.AppRunner | None = None

    # --- content -------------------------------------------------------------------------

    def add_release(self, namespace: str, type_: str, version: str,
                    platforms: tuple[str, ...] = DEFAULT_PLATFORMS,
                    padding: int = 4096, incompressible: bool = False,
                    signed_at: float | None = None) -> Release:
        """Publish a version: one zip per platform, SHA256SUMS, signature (made at signed_at,
        epoch seconds, when given). An incompressible padding makes a zip about `padding`
        bytes long."""
        release = Release(namespace, type_, version, platforms)
        for platform in platforms:
            seed = f"{type_}{version}{platform}".encode()
            filler = hashlib.shake_256(seed).digest(padding) if incompressible else \
                hashlib.sha256(seed).digest() * (padding // 32)
            binary = (f"#!/bin/sh\necho fake {namespace}/{type_} {version} {platform}\n"
                      .encode() + filler)
            release.binaries[platform] = binary
            release.zips[platform] = build_zip({
                f"terraform-provider-{type_}_v{version}": (binary, 0o755),
                "LICENSE": (b"MPL-2.0\n", 0o644),
            })
        release.sums = "".join(f"{release.sha256(p)}  {release.filename(p)}\n"
                               for p in platforms).encode()
        at = None if signed_at is None else str(int(signed_at))
        release.signature = self.signer.detach_sign(release.sums, at)
        release.bad_signature = self.impostor.detach_sign(release.sums, at)
        self.releases[(namespace, type_, version)] = release
        return release

    def add_large_release(self, namespace: str, type_: str, version: str,
                          size: int) -> Release:
        """A linux_amd64-only release whose zip holds size incompressible bytes (stored, not
        deflated, so the file really is that large), signed like any other."""
        release = self.add_release(namespace, type_, version, platforms=("linux_amd64",))
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
            info = zipfile.ZipInfo(f"terraform-provider-{type_}_v{version}",
                                   date_time=(2024, 1, 1, 0, 0, 0))
            info.external_attr = 0o755 << 16
            archive.writestr(info, random.Random(f"{type_}{version}").randbytes(size))
        release.zips["linux_amd64"] = buffer.getvalue()
        release.sums = (f"{release.sha256('linux_amd64')}  {release.filename('linux_amd64')}\n"
                        .encode())
        release.signature = self.signer.detach_sign(release.sums)
        release.bad_signature = self.impostor.detach_sign(release.sums)
        return release

    def add_module(self, namespace: str, name: str, system: str, version: str,
                   location: str, style: str = "header") -> ModuleRelease:
        """Publish a module version whose download answers `location`."""
        module = ModuleRelease(namespace, name, system, version, location, style)
        self.modules[(namespace, name, system, version)] = module
        return module

    def add_module_archive(self, filename: str, data: bytes) -> str:
        """Serve data at /archives/filename; returns its absolute URL."""
        self.module_archives[filename] = data
        return f"{self.url}/archives/{filename}"

    # --- observation ---------------------------------------------------------------------

    def paths(self, method: str = "GET") -> list[str]:
        """Paths requested so far with that method."""
        return [p for m, p in list(self.requests) if m == method]

    def archive_requests(self) -> list[str]:
        return [p for p in self.paths() if p.endswith(".zip")]

    def reset(self) -> None:
        """A clean log and no faults, once requests a previous test's proxy still had under
        way (a fill it left running) have been answered, so that none lands in the next log."""
        deadline = time.monotonic() + 2
        while (self._in_flight or time.monotonic() - self._last_request < 0.05) \
                and time.monotonic() < deadline:
            time.sleep(0.02)
        self.requests.clear()
        self.authorizations.clear()
        self.faults.clear()
        self.slow_paths.clear()
        self.download_host = None
        self.jwks = {"keys": []}

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def providers_url(self) -> str:
        return f"{self.url}/v1/providers/"

    @property
    def thread(self) -> threading.Thread:
        """The thread that serves every request (its CPU is the upstream's)."""
        return self._thread

    # --- server --------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=30)

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _start(self) -> None:
        app = web.Application(middlewares=[self._log_and_faults])
        app.router.add_get("/.well-known/terraform.json", self._discovery)
        app.router.add_get("/moved/terraform.json", self._discovery)
        app.router.add_get("/v1/providers/{ns}/{type}/versions", self._versions)
        app.router.add_get("/v1/providers/{ns}/{type}/{version}/download/{os}/{arch}",
                           self._download)
        app.router.add_get("/files/{ns}/{type}/{version}/{name}", self._file)
        app.router.add_get("/v1/modules/{ns}/{name}/{system}/versions", self._module_versions)
        app.router.add_get("/v1/modules/{ns}/{name}/{system}/{version}/download",
                           self._module_download)
        app.router.add_get("/archives/{name}", self._module_archive)
        app.router.add_get("/to-localhost/{tail:.*}", self._to_localhost)
        app.router.add_get("/oidc/jwks", self._jwks)
        # A bare git repository served as static files is the "dumb HTTP" git protocol.
        app.router.add_static("/git/", self.git_root)
        self.cli.add_routes(app)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.ca.issue_cert("127.0.0.1", "localhost", *EXTRA_NAMES).configure_cert(context)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=context)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.cli.url = self.url

    async def _jwks(self, _request: web.Request) -> web.Response:
        return web.json_response(self.jwks)

    @web.middleware
    async def _log_and_faults(self, request: web.Request, handler: object) -> web.StreamResponse:
        self._in_flight += 1
        self._last_request = time.monotonic()
        try:
            return await self._answer(request, handler)
        finally:
            self._in_flight -= 1
            self._last_request = time.monotonic()

    async def _answer(self, request: web.Request, handler: object) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        self.authorizations.append((request.path, request.headers.get("Authorization")))
        if "down" in self.faults:
            return web.Response(status=503, text="upstream is down")
        if "stall" in self.faults:
            await asyncio.sleep(5)
        for prefix, delay in list(self.slow_paths.items()):
            if request.path.startswith(prefix):
                await asyncio.sleep(delay)
        response: web.StreamResponse = await handler(request)  # type: ignore[operator]
        if "gzip" in self.faults and isinstance(response, web.Response) and response.body:
            # A hostile or broken CDN: compresses whatever the client asked for.
            body = gzip.compress(bytes(response.body))  # type: ignore[arg-type]
            compressed = web.Response(body=body, status=response.status,
                                      content_type=response.content_type)
            compressed.headers["Content-Encoding"] = "gzip"
            return compressed
        return response

    async def _discovery(self, request: web.Request) -> web.Response:
        if "no-discovery" in self.faults:
            raise web.HTTPNotFound()
        if "moved-discovery" in self.faults and request.path.startswith("/.well-known/"):
            raise web.HTTPFound("/moved/terraform.json")
        if "html-discovery" in self.faults:
            return web.Response(text="<html>captive portal</html>", content_type="text/html")
        # Relative to the final URL of the document: from /moved/ this is /v1/providers/ too.
        relative = "../v1/providers/" if request.path.startswith("/moved/") else "/v1/providers/"
        return web.json_response({"providers.v1": relative,
                                  "modules.v1": relative.replace("providers", "modules"),
                                  "login.v1": {"client": "terraform-cli"}})

    async def _module_versions(self, request: web.Request) -> web.Response:
        info = request.match_info
        versions = [{"version": m.version} for (n, a, s, _v), m in self.modules.items()
                    if (n, a, s) == (info["ns"], info["name"], info["system"])]
        if not versions:
            raise web.HTTPNotFound()
        return web.json_response({"modules": [{"versions": versions}]})

    async def _module_download(self, request: web.Request) -> web.Response:
        info = request.match_info
        module = self.modules.get((info["ns"], info["name"], info["system"], info["version"]))
        if module is None:
            raise web.HTTPNotFound()
        if module.style == "json":
            return web.json_response({"location": module.location})
        return web.Response(status=204, headers={"X-Terraform-Get": module.location})

    async def _module_archive(self, request: web.Request) -> web.Response:
        data = self.module_archives.get(request.match_info["name"])
        if data is None:
            raise web.HTTPNotFound()
        return web.Response(body=data, content_type="application/octet-stream")

    async def _to_localhost(self, request: web.Request) -> web.Response:
        """A redirect to this same server under another name, `localhost`: loopback."""
        query = f"?{request.query_string}" if request.query_string else ""
        raise web.HTTPFound(f"https://localhost:{self.port}/{request.match_info['tail']}"
                            f"{query}")

    async def _versions(self, request: web.Request) -> web.Response:
        ns, type_ = request.match_info["ns"], request.match_info["type"]
        if "redirectloop" in self.faults:
            raise web.HTTPFound(request.path)
        if "httpredirect" in self.faults:
            raise web.HTTPFound(f"http://127.0.0.1:{self.port}{request.path}")
        if "redirect-private" in self.faults:
            raise web.HTTPFound(f"https://localhost:{self.port}/v1/providers/{ns}/{type_}/"
                                "versions")
        if "badredirect" in self.faults:
            return web.Response(status=302, headers={"Location": "https://["})
        if "deepjson" in self.faults:
            return web.Response(text="[" * 100_000 + "]" * 100_000,
                                content_type="application/json")
        if "hugejson" in self.faults:
            return web.Response(text='{"versions": []}' + " " * (2 << 20),
                                content_type="application/json")
        versions: list[object] = [
            {"version": r.version, "protocols": ["5.0"],
             "platforms": [dict(zip(("os", "arch"), p.split("_"), strict=True))
                           for p in r.platforms]}
            for (n, t, _v), r in self.releases.items() if (n, t) == (ns, type_)]
        versions += self.extra_versions.get((ns, type_), [])
        if not versions:
            raise web.HTTPNotFound()
        return web.json_response({"versions": versions})

    async def _download(self, request: web.Request) -> web.Response:
        info = request.match_info
        release = self.releases.get((info["ns"], info["type"], info["version"]))
        platform = f"{info['os']}_{info['arch']}"
        if release is None or platform not in release.platforms \
                or f"missing:{platform}" in self.faults:
            raise web.HTTPNotFound()
        files = f"/files/{release.namespace}/{release.type}/{release.version}/"
        keys = [] if "nokeys" in self.faults else [{
            "key_id": self.signer.fingerprint[-16:],
            "ascii_armor": self.signer.armored_public_key,
            "trust_signature": "", "source": "Test", "source_url": None}]
        shasum = release.sha256(platform)
        if "wrongshasum" in self.faults or f"wrongshasum:{platform}" in self.faults:
            shasum = hashlib.sha256(b"something else").hexdigest()
        download_url = files + release.filename(platform)
        if "expiring" in self.faults:
            # Short-lived signed URLs: only the newest one handed out works.
            self.url_token += 1
            download_url += f"?token={self.url_token}"
        if "badurl" in self.faults:
            download_url = "//[x"
        if "loopback-url" in self.faults:  # another name for this very server: loopback
            download_url = f"https://localhost:{self.port}{download_url}"
        if self.download_host is not None:
            download_url = f"https://{self.download_host}:{self.port}{download_url}"
        if "metadata-url" in self.faults:
            download_url = "https://169.254.169.254/latest/meta-data/iam/credentials"
        extra: dict[str, object] = {}
        if "tofu-packages" in self.faults:  # OpenTofu >= 1.12 reads per-platform hashes
            extra["packages"] = {p: {"hashes": [f"zh:{release.sha256(p)}"],
                                     "package_size": len(release.zips[p])}
                                 for p in release.platforms}
        return web.json_response({
            **extra,
            "protocols": ["5.0"], "os": info["os"], "arch": info["arch"],
            "filename": release.filename(platform),
            "download_url": download_url,
            "shasums_url": files + release.sums_name,
            "shasums_signature_url": files + release.sums_name + ".sig",
            "shasum": shasum,
            "signing_keys": {"gpg_public_keys": keys},
        })

    async def _file(self, request: web.Request) -> web.Response:
        info = request.match_info
        release = self.releases.get((info["ns"], info["type"], info["version"]))
        if release is None:
            raise web.HTTPNotFound()
        name = info["name"]
        if name == release.sums_name:
            return web.Response(body=release.sums, content_type="text/plain")
        if name == release.sums_name + ".sig":
            body = release.bad_signature if "badsig" in self.faults else release.signature
            return web.Response(body=body, content_type="application/octet-stream")
        for platform in release.platforms:
            if name == release.filename(platform):
                if "expiring" in self.faults and \
                        request.query.get("token") != str(self.url_token):
                    raise web.HTTPForbidden(text="signature expired")
                body = release.zips[platform]
                if "corrupt" in self.faults:
                    body = body[:100] + bytes([body[100] ^ 0xFF]) + body[101:]
                if "slowzip" in self.faults:
                    return await self._trickle(request, body)
                if "holdzip" in self.faults:  # headers now, the body once the test says so
                    return await self._trickle(request, body, piece=16 << 10, pause=0,
                                               hold="holdzip")
                if len(body) > 8 << 20:  # big (benchmark) packages: stream, do not buffer
                    return await self._trickle(request, body, piece=1 << 20, pause=0)
                return web.Response(body=body, content_type="application/zip")
        raise web.HTTPNotFound()

    async def _trickle(self, request: web.Request, body: bytes, piece: int = 32,
                       pause: float = 0.05, hold: str | None = None) -> web.StreamResponse:
        """Send a body in pieces, by default slowly (a slow upstream mid-download); with
        `hold`, only the headers until that fault is cleared."""
        response = web.StreamResponse(headers={"Content-Type": "application/zip"})
        if "nolength" not in self.faults:  # else chunked: the size is not known in advance
            response.content_length = len(body)
        await response.prepare(request)
        for _ in range(3000):  # the fault set is plain data shared with tests: poll it (30 s)
            if hold is None or hold not in self.faults:
                break
            await asyncio.sleep(0.01)
        view = memoryview(body)
        for offset in range(0, len(body), piece):
            await response.write(view[offset:offset + piece])
            await asyncio.sleep(pause)
        await response.write_eof()
        return response
