"""What every integrity failure gets, wherever it is found: counted (tfproxy_integrity_
failures_total), listed on the status page, logged, and returned as the error to raise with
the key IDs its cause names."""

from __future__ import annotations

import logging

from proxy.core.activity import Activity
from proxy.core.errors import IntegrityError, IntegrityKind
from proxy.core.metrics import Metrics

log = logging.getLogger(__name__)


def reported(metrics: Metrics, activity: Activity, kind: IntegrityKind, message: str,
             artifact: str, cause: IntegrityError | None = None) -> IntegrityError:
    """Count, list and log an integrity failure of artifact; the error that says it."""
    metrics.integrity_failures.labels(kind).inc()
    activity.integrity_failure(artifact, kind, message)
    log.error("integrity failure (%s): %s", kind, message)
    if cause is None:
        return IntegrityError(kind, message)
    return IntegrityError(kind, message, signed_by=cause.signed_by, keys_tried=cause.keys_tried)
