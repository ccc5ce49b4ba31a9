"""One WARNING line for each refused request that names an artifact: Terraform shows its user
only our status code, so the operator's log must say which artifact, why, and what to do.

Requests that name no artifact (a path no route serves, a malformed address: scanners and
typos) are not logged here, and lines are rate-limited per artifact and reason (per worker
process), so no client can flood the log.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from proxy.core import models
from proxy.core.errors import BadRequest, ProxyError
from proxy.core.log_limits import KeyedRateLimitedLog
from proxy.core.redaction import excerpt, mask_secrets
from proxy.verification.packages import SUMS_ID

log = logging.getLogger(__name__)

# The same artifact failing for the same reason: one line a minute is enough to act on.
WARNING_INTERVAL = 60.0
_SUMS_FILES = ("SHA256SUMS", "SHA256SUMS.sig")


def artifact_named(route: str, params: Mapping[str, str]) -> str | None:
    """The artifact a request to route with these path parameters names, as operators read
    it ("provider HOST/NS/TYPE VERSION OS_ARCH", "module HOST/NS/NAME/SYSTEM VERSION"); None
    when it names none or not validly."""
    try:
        if route in ("mirror", "provider_versions", "provider_download", "provider_sums"):
            return _provider_artifact(route, params)
        if route in ("module_versions", "module"):
            return _module_artifact(route, params)
    except BadRequest:
        return None
    return None


def _provider_artifact(route: str, params: Mapping[str, str]) -> str | None:
    provider = models.ProviderAddress.parse(params["hostname"], params["namespace"],
                                            params["type"])
    named = f"provider {provider}"
    if route == "provider_versions":
        return named
    if route == "provider_download":
        platform = models.Platform.parse(params["os"], params["arch"])
        return f"{named} {models.parse_version(params['version'])} {platform.key}"
    if route == "provider_sums":
        if not SUMS_ID.fullmatch(params["sums"]) or params["file"] not in _SUMS_FILES:
            return None
        return f"{named} {models.parse_version(params['version'])}"
    name = params["name"]
    if name == "index.json":
        return named
    if name.endswith(".zip"):
        version, platform = provider.parse_archive_filename(name)
        return f"{named} {version} {platform.key}"
    if name.endswith(".json"):
        return f"{named} {models.parse_version(name.removesuffix('.json'))}"
    return None


def _module_artifact(route: str, params: Mapping[str, str]) -> str | None:
    module = models.ModuleAddress.parse(params["hostname"], params["namespace"],
                                        params["name"], params["system"])
    if route == "module_versions":
        return f"module {module}"
    version = models.parse_module_version(params["version"])
    if params["action"] not in ("download", f"{module.name}-{module.system}-{version}.tar.gz"):
        return None
    return f"module {module} {version}"


class ErrorWarnings:
    """Logs why a request that names an artifact was refused, and what to do about it."""

    def __init__(self, interval: float = WARNING_INTERVAL) -> None:
        self._lines = KeyedRateLimitedLog(log, interval=interval)

    def refused(self, route: str, params: Mapping[str, str], path: str,
                error: ProxyError) -> None:
        """Log why a request to route (path parameters params) was refused: for the artifact
        they name, with what to do; else only a 5xx (the proxy could not answer, which is
        news even without an artifact), per route and status. Rate-limited."""
        # A malformed request (400) names nothing validly, whatever its path parameters say.
        artifact = None if isinstance(error, BadRequest) else artifact_named(route, params)
        if artifact is not None:
            self._explain(artifact, f"answered {error.status}", error)
        elif error.status >= 500:
            self._lines.log((route, error.status), "%s -> %d: %s", excerpt(path, 200),
                            error.status, mask_secrets(error.message))

    def cut_off(self, route: str, params: Mapping[str, str], error: ProxyError) -> bool:
        """Log why an answer whose headers were sent had to be cut off (upstream failed
        mid-download, the bytes did not verify), when the request names an artifact
        (rate-limited); whether it did."""
        artifact = artifact_named(route, params)
        if artifact is not None:
            self._explain(artifact, "cut off mid-download", error)
        return artifact is not None

    def _explain(self, artifact: str, outcome: str, error: ProxyError) -> None:
        # The same artifact failing for the same kind of reason is one line; the message's
        # details (an upstream's error text) may vary between requests.
        self._lines.log((artifact, type(error)), "%s: %s, %s; what to do: %s", artifact,
                        outcome, mask_secrets(error.message), error.advice)
