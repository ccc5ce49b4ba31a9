"""One WARNING line for each refused request that names an artifact: Terraform shows its user
only our status code, so the operator's log must say which artifact, why, and what to do.

Requests that name no artifact (a path no route serves, a malformed address: scanners and
typos) are not logged here, and lines are rate-limited per artifact and reason (per worker
process), so no client can flood the log.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from proxy.core.errors import BadRequest, ProxyError
from proxy.core.log_limits import KeyedRateLimitedLog
from proxy.core.redaction import excerpt, mask_secrets
from proxy.web.artifacts import named_artifact

log = logging.getLogger(__name__)

# The same artifact failing for the same reason: one line a minute is enough to act on.
WARNING_INTERVAL = 60.0


def artifact_named(route: str, params: Mapping[str, str]) -> str | None:
    """The artifact a request to route with these path parameters names, as operators read
    it; None when it names none or not validly."""
    named = named_artifact(route, params)
    return named.artifact.label() if named is not None else None


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
