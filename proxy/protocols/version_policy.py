"""The version policy, as every protocol asks it (proxy.config.policy judges; this finds the
release times and keeps the answers consistent): a version that is too new or denied is left
out of every version list and refused on direct request (403: PolicyRefused) before anything
is looked up, on the network mirror, the provider and module registry protocols, the OCI
endpoint and the CLI releases alike. `[policy]` is replaced on SIGHUP (reload)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any

from proxy.config.policy import (
    SERVED,
    Verdict,
    duration_text,
    iso,
    judge,
)
from proxy.config.settings import PolicyConfig
from proxy.core.access import pull_target
from proxy.core.activity import Activity
from proxy.core.audit import NO_AUDIT, Artifact, AuditLog, Requester
from proxy.core.errors import Forbidden, ProxyError
from proxy.core.held import keep_recent
from proxy.core.metrics import Metrics
from proxy.core.models import ModuleAddress, ProviderAddress, version_sort_key
from proxy.verification.release_times import ReleaseTimes

log = logging.getLogger(__name__)

# How a kind's signature time is found: (address, version) -> epoch seconds, or None.
SignedAt = Callable[[str, str], Awaitable[float | None]]
# A version list waits at most this long for release times it lacks (Terraform gives a
# registry request 10 s); the rest are found in the background and show on a later request.
LIST_BUDGET_SECONDS = 4.0
_AT_ONCE = 8
# Version lists whose hidden versions are remembered (for warnings and audit lines).
_HELD = 4096
# The hidden versions a registry `warnings` names, newest first.
_WARNED = 5
# A client listing again is told (an audit line) about the same hidden version this rarely.
_TELL_AGAIN_SECONDS = 600.0
# Release times held in memory (each one read again from the store once forgotten).
_RELEASES_HELD = 1 << 16
# A version whose release time could not be found (upstream failing, no platform served) is
# not looked up again for this long: lists of it must not wait on it every time.
_RETRY_SECONDS = 60.0
# A version a list left out, and the verdict that did.
Hidden = tuple[str, Verdict]


class PolicyRefused(Forbidden):
    """A version the policy does not serve (now): why, and when it will be."""

    def __init__(self, verdict: Verdict, address: str, version: str) -> None:
        super().__init__(verdict.message(address, version))
        self.verdict = verdict
        self.advice = (
            "pin a version the rule does not cover, or change [[policy.deny]] and reload "
            "(SIGHUP)" if verdict.kind == "deny" else
            "use an older version until then, or add a [[policy.allow]] exception and reload "
            "(SIGHUP)")

    def audit_outcome(self) -> str:
        """policy_cooldown or policy_deny."""
        return f"policy_{self.verdict.kind}"

    def audit_details(self) -> dict[str, object]:
        """The entry that refused it, and for a cooldown when it will be served."""
        when = self.verdict.available_at
        return {"rule": self.verdict.rule, "available_at": None if when is None else iso(when)}


class VersionPolicy:
    """The policy in force, the release times it needs, and the refusals it makes."""

    def __init__(self, config: PolicyConfig, times: ReleaseTimes, metrics: Metrics,
                 activity: Activity, audit: AuditLog = NO_AUDIT,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.times = times
        self._metrics = metrics
        self._activity = activity
        self._audit = audit
        self._clock = clock
        self._signed: dict[str, SignedAt] = {}
        # Release times found, by (kind, address, version): they never change.
        self._released: OrderedDict[tuple[str, str, str], float] = OrderedDict()
        # Versions found without a release time: until when they count as new untried.
        self._unknown: OrderedDict[tuple[str, str, str], float] = OrderedDict()
        self._finding: dict[tuple[str, str, str], asyncio.Task[float | None]] = {}
        # What the last version list of each address left out, and why.
        self._hidden: OrderedDict[tuple[str, str], tuple[Hidden, ...]] = OrderedDict()
        # When a client was last told (logged, audited) what a list of an address hid.
        self._told: OrderedDict[tuple[str | None, str, str], float] = OrderedDict()
        self._on_reload: list[Callable[[], None]] = []

    def dated_by(self, kind: str, signed_at: SignedAt) -> None:
        """How the signature time of a version of kind (provider, cli) is found."""
        self._signed[kind] = signed_at

    def on_reload(self, listener: Callable[[], None]) -> None:
        """Call listener() whenever another policy is put in force (answers kept because no
        policy was in force are dropped)."""
        self._on_reload.append(listener)

    def reload(self, config: PolicyConfig) -> None:
        """Put a new policy in force (SIGHUP)."""
        self.config = config
        for listener in self._on_reload:
            listener()
        log.info("version policy: %s", describe(config))

    async def close(self) -> None:
        """Stop release-time lookups under way (shutdown)."""
        for task in list(self._finding.values()):
            task.cancel()
        await asyncio.gather(*self._finding.values(), return_exceptions=True)

    async def verdict(self, kind: str, address: str, target: str, version: str) -> Verdict:
        """The verdict on version of the artifact at address (target: the address as the
        policy matches it, proxy.core.access.pull_target)."""
        config = self.config
        if not config.active:
            return SERVED
        found = judge(config, target, version, None, self._clock())
        if found.kind != "cooldown":  # decided without its age: a deny or allow entry
            return found
        released = await self.released_at(kind, address, version)
        return judge(config, target, version, released, self._clock())

    async def require(self, kind: str, address: str, target: str, version: str,
                      artifact: str | None = None) -> None:
        """PolicyRefused (403) unless the policy serves version now; counted, listed on the
        status page."""
        verdict = await self.verdict(kind, address, target, version)
        if verdict.served:
            return
        assert verdict.kind is not None
        self._metrics.policy_refusals.labels(verdict.kind).inc()
        refused = PolicyRefused(verdict, target, version)
        self._activity.policy_refusal(artifact or f"{address} {version}", verdict.kind,
                                      refused.message, verdict.rule)
        raise refused

    async def visible(self, kind: str, address: str, target: str,
                      versions: Sequence[str]) -> list[str]:
        """The versions the policy serves now, in the order given (what it leaves out:
        hidden). Release times not known yet are looked up (newest first, a few at once) for
        at most LIST_BUDGET_SECONDS; those still unknown count as new until they are."""
        config = self.config
        if not config.active:
            self._hidden.pop((kind, address), None)
            return list(versions)
        now = self._clock()
        dated = [v for v in versions if (kind, address, v) not in self._released
                 and judge(config, target, v, None, now).kind == "cooldown"]
        await self._find_some(kind, address, sorted(dated, key=newest_first, reverse=True))
        now = self._clock()
        shown, hidden = [], []
        for version in versions:
            verdict = judge(config, target, version,
                            self._released.get((kind, address, version)), now)
            if verdict.served:
                shown.append(version)
            else:
                hidden.append((version, verdict))
        keep_recent(self._hidden, (kind, address), tuple(hidden), _HELD)
        return shown

    def hidden(self, kind: str, address: str) -> tuple[Hidden, ...]:
        """What the last version list of address left out, and why (newest first)."""
        return tuple(sorted(self._hidden.get((kind, address), ()),
                            key=lambda found: newest_first(found[0]), reverse=True))

    def warnings(self, kind: str, address: str, target: str) -> list[str]:
        """The registry protocol's `warnings` for a version list that hid versions: Terraform
        prints them (a lock file pinning one then fails with the reason beside it)."""
        hidden = self.hidden(kind, address)
        told = [verdict.message(target, version) for version, verdict in hidden[:_WARNED]]
        if len(hidden) > _WARNED:
            told.append(f"{len(hidden) - _WARNED} older versions of {target} are hidden by "
                        "the version policy too")
        return told

    def tell_hidden(self, kind: str, address: str, target: str,
                    requester: Requester) -> None:
        """Say which versions the last list of address hid: a WARNING line, and a `refused`
        audit line per version, once per client every _TELL_AGAIN_SECONDS (clients list
        often; a lock file pinning a hidden version fails on the list alone)."""
        hidden = self.hidden(kind, address)
        key = (requester.client, kind, address)
        told = self._told.get(key)
        now = time.monotonic()
        if not hidden or (told is not None and now - told < _TELL_AGAIN_SECONDS):
            return
        keep_recent(self._told, key, now, _HELD)
        log.warning("%s: the version policy left %s out of the version list sent to %s",
                    target, "; ".join(_why(version, verdict) for version, verdict in
                                      hidden[:_WARNED])
                    + (f"; and {len(hidden) - _WARNED} more" if len(hidden) > _WARNED else ""),
                    requester.client or "a local command")
        for version, verdict in hidden:
            refused = PolicyRefused(verdict, target, version)
            self._audit.record("refused", _artifact(kind, address, version),
                               outcome=refused.audit_outcome(), requester=requester,
                               status=200, reason=f"left out of the version list: "
                               f"{refused.message}", **refused.audit_details())

    async def released_at(self, kind: str, address: str, version: str) -> float | None:
        """The release time this proxy can vouch for (None: not known yet)."""
        key = (kind, address, version)
        found = self._released.get(key)
        if found is not None:
            return found
        if self._unknown.get(key, 0.0) > self._clock():
            return None
        task = self._finding.get(key)
        if task is None:
            task = asyncio.ensure_future(self._find(kind, address, version))
            self._finding[key] = task
            task.add_done_callback(lambda _task: self._finding.pop(key, None))
        return await asyncio.shield(task)

    async def _find_some(self, kind: str, address: str, versions: list[str]) -> None:
        if not versions:
            return
        limit = asyncio.Semaphore(_AT_ONCE)

        async def one(version: str) -> None:
            async with limit:
                await self.released_at(kind, address, version)

        pending = [asyncio.ensure_future(one(version)) for version in versions]
        _done, late = await asyncio.wait(pending, timeout=LIST_BUDGET_SECONDS)
        if late:  # they go on (shielded lookups); a later list shows what they find
            log.info("version policy: %d release times of %s are still being looked up",
                     len(late), address)

    async def _find(self, kind: str, address: str, version: str) -> float | None:
        try:
            if kind == "module":
                found = await self.times.first_seen(kind, address, version)
            else:
                signed = self._signed.get(kind)
                signed_at = None if signed is None else await signed(address, version)
                found = await self.times.signed_release(kind, address, version, signed_at)
        except ProxyError as exc:  # unknown for now: counts as new, tried again later
            log.debug("version policy: no release time for %s %s: %s", address, version,
                      exc.message)
            found = None
        key = (kind, address, version)
        if found is None:
            keep_recent(self._unknown, key, self._clock() + _RETRY_SECONDS, _RELEASES_HELD)
        else:
            self._unknown.pop(key, None)
            keep_recent(self._released, key, found, _RELEASES_HELD)
        return found

    async def list_tag(self, kind: str, address: str, target: str,
                       versions: Sequence[str]) -> Hashable:
        """What a held version list document depends on besides the list itself: the
        versions the policy shows now (None while it is off)."""
        if not self.config.active:
            return None
        return tuple(await self.visible(kind, address, target, versions))

    def rules_document(self) -> dict[str, Any]:
        """The policy in force, for the status page (durations as configured: "72h")."""
        config = self.config
        return {
            "active": config.active,
            "min_release_age": duration_text(config.min_release_age),
            "rules": [{"match": r.match, "min_release_age": duration_text(r.min_release_age)}
                      for r in config.rules],
            "deny": [{"match": d.match, "versions": d.versions, "reason": d.reason}
                     for d in config.deny],
            "allow": [{"match": a.match, "versions": a.versions, "reason": a.reason}
                      for a in config.allow],
        }


def describe(config: PolicyConfig) -> str:
    """One line on the policy in force, for the log."""
    if not config.active and not config.allow:
        return "off (every version is served)"
    return (f"cooldown {duration_text(config.min_release_age)} by default, {len(config.rules)} "
            f"rule(s), {len(config.deny)} deny and {len(config.allow)} allow entries")


def _why(version: str, verdict: Verdict) -> str:
    if verdict.kind == "deny":
        return f"{version} (denied: {verdict.rule})"
    until = "release time not known yet" if verdict.available_at is None else \
        f"served from {iso(verdict.available_at)}"
    return f"{version} (cooldown, {verdict.rule}: {until})"


def _artifact(kind: str, address: str, version: str) -> Artifact:
    """The audit log's name for version of the artifact at address."""
    if kind == "cli":
        return Artifact.release(address, version)
    host, namespace, name, *system = [*address.split("/"), "", ""][:4]
    return Artifact(kind, host, namespace, name, version,
                    system=system[0] or None if kind == "module" else None)


def newest_first(version: str) -> tuple[Any, ...]:
    """A sort key that puts the newest version last (reverse=True: first); versions that do
    not parse sort below the rest."""
    try:
        return (1, version_sort_key(version))
    except ValueError:
        return (0, version)


def provider_target(provider: ProviderAddress) -> str:
    """A provider's address as the policy matches it."""
    return pull_target("provider", provider.hostname, provider.namespace, provider.type)


def module_target(module: ModuleAddress) -> str:
    """A module's address as the policy matches it (its target system is not matched)."""
    return pull_target("module", module.hostname, module.namespace, module.name)
