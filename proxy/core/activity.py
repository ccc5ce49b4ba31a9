"""What a process saw that operators ask about on the status page: each upstream host's
health, recent integrity failures, the most requested providers and modules. Recorded where
it happens, in bounded memory; a snapshot is a JSON-able dict, and the snapshots of every
worker process merge into one view (merge_snapshots). Pure: no I/O."""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from proxy.core.redaction import excerpt

# Integrity failures remembered (and shown), newest first.
RECENT_FAILURES = 20
# Names shown per kind, and written into each snapshot.
TOP_NAMES = 10
SHARED_NAMES = 50
# Names counted per kind: when a new one would exceed this, the less requested half is
# forgotten (requests for many different names cannot grow memory without bound).
COUNTED_NAMES = 1000
# Upstream hosts remembered: the configured ones and those registries send downloads to,
# a handful; bounded all the same.
HOSTS = 64
_REASON_CHARACTERS = 300
REQUEST_KINDS = ("provider", "module")
# Pulls remembered (the newest), each an artifact sent to a client.
RECENT_PULLS = 100


@dataclass
class HostHealth:
    """One upstream host as this process saw it (times: epoch seconds)."""

    last_success: float | None = None
    last_error: float | None = None
    last_error_reason: str | None = None
    succeeded: int = 0
    failed: int = 0
    stale_answers: int = 0


class CappedCounts:
    """Request counts by name, at most `limit` names (see COUNTED_NAMES)."""

    def __init__(self, limit: int = COUNTED_NAMES) -> None:
        self._limit = limit
        self._counts: dict[str, int] = {}

    def add(self, name: str) -> None:
        """Count one request for name."""
        counts = self._counts
        if name not in counts and len(counts) >= self._limit:
            kept = heapq.nlargest(self._limit // 2, counts.items(), key=lambda item: item[1])
            self._counts = counts = dict(kept)
        counts[name] = counts.get(name, 0) + 1

    def top(self, count: int) -> dict[str, int]:
        """The `count` most requested names and their counts."""
        return dict(heapq.nlargest(count, self._counts.items(), key=lambda item: item[1]))

    def __len__(self) -> int:
        return len(self._counts)


class Activity:
    """The recorder: one per process, built by the composition root and passed to the code
    where things happen (upstream requests, verification, the protocol services)."""

    def __init__(self) -> None:
        self.started = time.time()
        self._hosts: dict[str, HostHealth] = {}
        self._failures: deque[dict[str, Any]] = deque(maxlen=RECENT_FAILURES)
        self._requested = {kind: CappedCounts() for kind in REQUEST_KINDS}
        self._pulls: deque[dict[str, Any]] = deque(maxlen=RECENT_PULLS)
        self._pulled = {"hit": 0, "miss": 0}
        self._identities = CappedCounts()
        self._refusals: deque[dict[str, Any]] = deque(maxlen=RECENT_FAILURES)

    def _host(self, host: str) -> HostHealth | None:
        health = self._hosts.get(host)
        if health is None and len(self._hosts) < HOSTS:
            health = self._hosts[host] = HostHealth()
        return health

    def upstream_succeeded(self, host: str) -> None:
        """Upstream host answered (any status below 500)."""
        health = self._host(host)
        if health is not None:
            health.last_success = time.time()
            health.succeeded += 1

    def upstream_failed(self, host: str, reason: str) -> None:
        """A request to upstream host failed (unreachable, timeout, 5xx, unusable answer)."""
        health = self._host(host)
        if health is not None:
            health.last_error = time.time()
            health.last_error_reason = excerpt(reason, _REASON_CHARACTERS)
            health.failed += 1

    def stale_answer(self, host: str) -> None:
        """An expired copy of host's document was served because host failed."""
        health = self._host(host)
        if health is not None:
            health.stale_answers += 1

    def pulled(self, kind: str, name: str, version: str, cache: str,
               client: str | None, identity: str | None = None) -> None:
        """An artifact (kind: provider, module, cli) was sent to a client, from the cache
        (cache "hit") or after waiting for upstream ("miss"); client: who asked, when the
        operator records that (the audit log is on), else None; identity: the name of the
        token or OIDC identity it authenticated as, if any."""
        if kind in self._requested:
            self._requested[kind].add(name)
        if identity:
            self._identities.add(identity)
        outcome = "miss" if cache == "miss" else "hit"
        self._pulled[outcome] += 1
        self._pulls.appendleft({
            # An OCI blob is asked for by digest: its pull names no version.
            "time": time.time(), "kind": kind,
            "artifact": excerpt(f"{name} {version}" if version else name, 200),
            "cache": outcome, "client": None if client is None else excerpt(client, 120)})

    def policy_refusal(self, artifact: str, kind: str, reason: str, rule: str) -> None:
        """The version policy refused a version (kind: cooldown, deny)."""
        self._refusals.appendleft({
            "time": time.time(), "artifact": excerpt(artifact, _REASON_CHARACTERS),
            "kind": kind, "rule": excerpt(rule, 60),
            "reason": excerpt(reason, _REASON_CHARACTERS)})

    def integrity_failure(self, artifact: str, kind: str, reason: str) -> None:
        """An artifact failed verification (kind: checksum, signature, sha256sums, ...)."""
        self._failures.appendleft({
            "time": time.time(), "artifact": excerpt(artifact, _REASON_CHARACTERS),
            "kind": excerpt(kind, 40), "reason": excerpt(reason, _REASON_CHARACTERS)})

    def snapshot(self) -> dict[str, Any]:
        """What this process recorded, JSON-able (the form merge_snapshots reads)."""
        return {
            "started": self.started,
            "hosts": {host: asdict(health) for host, health in self._hosts.items()},
            "integrity_failures": list(self._failures),
            "requested": {kind: counts.top(SHARED_NAMES)
                          for kind, counts in self._requested.items()},
            "recent_pulls": list(self._pulls),
            "pulls": dict(self._pulled),
            "identities": self._identities.top(SHARED_NAMES),
            "policy_refusals": list(self._refusals),
        }


def merge_snapshots(snapshots: list[dict[str, Any]]) -> dict[str, Any]:
    """One view of several processes' snapshots: per host the latest success and error and
    the summed counts; the newest integrity failures; the summed request counts' top names.
    Other keys that hold numbers or {key: number} maps are summed."""
    hosts: dict[str, HostHealth] = {}
    failures: list[dict[str, Any]] = []
    pulls: list[dict[str, Any]] = []
    refusals: list[dict[str, Any]] = []
    identities: dict[str, int] = {}
    requested: dict[str, dict[str, int]] = {kind: {} for kind in REQUEST_KINDS}
    sums: dict[str, Any] = {}
    for snapshot in snapshots:
        for host, health in snapshot.get("hosts", {}).items():
            _merge_host(hosts.setdefault(host, HostHealth()), HostHealth(**health))
        failures.extend(snapshot.get("integrity_failures", ()))
        pulls.extend(snapshot.get("recent_pulls", ()))
        refusals.extend(snapshot.get("policy_refusals", ()))
        for name, count in snapshot.get("identities", {}).items():
            identities[name] = identities.get(name, 0) + count
        for kind, counts in snapshot.get("requested", {}).items():
            into = requested.setdefault(kind, {})
            for name, count in counts.items():
                into[name] = into.get(name, 0) + count
        for key, value in snapshot.items():
            if key not in ("hosts", "identities", "integrity_failures", "policy_refusals",
                           "recent_pulls", "requested", "started", "written"):
                sums[key] = _add(sums.get(key), value)
    failures.sort(key=lambda failure: failure["time"], reverse=True)
    pulls.sort(key=lambda pull: pull["time"], reverse=True)
    refusals.sort(key=lambda refusal: refusal["time"], reverse=True)
    return {
        **sums,
        "started": min((s["started"] for s in snapshots), default=None),
        "hosts": hosts,
        "integrity_failures": failures[:RECENT_FAILURES],
        "recent_pulls": pulls[:RECENT_PULLS],
        "policy_refusals": refusals[:RECENT_FAILURES],
        "identities": heapq.nlargest(TOP_NAMES, identities.items(),
                                     key=lambda i: (i[1], i[0])),
        "requested": {kind: heapq.nlargest(TOP_NAMES, counts.items(), key=lambda i: (i[1], i[0]))
                      for kind, counts in requested.items()},
    }


def _merge_host(into: HostHealth, other: HostHealth) -> None:
    if other.last_success is not None and (into.last_success or 0) < other.last_success:
        into.last_success = other.last_success
    if other.last_error is not None and (into.last_error or 0) < other.last_error:
        into.last_error, into.last_error_reason = other.last_error, other.last_error_reason
    into.succeeded += other.succeeded
    into.failed += other.failed
    into.stale_answers += other.stale_answers


def _add(total: Any, value: Any) -> Any:
    """total + value for numbers, key by key (recursively) for maps."""
    if isinstance(value, dict):
        merged = dict(total) if isinstance(total, dict) else {}
        for key, item in value.items():
            merged[key] = _add(merged.get(key), item)
        return merged
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (total if isinstance(total, int | float) else 0) + value
    return total
