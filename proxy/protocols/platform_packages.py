"""A version's packages, platform by platform, for the documents that list them (the
network mirror's VERSION.json, the OCI index): the platforms that fail are left out and
retried on the next request, a bad signature condemns the whole release, and a version none
of whose platforms can be served gets one error of the failures' kind."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

from proxy.config.filters import Filters
from proxy.core.errors import (
    FilteredOut,
    InsufficientStorage,
    IntegrityError,
    NotFound,
    Offline,
    ProxyError,
    UpstreamError,
)
from proxy.core.models import Platform, ProviderAddress

log = logging.getLogger(__name__)
T = TypeVar("T")
# Platforms of one version looked up (and, for OCI, filled) at once.
PLATFORM_CONCURRENCY = 8


def served_platforms(provider: ProviderAddress, version: str, listed: Iterable[Platform],
                     filters: Filters) -> list[Platform]:
    """The platforms upstream lists for a version that the filters let through; an error if
    that leaves none."""
    listed = list(listed)
    if not listed:
        raise UpstreamError(f"upstream lists no platforms for {provider} {version}")
    platforms = [p for p in listed if filters.platform_allowed(p)]
    if not platforms:
        raise FilteredOut(f"{provider} {version} is not served for any platform (filters)")
    return platforms


async def for_each_platform(provider: ProviderAddress, version: str,
                            platforms: list[Platform],
                            one: Callable[[Platform], Awaitable[T]]
                            ) -> tuple[list[tuple[Platform, T]], bool]:
    """one(platform) for every platform, PLATFORM_CONCURRENCY at a time: the results of
    those that succeeded, and whether every platform did. Failures are logged and left
    out; a bad SHA256SUMS signature is raised, and so is no_package_error when none
    succeeded."""
    limit = asyncio.Semaphore(PLATFORM_CONCURRENCY)

    async def bounded(platform: Platform) -> T:
        async with limit:
            return await one(platform)

    results = await asyncio.gather(*(bounded(p) for p in platforms), return_exceptions=True)
    done: list[tuple[Platform, T]] = []
    failures: list[ProxyError] = []
    for platform, result in zip(platforms, results, strict=True):
        if isinstance(result, IntegrityError) and result.kind == "signature":
            raise result
        if not isinstance(result, BaseException):
            done.append((platform, result))
            continue
        if not isinstance(result, ProxyError):
            log.error("%s %s %s left out", provider, version, platform.key, exc_info=result)
        failure = result if isinstance(result, ProxyError) else UpstreamError("internal error")
        # Offline, a platform the cache lacks is the normal case, not news.
        log.log(logging.DEBUG if isinstance(failure, Offline) else logging.WARNING,
                "%s %s %s left out: %s", provider, version, platform.key, failure.message)
        failures.append(failure)
    if not done:
        raise no_package_error(provider, version, failures)
    return done, not failures


def no_package_error(provider: ProviderAddress, version: str,
                     failures: list[ProxyError]) -> ProxyError:
    """The answer for a version none of whose platforms could be served: it keeps the
    failures' kind where they share one (the log line that explains it to the operator says
    what to do by kind: web/error_warnings.py)."""
    first = failures[0]
    if all(isinstance(f, Offline) for f in failures):
        return Offline(f"no package of {provider} {version}: {first.message}")
    if all(isinstance(f, NotFound) for f in failures):
        return NotFound(f"no package of {provider} {version}: {first.message}")
    if all(isinstance(f, InsufficientStorage) for f in failures):
        return first
    if isinstance(first, IntegrityError) and all(isinstance(f, IntegrityError) for f in failures):
        return IntegrityError(first.kind, f"no package of {provider} {version} verifies: "
                                          f"{first.message}")
    return UpstreamError(f"no package of {provider} {version} could be fetched: "
                         f"{first.message}")
