"""The status report (`/status.json`, and the page at `/` that shows it): mode, version,
upstream health, cache use, hit rate, fills, integrity failures, the most requested
providers and modules, as every worker process of this proxy saw them. Fields: README,
"Status page".

Each process writes its snapshot every few seconds (SnapshotShare, under
`<cache.dir>/status/`); a report merges the live process's own, current one with the others'.
Replicas that share an S3 bucket each report their own view."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from proxy import __version__
from proxy.config import Config
from proxy.core.activity import RECENT_FAILURES, Activity, HostHealth, merge_snapshots
from proxy.core.activity_share import WRITE_SECONDS, SnapshotShare
from proxy.core.executors import quick
from proxy.core.metrics import Metrics
from proxy.store.protocol import BlobStore

log = logging.getLogger(__name__)
# Cache lookup results that were answered from the cache.
_HITS = ("hit", "revalidate", "stale")


def snapshot_directory(config: Config) -> Path:
    """Where the processes sharing cache.dir leave their snapshots."""
    return config.cache.dir / "status"


class StatusReport:
    """Builds the status document; shares this process's snapshot while it runs."""

    def __init__(self, config: Config, activity: Activity, metrics: Metrics,
                 blobs: BlobStore, share: SnapshotShare,
                 policy_rules: Callable[[], dict[str, Any]] | None = None) -> None:
        self._config = config
        self._policy_rules = policy_rules  # the version policy in force (it changes on SIGHUP)
        self.activity = activity  # the recorder this process reports
        self._metrics = metrics
        self._blobs = blobs
        self._share = share

    def snapshot(self) -> dict[str, Any]:
        """This process's snapshot: its activity, cache lookups and fills under way."""
        lookups: dict[str, dict[str, float]] = {}
        for metric in self._metrics.cache_lookups.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    kind, result = sample.labels["kind"], sample.labels["result"]
                    lookups.setdefault(kind, {})[result] = sample.value
        fills = sum(sample.value for metric in self._metrics.fills_in_flight.collect()
                    for sample in metric.samples)
        return {**self.activity.snapshot(), "written": time.time(), "lookups": lookups,
                "fills_in_flight": fills}

    @contextlib.asynccontextmanager
    async def sharing(self) -> AsyncIterator[None]:
        """Write this process's snapshot every WRITE_SECONDS until the context ends, then
        withdraw it."""
        task = asyncio.ensure_future(self._share_every())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await quick(self._share.remove)

    async def _share_every(self) -> None:
        while True:
            try:
                await quick(self._share.write, self.snapshot())
            except OSError as exc:  # the page then lacks this process; serving goes on
                log.warning("cannot write the status snapshot in %s: %s",
                            self._share.directory, exc)
            except Exception:  # a bug here must not stop the snapshots for good
                log.exception("writing the status snapshot failed")
            await asyncio.sleep(WRITE_SECONDS)

    async def document(self) -> dict[str, Any]:
        """The status document (see README, "Status page")."""
        others = await quick(self._share.others)
        from_commands = await quick(self._share.command_failures)
        await quick(self._blobs.reread_usage)
        snapshots = [self.snapshot(), *(s for s in others if _readable(s))]
        merged = merge_snapshots(snapshots)
        failures = sorted([*merged["integrity_failures"], *from_commands],
                          key=lambda failure: failure["time"], reverse=True)[:RECENT_FAILURES]
        upstream = self._config.upstream
        hosts: dict[str, HostHealth] = merged["hosts"]
        names = sorted(set(upstream.all_hosts) | set(hosts))
        max_size = self._config.cache.max_size
        store_problem = self._blobs.store_problem()
        return {
            "version": __version__,
            "generated_at": _iso(time.time()),
            "mode": upstream.mode,
            "processes": len(snapshots),
            "counting_since": _iso(merged["started"]),
            "upstreams": [_host_document(name, hosts.get(name), name in upstream.all_hosts)
                          for name in names],
            "cache": {
                "backend": "s3" if self._config.cache.s3 is not None else "disk",
                "bytes": self._blobs.used_bytes,
                "files": self._blobs.file_count,
                "max_bytes": max_size,
                "used_fraction": None if not max_size else
                round(self._blobs.used_bytes / max_size, 4),
                # The shared store (S3): while unreachable, hot copies serve, misses get 503.
                "store": {"reachable": store_problem is None, "problem": store_problem},
            },
            "lookups": _lookups(merged.get("lookups", {})),
            "fills_in_flight": int(merged.get("fills_in_flight", 0)),
            "integrity_failures": [{**failure, "time": _iso(failure["time"])}
                                   for failure in failures],
            "top_providers": _top(merged["requested"].get("provider", [])),
            "top_modules": _top(merged["requested"].get("module", [])),
            # Each file a client got, once (a HEAD and its GET are one): the hit rate that
            # says what clients saw. Who pulled is named only while the audit log is on.
            "pulls": _pulls(merged.get("pulls", {})),
            "recent_pulls": [{**pull, "time": _iso(pull["time"])}
                             for pull in merged.get("recent_pulls", [])],
            "clients": _clients(merged.get("recent_pulls", []))
            if self._config.server.audit_log is not None else None,
            # Who authenticated: tokens and OIDC identities by name, with their pulls.
            "identities": [{"name": name, "pulls": count}
                           for name, count in merged.get("identities", [])]
            if self._config.auth.enabled else None,
            # The version policy in force, and the versions it refused lately.
            "policy": None if self._policy_rules is None else self._policy_rules(),
            "policy_refusals": [{**refusal, "time": _iso(refusal["time"])}
                                for refusal in merged.get("policy_refusals", [])],
        }


def _readable(snapshot: dict[str, Any]) -> bool:
    """Whether another process's snapshot has the shape this version writes (an older or
    damaged one is left out rather than breaking the page)."""
    try:
        merge_snapshots([snapshot])
        return isinstance(snapshot.get("started"), int | float)
    except (TypeError, KeyError, ValueError, AttributeError):
        return False


def _host_document(name: str, health: HostHealth | None, configured: bool) -> dict[str, Any]:
    health = health or HostHealth()
    return {
        "host": name,
        "configured": configured,
        "last_success": _iso(health.last_success),
        "last_error": _iso(health.last_error),
        "last_error_reason": health.last_error_reason,
        "requests_ok": health.succeeded,
        "requests_failed": health.failed,
        "stale_answers": health.stale_answers,
    }


def _lookups(by_kind: dict[str, dict[str, float]]) -> dict[str, Any]:
    counts = {kind: {result: int(n) for result, n in results.items()}
              for kind, results in sorted(by_kind.items())}
    total = sum(sum(results.values()) for results in counts.values())
    hits = sum(results.get(result, 0) for results in counts.values() for result in _HITS)
    return {"total": total, "hits": hits,
            "hit_rate": round(hits / total, 4) if total else None, "by_kind": counts}


def _pulls(counts: dict[str, float]) -> dict[str, Any]:
    hits, misses = int(counts.get("hit", 0)), int(counts.get("miss", 0))
    total = hits + misses
    return {"total": total, "hits": hits, "hit_rate": round(hits / total, 4) if total else None}


def _clients(pulls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The recent pulls per client, busiest first."""
    by_client: dict[str, dict[str, Any]] = {}
    for pull in pulls:  # newest first
        client = pull.get("client")
        if client:
            seen = by_client.setdefault(client, {"client": client, "pulls": 0,
                                                 "last_pull": _iso(pull["time"])})
            seen["pulls"] += 1
    return sorted(by_client.values(), key=lambda seen: (-seen["pulls"], seen["client"]))


def _top(counted: list[tuple[str, int]]) -> list[dict[str, Any]]:
    return [{"name": name, "requests": count} for name, count in counted]


def _iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
