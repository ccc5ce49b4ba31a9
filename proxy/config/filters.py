"""Which providers, modules and platforms the proxy serves (optional glob filters). Pure."""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatchcase

from proxy.config.settings import FiltersConfig
from proxy.core.models import ModuleAddress, Platform, ProviderAddress


def _matches(names: Iterable[str], patterns: tuple[str, ...]) -> bool:
    lowered = [n.lower() for n in names]
    return any(fnmatchcase(name, pattern.lower()) for pattern in patterns for name in lowered)


class Filters:
    """Allow lists (empty: everything) and deny lists of globs, from [filters]. A provider
    pattern matches "namespace/type" or "hostname/namespace/type"; a module pattern
    "namespace/name/system" or with the hostname; a platform pattern "os_arch"."""

    def __init__(self, config: FiltersConfig | None = None) -> None:
        self._config = config or FiltersConfig()

    def provider_allowed(self, provider: ProviderAddress) -> bool:
        """Whether this provider is served at all."""
        short = f"{provider.namespace}/{provider.type}"
        return _allowed([short, f"{provider.hostname}/{short}"], self._config.providers,
                        self._config.exclude_providers)

    def module_allowed(self, module: ModuleAddress) -> bool:
        """Whether this module is served at all."""
        return _allowed([module.path, str(module)], self._config.modules,
                        self._config.exclude_modules)

    def platform_allowed(self, platform: Platform) -> bool:
        """Whether packages for this platform are served."""
        return not self._config.platforms or _matches([platform.key], self._config.platforms)


def _allowed(names: list[str], allow: tuple[str, ...], deny: tuple[str, ...]) -> bool:
    return (not allow or _matches(names, allow)) and not _matches(names, deny)
