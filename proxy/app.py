"""The composition root: create_app(config) builds every object the proxy uses."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

from aiohttp import web

from proxy.config import Config
from proxy.config.filters import Filters
from proxy.config.settings import CacheConfig
from proxy.core import siblings
from proxy.core.activity import Activity
from proxy.core.activity_share import SnapshotShare
from proxy.core.audit import AuditLog
from proxy.core.errors import ProxyError
from proxy.core.executors import quick, serving
from proxy.core.metrics import Metrics
from proxy.core.models import ProviderAddress
from proxy.protocols.inventory import Inventory
from proxy.protocols.module_registry import ModuleRegistry
from proxy.protocols.network_mirror import ProviderMirror
from proxy.protocols.oci_distribution import OciProviders
from proxy.protocols.oci_modules import OciModules
from proxy.protocols.oci_records import OciRecords
from proxy.protocols.provider_registry import ProviderRegistryService
from proxy.protocols.releases import CliReleases
from proxy.protocols.status import StatusReport, snapshot_directory
from proxy.protocols.version_policy import VersionPolicy
from proxy.store.disk import open_disk_for_commands, open_disk_storage
from proxy.store.protocol import Storage, StorageOpener
from proxy.tls.state import StatePaths
from proxy.upstream.discovery import Discovery
from proxy.upstream.egress import EgressPolicy
from proxy.upstream.egress_gate import EgressGate
from proxy.upstream.git import combined_ca_bundle
from proxy.upstream.http import UpstreamHTTP, close_session, make_session
from proxy.upstream.module_registry import ModuleRegistryClient
from proxy.upstream.module_sources import ModuleSourceFetcher
from proxy.upstream.provider_registry import ProviderRegistryClient
from proxy.upstream.releases import ReleasesClient
from proxy.upstream.warm_connections import ConnectionWarmer
from proxy.verification.package_fills import PackageFills
from proxy.verification.packages import VerifiedPackages
from proxy.verification.release_times import ReleaseTimes
from proxy.verification.releases import ReleaseKeyError, load_release_keys
from proxy.verification.stored_packages import StoredPackages
from proxy.web.auth import OIDC_KEY, SIGNER_KEY, load_signing_key
from proxy.web.middleware import SERVER_NAME, response_prepared, route_guard
from proxy.web.oci_routes import OCI_KEY, OCI_MODULES_KEY, add_oci_routes, oci_error
from proxy.web.oidc import MAX_JWKS_BYTES, OidcVerifier
from proxy.web.pulls import PULLS_KEY, PullCounter
from proxy.web.quick_answers import QUICK_SECONDS, QuickAnswers
from proxy.web.release_routes import RELEASES_KEY, add_release_routes
from proxy.web.routes import (
    ARCHIVES_KEY,
    AUDIT_KEY,
    CONFIG_KEY,
    FILE_ROUTES,
    INVENTORY_KEY,
    METRICS_KEY,
    MIRROR_KEY,
    MODULES_KEY,
    POLICY_KEY,
    QUICK_KEY,
    REGISTRY_KEY,
    STATUS_KEY,
    add_routes,
)
from proxy.web.url_signing import UrlSigner

log = logging.getLogger(__name__)


def configured_storage(cache: CacheConfig) -> StorageOpener:
    """How the configured storage opens: the bucket of cache.s3 if one is set, else the
    cache directory."""
    if cache.s3 is None:
        return open_disk_storage
    # Imported only for a bucket: the S3 client library (botocore) costs every process
    # about 15 MiB of memory.
    from proxy.store.s3 import open_s3_storage
    return open_s3_storage


async def open_for_commands(config: Config, opened: contextlib.AsyncExitStack) -> Storage:
    """The configured store as commands open it (export, keys export, cache commands): the
    bucket of cache.s3, or the cache directory without a starting server's sweep and
    eviction."""
    if config.cache.s3 is None:
        return await open_disk_for_commands(config.cache, opened)
    from proxy.store.s3 import open_s3_storage  # see configured_storage
    return await open_s3_storage(config.cache, Metrics(), opened)


def create_app(config: Config,
               open_storage: StorageOpener | None = None) -> web.Application:
    """Build the application; long-lived resources open and close with it (cleanup_ctx).
    Storage: the bucket of cache.s3 if one is set, else the cache directory, unless
    open_storage opens another backend."""
    if open_storage is None:
        open_storage = configured_storage(config.cache)
    metrics = Metrics(upstream_hosts=sorted(config.upstream.all_hosts), body_routes=FILE_ROUTES,
                      offline=config.upstream.offline)
    # No middleware: errors, authentication and counting wrap each route's handler once
    # (route_guard), so a request runs only its own route's steps.
    app = web.Application()
    app[CONFIG_KEY] = config
    app[METRICS_KEY] = metrics
    audit = AuditLog(config.server.audit_log)  # opened with the other resources
    app[AUDIT_KEY] = audit
    add_routes(app, route_guard(metrics, config.auth), audit,
               more=[add_oci_routes, add_release_routes],
               unmatched_shapes={"/v2/": oci_error})
    app.on_response_prepare.append(response_prepared(metrics))
    if not config.auth.enabled:  # kept answers carry no credentials, and ask for none
        app[QUICK_KEY] = QuickAnswers(metrics.requests, SERVER_NAME,
                                      min(QUICK_SECONDS, config.upstream.versions_ttl))

    async def resources(app: web.Application) -> AsyncIterator[None]:
        # Each resource is closed by the stack as soon as it exists: a start that fails
        # part-way (an unusable signing key, a full disk) leaves nothing open behind it.
        async with contextlib.AsyncExitStack() as opened:
            await _open_resources(app, config, metrics, opened, open_storage, audit)
            yield

    # Opened first, closed last (cleanup_ctx unwinds in reverse): every resource's blocking
    # calls run on these pools, where hits never queue behind slow work.
    app.cleanup_ctx.append(_thread_pools)
    app.cleanup_ctx.append(resources)
    return app


async def _open_resources(app: web.Application, config: Config, metrics: Metrics,
                          opened: contextlib.AsyncExitStack,
                          open_storage: StorageOpener, audit: AuditLog) -> None:
    """Build the long-lived objects into app, their closing pushed onto `opened`."""
    try:  # first: an audit log that cannot be written stops the start
        await quick(audit.open)
    except OSError as exc:
        raise ProxyError(f"server.audit_log {audit.target}: cannot open it: "
                         f"{exc.strerror or exc}") from None
    opened.callback(audit.close)
    if config.auth.enabled:  # first: a key that cannot be used stops the start at once
        key = await quick(load_signing_key, StatePaths(config.server.state_dir).signing_key)
        app[SIGNER_KEY] = UrlSigner(key, config.auth.signed_url_ttl)
    cache_dir = config.cache.dir
    storage = await open_storage(config.cache, metrics, opened)
    archives, cache = storage.blobs, storage.index
    activity = Activity()  # what the status page shows, recorded where it happens
    times = ReleaseTimes(cache)
    policy = VersionPolicy(config.policy, times, metrics, activity, audit)
    opened.push_async_callback(policy.close)
    app[POLICY_KEY] = policy
    quick_answers = app.get(QUICK_KEY)
    if quick_answers is not None:
        policy.on_reload(quick_answers.clear)
    status = StatusReport(config, activity, metrics, archives,
                          SnapshotShare(snapshot_directory(config)), policy.rules_document)
    await opened.enter_async_context(status.sharing())
    app[STATUS_KEY] = status
    app[PULLS_KEY] = PullCounter(activity, name_clients=audit.enabled)
    inventory = Inventory(storage)
    opened.push_async_callback(inventory.close)
    app[INVENTORY_KEY] = inventory
    # The OIDC providers' key URLs are configured upstreams too (their hosts trusted).
    jwks_urls = [p.jwks_url for p in config.auth.oidc if p.jwks_url is not None]
    egress = EgressPolicy.from_config(config.upstream, [*config.releases.urls, *jwks_urls])
    session = make_session(config.upstream, egress)
    opened.push_async_callback(close_session, session)
    http = UpstreamHTTP(session, config.upstream, metrics, egress, activity)
    # Connections opened ahead of the zips that documents announce, here and in the other
    # workers (one of them may accept the zip's connection).
    warmer = ConnectionWarmer(http, siblings.joined(), metrics.connections_warmed)
    warmer.listen()
    opened.push_async_callback(warmer.close)
    if config.auth.oidc:
        app[OIDC_KEY] = OidcVerifier(
            config.auth.oidc,
            lambda url: http.get_bytes(url, urlsplit(url).hostname or "", MAX_JWKS_BYTES))
    # One view of what is served (hosts, then filters), shared by every service.
    filters = Filters(config.filters, config.upstream)
    discovery = Discovery(http, config.upstream, filters)
    packages = VerifiedPackages(ProviderRegistryClient(http, discovery), cache,
                                config.upstream, metrics, filters, activity, times,
                                expect_download=warmer.expect)
    opened.push_async_callback(packages.close)
    if quick_answers is not None:  # a VERSION.json kept may lack what was just verified
        packages.on_save(lambda _provider, _version: quick_answers.clear())
        packages.on_list_change(quick_answers.clear)
    policy.dated_by("provider", lambda address, version: packages.signed_at(
        ProviderAddress.parse(*address.split("/")), version))
    stored = StoredPackages(packages, archives, config.upstream)
    opened.push_async_callback(stored.close)
    fills = PackageFills(packages, stored, archives, config.upstream, metrics, audit)
    opened.push_async_callback(fills.close)  # closed first: fills stop before what they use
    mirror = ProviderMirror(packages, stored, fills, config.upstream, metrics, activity, policy)
    opened.push_async_callback(mirror.close)
    registry = ProviderRegistryService(packages, stored, config.upstream, policy)
    opened.push_async_callback(registry.close)
    app[REGISTRY_KEY] = registry
    git_ca = combined_ca_bundle(config.upstream.ca_bundle, cache_dir / "tls" / "git-ca.pem")
    git_gate = EgressGate(egress, config.upstream.connect_timeout)
    opened.push_async_callback(git_gate.close)
    sources = ModuleSourceFetcher(http, config.modules, git_ca, git_gate)
    modules = ModuleRegistry(ModuleRegistryClient(http, discovery), sources, cache, archives,
                             config.upstream, metrics, filters, activity, policy, audit)
    opened.push_async_callback(modules.close)
    if quick_answers is not None:
        modules.on_list_change(quick_answers.clear)
    app[ARCHIVES_KEY] = archives
    app[MIRROR_KEY] = mirror
    app[MODULES_KEY] = modules
    oci_records = OciRecords(cache)
    oci = OciProviders(mirror, packages, stored, fills, oci_records, config.upstream, policy)
    opened.push_async_callback(oci.close)
    app[OCI_KEY] = oci
    oci_modules = OciModules(modules, archives, cache, oci_records, config.upstream)
    opened.push_async_callback(oci_modules.close)
    app[OCI_MODULES_KEY] = oci_modules
    try:
        release_keys = await quick(load_release_keys, config.releases)
    except (OSError, ReleaseKeyError) as exc:
        raise ProxyError(f"releases: the release keys cannot be read: {exc}") from None
    releases = CliReleases(
        ReleasesClient(http, config.releases, config.upstream.max_archive_size), archives,
        cache, release_keys, config.upstream, metrics, activity, policy, audit)
    opened.push_async_callback(releases.close)
    policy.dated_by("cli", releases.signed_at)
    app[RELEASES_KEY] = releases


async def _thread_pools(_app: web.Application) -> AsyncIterator[None]:
    async with serving():
        yield
