"""The version policy's rules as units: the order entries are weighed in, unknown and
future release times, durations, and the release times a proxy can vouch for (a backdated
signature cannot shorten a cooldown once the list has been watched)."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import pytest

from proxy.config.policy import SERVED, duration_text, judge
from proxy.config.settings import (
    CacheConfig,
    PolicyConfig,
    PolicyException,
    PolicyRule,
    parse_duration,
)
from proxy.core.activity import Activity
from proxy.core.errors import Unavailable
from proxy.core.executors import serving
from proxy.core.metrics import Metrics
from proxy.protocols.version_policy import VersionPolicy
from proxy.store.disk import open_disk_storage
from proxy.verification.release_times import ReleaseTimes, first_sightings, with_carried

ALPHA = "registry.terraform.io/acme/alpha"
HOUR = 3600.0
NOW = 1_800_000_000.0

POLICY = PolicyConfig(
    min_release_age=72 * HOUR,
    rules=(PolicyRule("registry.terraform.io/hashicorp/*", 24 * HOUR),
           PolicyRule("registry.terraform.io/*/*", 0.0)),
    deny=(PolicyException(ALPHA, ">= 1.1.0, < 1.1.3", "CVE"),),
    allow=(PolicyException(ALPHA, "1.1.2", "would be served, but deny wins"),
           PolicyException("releases/terraform", "1.12.0", "hotfix")))


def test_deny_wins_then_allow_then_the_first_matching_rule() -> None:
    assert judge(POLICY, ALPHA, "1.1.2", NOW - 1000 * HOUR, NOW).kind == "deny"
    assert judge(POLICY, ALPHA, "1.1.3", None, NOW) == SERVED  # rules[1]: no cooldown
    assert judge(POLICY, "releases/terraform", "1.12.0", None, NOW) == SERVED  # allowed
    hashicorp = judge(POLICY, "registry.terraform.io/hashicorp/aws", "6.0.0", NOW - HOUR, NOW)
    assert hashicorp.kind == "cooldown" and hashicorp.rule == "policy.rules[0]"
    assert hashicorp.available_at == NOW - HOUR + 24 * HOUR
    other = judge(POLICY, "example.com/acme/net", "1.0.0", NOW - HOUR, NOW)
    assert other.rule == "policy.min_release_age" and other.available_at == NOW + 71 * HOUR


def test_an_unknown_age_counts_as_new_and_a_future_one_as_now() -> None:
    unknown = judge(POLICY, "example.com/acme/net", "1.0.0", None, NOW)
    assert unknown.kind == "cooldown" and unknown.available_at is None
    assert "not known yet" in unknown.reason
    future = judge(POLICY, "example.com/acme/net", "1.0.0", NOW + 1000 * HOUR, NOW)
    assert future.available_at == NOW + 72 * HOUR
    assert judge(POLICY, "example.com/acme/net", "1.0.0", NOW - 72 * HOUR, NOW) == SERVED


def test_deny_without_versions_covers_every_version_and_odd_ones_are_not_covered() -> None:
    policy = PolicyConfig(deny=(PolicyException(ALPHA, None, "all"),
                                PolicyException("example.com/a/b", ">= 2.0", "new")))
    assert judge(policy, ALPHA, "0.0.1-beta", None, NOW).kind == "deny"
    assert judge(policy, "example.com/a/b", "not-a-version", None, NOW) == SERVED
    assert not PolicyConfig(allow=policy.deny).active and policy.active


@pytest.mark.parametrize(("text", "seconds"), [("72h", 259200), ("30m", 1800), ("7d", 604800),
                                               ("0", 0), ("90", 90), (3600, 3600)])
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["soon", "-1", "1y", "", True, -5,
                                  "\u0663", "\u0663d"])  # Unicode digits
def test_bad_durations(text: object) -> None:
    assert parse_duration(text) is None


def test_durations_are_written_as_people_write_them() -> None:
    assert [duration_text(s) for s in (0, 72 * HOUR, 24 * HOUR, 14 * 24 * HOUR, 1800, 90)] == \
        ["0", "72h", "24h", "14d", "30m", "90s"]


async def test_a_backdated_signature_cannot_shorten_a_cooldown_the_proxy_watched(
        tmp_path: Path) -> None:
    clock = [NOW - 10 * HOUR]
    async with serving(), AsyncExitStack() as opened:
        storage = await open_disk_storage(CacheConfig(dir=tmp_path / "cache"), Metrics(),
                                          opened)
        times = ReleaseTimes(storage.index, clock=lambda: clock[0])
        await times.listed("provider", ALPHA, ["1.0.0"])
        clock[0] = NOW
        await times.listed("provider", ALPHA, ["1.0.0", "1.3.0"])
        backdated = NOW - 1000 * HOUR
        # The list was watched without 1.3.0 ten hours ago: it is no older than that.
        assert await times.signed_release("provider", ALPHA, "1.3.0", backdated) \
            == NOW - 10 * HOUR
        # Listed at the first look: its signature alone dates it.
        assert await times.signed_release("provider", ALPHA, "1.0.0", backdated) == backdated
        assert await times.signed_release("provider", ALPHA, "1.0.0", None) is None
        # Modules: the first sighting, kept (a later list does not move it).
        await times.listed("module", f"{ALPHA}/aws", ["1.0.0"])
        clock[0] = NOW + HOUR
        await times.listed("module", f"{ALPHA}/aws", ["1.0.0"])
        assert await ReleaseTimes(storage.index).first_seen("module", f"{ALPHA}/aws",
                                                            "1.0.0") == NOW


def test_carried_sightings_merge_the_earlier_and_ignore_garbage() -> None:
    record = {"fetched_at": NOW, "versions": {"1.0.0": [NOW, None], "2.0.0": "junk"}}
    merged = with_carried(record, {"1.0.0": NOW - 5, "3.0.0": NOW - 9})
    assert first_sightings(merged) == {"1.0.0": NOW - 5, "3.0.0": NOW - 9}
    # A bundle's later sighting does not move the proxy's own.
    assert first_sightings(with_carried(merged, {"1.0.0": NOW + 5 * HOUR}))["1.0.0"] == NOW - 5
    assert merged["fetched_at"] == NOW
    assert first_sightings(None) == {} and first_sightings({"versions": []}) == {}


async def test_a_version_without_a_release_time_is_not_looked_up_on_every_list(
        tmp_path: Path) -> None:
    """Upstream failing (or no platform served): the version counts as new, and the lists
    that show it do not each wait on the same failing lookup again within a minute."""
    clock = [NOW]
    asked: list[str] = []

    async def unsigned(_address: str, version: str) -> float | None:
        asked.append(version)
        raise Unavailable("upstream is down")

    async with serving(), AsyncExitStack() as opened:
        storage = await open_disk_storage(CacheConfig(dir=tmp_path / "cache"), Metrics(),
                                          opened)
        policy = VersionPolicy(POLICY, ReleaseTimes(storage.index, clock=lambda: clock[0]),
                               Metrics(), Activity(), clock=lambda: clock[0])
        policy.dated_by("provider", unsigned)
        target = "registry.terraform.io/hashicorp/beta"  # a 24 h cooldown
        for _ in range(3):
            assert await policy.visible("provider", target, target, ["1.0.0"]) == []
        assert asked == ["1.0.0"]
        clock[0] += 61
        await policy.visible("provider", target, target, ["1.0.0"])
        assert asked == ["1.0.0", "1.0.0"]  # tried again once the minute is over
