"""Which hosts, providers, modules and platforms the proxy serves: the upstream hosts the
operator allowed, narrowed by optional glob filters. Pure."""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

from proxy.config.settings import FiltersConfig, UpstreamConfig
from proxy.core.errors import FilteredOut, HostNotServed
from proxy.core.models import ModuleAddress, Platform, ProviderAddress


def _matches(names: Iterable[str], patterns: tuple[str, ...]) -> bool:
    lowered = [n.lower() for n in names]
    return any(fnmatchcase(name, pattern.lower()) for pattern in patterns for name in lowered)


class Filters:
    """The upstream hosts served ([upstream]), then allow lists (empty: everything) and deny
    lists of globs, from [filters]. A provider pattern matches "namespace/type" or
    "hostname/namespace/type"; a module pattern "namespace/name/system" or with the
    hostname; a platform pattern "os_arch"."""

    def __init__(self, config: FiltersConfig | None = None,
                 upstream: UpstreamConfig | None = None) -> None:
        self._config = config or FiltersConfig()
        self._upstream = upstream or UpstreamConfig()

    def require_host(self, hostname: str) -> None:
        """HostNotServed unless the proxy serves (and may contact) this upstream host. Checked
        before the cache too: a host dropped from the config is not served from disk."""
        if not self._upstream.serves(hostname):
            raise HostNotServed(f"host {hostname} is not served by this proxy")

    def require_provider(self, provider: ProviderAddress) -> None:
        """HostNotServed or FilteredOut unless the proxy serves this provider."""
        self.require_host(provider.hostname)
        if not self.provider_allowed(provider):
            raise FilteredOut(f"{provider} is not served by this proxy (filters)")

    def require_module(self, module: ModuleAddress) -> None:
        """HostNotServed or FilteredOut unless the proxy serves this module."""
        self.require_host(module.hostname)
        if not self.module_allowed(module):
            raise FilteredOut(f"module {module} is not served by this proxy (filters)")

    def provider_allowed(self, provider: ProviderAddress) -> bool:
        """Whether this provider is served at all."""
        if not self._config.providers and not self._config.exclude_providers:
            return True  # no filters (the common case, checked on every request)
        short = f"{provider.namespace}/{provider.type}"
        return _allowed([short, f"{provider.hostname}/{short}"], self._config.providers,
                        self._config.exclude_providers)

    def module_allowed(self, module: ModuleAddress) -> bool:
        """Whether this module is served at all."""
        if not self._config.modules and not self._config.exclude_modules:
            return True
        return _allowed([module.path, str(module)], self._config.modules,
                        self._config.exclude_modules)

    def platform_allowed(self, platform: Platform) -> bool:
        """Whether packages for this platform are served."""
        return not self._config.platforms or _matches([platform.key], self._config.platforms)


def _allowed(names: list[str], allow: tuple[str, ...], deny: tuple[str, ...]) -> bool:
    return (not allow or _matches(names, allow)) and not _matches(names, deny)
