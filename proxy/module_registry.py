"""The module registry protocol, served from module archives the proxy fetched and repacked.

https://developer.hashicorp.com/terraform/internals/module-registry-protocol
Operations: list_versions, download (answered from the version list alone, at once: clients
give it 10 s), archive (fetch the source on a miss: https archive or git clone, apply the
subdirectory, repack as .tar.gz, store; the slow part, on a request clients do not time out).
Clients never see upstream's location.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any

from proxy.archives import ArchiveStore, FillLock
from proxy.cache import MetadataCache
from proxy.config import Config
from proxy.disk_space import is_out_of_space
from proxy.errors import NotFound, Offline, ProxyError
from proxy.executors import quick, slow
from proxy.filters import Filters
from proxy.freshness import RefreshingDocuments
from proxy.metrics import Metrics
from proxy.models import ModuleAddress
from proxy.module_packing import pack, select_subdir, unpack
from proxy.module_sources import ModuleSource, UnsupportedSource, parse_source
from proxy.redaction import excerpt, mask_secrets
from proxy.singleflight import SingleFlight
from proxy.upstream import git
from proxy.upstream.egress_gate import EgressGate
from proxy.upstream.http import UpstreamHTTP
from proxy.upstream.module_registry import ModuleRegistryClient

log = logging.getLogger(__name__)


class ModuleRegistry:
    """Answers module registry requests for every allowed upstream host."""

    def __init__(self, client: ModuleRegistryClient, http: UpstreamHTTP, cache: MetadataCache,
                 archives: ArchiveStore, config: Config, metrics: Metrics,
                 git_ca_file: Path | None, git_gate: EgressGate) -> None:
        self._client = client
        self._http = http
        self._cache = cache
        self._archives = archives
        self._config = config
        self._metrics = metrics
        self._git_ca_file = git_ca_file
        self._git_gate = git_gate
        self._filters = Filters(config.filters)
        self._version_lists = RefreshingDocuments[list[str]](
            "module_versions", cache, metrics, config.upstream.versions_ttl,
            encode=list, decode=list, offline=config.upstream.offline)
        self._archive_fills: SingleFlight[Path] = SingleFlight()
        self._fill_slots = asyncio.Semaphore(config.upstream.max_concurrent_fills)

    async def close(self) -> None:
        """Stop fills under way (shutdown)."""
        await self._archive_fills.cancel_all()
        await self._version_lists.close()

    def _require_served(self, module: ModuleAddress) -> None:
        if not self._config.upstream.serves(module.hostname):
            raise NotFound(f"host {module.hostname} is not served by this proxy")
        if not self._filters.module_allowed(module):
            raise NotFound(f"module {module} is not served by this proxy (filters)")

    # --- protocol operations -------------------------------------------------------------

    async def list_versions(self, module: ModuleAddress) -> dict[str, Any]:
        """The body of `versions`: `{"modules": [{"versions": [{"version": ...}]}]}`."""
        self._require_served(module)
        versions = await self._versions(module)
        return {"modules": [{"versions": [{"version": v} for v in versions]}]}

    async def download(self, module: ModuleAddress, version: str) -> None:
        """The `download` operation: raises unless the archive is held or the version list
        has the version (offline: held only). Starts fetching the source in the background,
        so that the archive request finds it under way, but never waits for it: Terraform
        gives this request 10 s and a clone may take minutes (the archive GET has no limit).
        """
        self._require_served(module)
        if await self._archives.lookup(self._archive_parts(module, version)) is not None:
            return
        if self._config.upstream.offline:
            raise Offline(f"module {module} {version} is not in the cache, and the proxy is "
                          "offline")
        if version not in await self._versions(module, wanted=version):
            raise NotFound(f"module {module} has no version {version}")
        self._start_fill(module, version)

    async def archive(self, module: ModuleAddress, version: str) -> Path:
        """The repacked module archive, fetched from its source on a miss (waiting for a
        fetch already under way rather than starting another)."""
        self._require_served(module)
        parts = self._archive_parts(module, version)
        path = await self._archives.lookup(parts)
        if path is not None:
            self._metrics.cache_lookups.labels("module", "hit").inc()
            return path
        self._metrics.cache_lookups.labels("module", "miss").inc()
        # Shielded: a client that hangs up does not cancel a fill others wait for.
        return await asyncio.shield(self._start_fill(module, version))

    # --- versions ------------------------------------------------------------------------

    async def _versions(self, module: ModuleAddress, wanted: str | None = None) -> list[str]:
        return await self._version_lists.get(
            f"module-versions/{module}", lambda: self._client.list_versions(module),
            knows=None if wanted is None else (lambda versions: wanted in versions))

    # --- archives ------------------------------------------------------------------------

    @staticmethod
    def _archive_parts(module: ModuleAddress, version: str) -> list[str]:
        return ["modules", module.hostname, module.namespace, module.name, module.system,
                f"{version}.tar.gz"]

    def _start_fill(self, module: ModuleAddress, version: str) -> asyncio.Task[Path]:
        return self._archive_fills.start(("module", str(module), version),
                                         lambda: self._logged_fill(module, version))

    async def _logged_fill(self, module: ModuleAddress, version: str) -> Path:
        # Logged here, once per fill: a prefetch may have no client to report a failure to.
        try:
            return await self._fill(module, version)
        except ProxyError as exc:
            log.log(logging.WARNING if exc.status >= 500 else logging.INFO,
                    "module %s %s: fetching its source failed: %s", module, version,
                    exc.message)
            raise
        except Exception:
            log.exception("module %s %s: fetching its source failed", module, version)
            raise

    async def _fill(self, module: ModuleAddress, version: str) -> Path:
        # One fill per module version across the processes sharing the cache.
        try:
            async with FillLock(self._archives.lock_path(f"module/{module}/{version}")):
                return await self._fill_locked(module, version)
        except OSError as exc:  # the lock, the source, its tree or the archive found no room
            if not is_out_of_space(exc):
                raise
            raise self._archives.disk.ran_out("module") from exc

    async def _fill_locked(self, module: ModuleAddress, version: str) -> Path:
        parts = self._archive_parts(module, version)
        published = await self._archives.lookup(parts)  # a fill that just finished
        if published is not None:
            return published
        if version not in await self._versions(module, wanted=version):
            raise NotFound(f"module {module} has no version {version}")
        location = await self._client.download_location(module, version)
        source = parse_source(location)
        log.info("fetching module %s %s from %s", module, version, mask_secrets(source.url))
        async with self._fill_slots:
            return await self._build(module, source, parts)

    async def _build(self, module: ModuleAddress, source: ModuleSource,
                     parts: list[str]) -> Path:
        limit = self._config.modules.max_archive_size
        work = await quick(self._archives.work_dir)
        self._metrics.fills_in_flight.inc()
        try:
            tree = await self._fetch_tree(module, source, work)
            module_root = await quick(select_subdir, tree, source.subdir)
            packed = self._archives.temp_file()
            try:
                await slow(pack, module_root, packed, limit)
                return await self._archives.publish(packed, parts)
            except BaseException:
                packed.unlink(missing_ok=True)
                raise
        finally:
            self._metrics.fills_in_flight.dec()
            await slow(shutil.rmtree, work, True)

    async def _fetch_tree(self, module: ModuleAddress, source: ModuleSource,
                          work: Path) -> Path:
        tree = work / "tree"
        limit = self._config.modules.max_archive_size
        if source.kind == "git":
            await git.clone(source.url, source.ref, tree,
                            time_limit=self._config.modules.git_timeout,
                            ca_file=self._git_ca_file, gate=self._git_gate)
            return tree
        if source.archive is None:
            raise UnsupportedSource(f"module location {excerpt(source.url, 200)} is not an archive "
                                    "(no ?archive= and no known extension)")
        download = work / "source.archive"
        await self._http.download(source.url, module.hostname, download, limit)
        await slow(unpack, download, source.archive, tree, limit)
        return tree
