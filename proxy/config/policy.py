"""The version policy's judgement: whether a version of an address may be served now, and if
not why and from when. Deny entries win (a version they cover is never served); then allow
entries (served at once, whatever its age); then the cooldown: the first `[[policy.rules]]`
entry matching the address, else `min_release_age`, counted from the release's time (a time
in the future counts as now; an unknown one as "not yet": the version counts as new).
Addresses are `HOST/NAMESPACE/NAME` (providers and modules) or `releases/PRODUCT` (the CLI
releases), as proxy.core.access spells them. Pure: no I/O."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from proxy.config.settings import PolicyConfig
from proxy.core.access import allows
from proxy.core.constraints import satisfies


@dataclass(frozen=True)
class Verdict:
    """Whether a version is served, and if not, why (kind: cooldown or deny), by which entry,
    and when it will be (a cooldown whose release time is known; None otherwise)."""

    served: bool
    kind: str | None = None
    rule: str = ""
    reason: str = ""
    available_at: float | None = None

    def message(self, address: str, version: str) -> str:
        """What a refusal answers."""
        if self.kind == "deny":
            return f"{address} {version} is denied by {self.rule}: {self.reason}"
        when = "" if self.available_at is None else \
            f"; it will be served from {iso(self.available_at)}"
        return f"{address} {version} is too new for the version policy ({self.rule}: " \
            f"{self.reason}){when}"


SERVED = Verdict(True)


def cooldown_of(policy: PolicyConfig, address: str) -> tuple[float, str]:
    """The minimum release age for address, in seconds, and the entry that sets it."""
    for index, rule in enumerate(policy.rules):
        if allows((rule.match,), address):
            return rule.min_release_age, f"policy.rules[{index}]"
    return policy.min_release_age, "policy.min_release_age"


def judge(policy: PolicyConfig, address: str, version: str, released_at: float | None,
          now: float) -> Verdict:
    """The verdict on version of address, released at released_at (epoch seconds; None:
    not known), at time now."""
    for index, deny in enumerate(policy.deny):
        if allows((deny.match,), address) and _covers(deny.versions, version):
            return Verdict(False, "deny", f"policy.deny[{index}]",
                           deny.reason or "no reason given")
    for allow in policy.allow:
        if allows((allow.match,), address) and _covers(allow.versions, version):
            return SERVED
    age, rule = cooldown_of(policy, address)
    if age <= 0:
        return SERVED
    if released_at is None:
        return Verdict(False, "cooldown", rule,
                       f"its release time is not known yet, so it counts as new (cooldown "
                       f"{duration_text(age)})")
    released = min(released_at, now)  # a time in the future counts as now
    ready = released + age
    if ready <= now:
        return SERVED
    return Verdict(False, "cooldown", rule,
                   f"released {iso(released)}, younger than the {duration_text(age)} "
                   "cooldown", ready)


def _covers(versions: str | None, version: str) -> bool:
    try:
        return versions is None or satisfies(version, versions)
    except ValueError:  # not a version the constraint can compare: not covered
        return False


def duration_text(seconds: float) -> str:
    """As people write it: 72h, 30m, 14d ("0": none); days from a week up."""
    if seconds <= 0:
        return "0"
    if seconds % 86400 == 0 and seconds >= 7 * 86400:
        return f"{int(seconds // 86400)}d"
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{int(seconds)}s"


def iso(epoch: float) -> str:
    """An instant as RFC 3339, UTC, whole seconds."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
