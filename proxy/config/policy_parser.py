"""The `[policy]` table: a cooldown (`min_release_age`, with more specific `[[policy.rules]]`),
`[[policy.deny]]` and `[[policy.allow]]` entries. Every problem is collected, as for the rest
of the configuration; `serve` reads it again on SIGHUP (proxy.cli.server)."""

from __future__ import annotations

from typing import Any

from proxy.config.settings import PolicyConfig, PolicyException, PolicyRule, parse_duration
from proxy.core.access import PULL_PATTERN
from proxy.core.constraints import parse_constraint

_KEYS = ("min_release_age", "rules", "deny", "allow")


def parse_policy(table: dict[str, Any], problems: list[str]) -> PolicyConfig:
    """PolicyConfig from the [policy] table (problems appended)."""
    unknown = sorted(set(table) - set(_KEYS))
    for key in unknown:
        problems.append(f"policy.{key}: unknown key ({', '.join(_KEYS)})")
    default = _age("policy.min_release_age", table.get("min_release_age", 0), problems)
    rules = tuple(PolicyRule(match, _age(f"{where}.min_release_age",
                                         entry.get("min_release_age", default), problems))
                  for where, entry, match in _entries("rules", table, problems,
                                                      ("match", "min_release_age")))
    return PolicyConfig(min_release_age=default, rules=rules,
                        deny=_exceptions("deny", table, problems),
                        allow=_exceptions("allow", table, problems))


def _age(where: str, value: object, problems: list[str]) -> float:
    found = parse_duration(value)
    if found is None:
        problems.append(f"{where}: expected a duration such as \"72h\", \"30m\", \"7d\" or "
                        f"\"0\" (off), got {str(value)[:40]!r}")
        return 0.0
    return found


def _entries(name: str, table: dict[str, Any], problems: list[str],
             keys: tuple[str, ...]) -> list[tuple[str, dict[str, Any], str]]:
    """The tables of [[policy.NAME]] whose `match` is valid: (where, table, match)."""
    raw = table.get(name, [])
    if not isinstance(raw, list) or not all(isinstance(entry, dict) for entry in raw):
        problems.append(f"policy.{name}: expected [[policy.{name}]] tables")
        return []
    found = []
    for index, entry in enumerate(raw):
        where = f"policy.{name}[{index}]"
        for key in sorted(set(entry) - set(keys)):
            problems.append(f"{where}.{key}: unknown key ({', '.join(keys)})")
        match = entry.get("match")
        if not isinstance(match, str) or not PULL_PATTERN.fullmatch(match):
            problems.append(f"{where}.match: expected HOST/NAMESPACE/NAME (globs allowed), or "
                            "releases/terraform or releases/opentofu")
            continue
        found.append((where, entry, match))
    return found


def _exceptions(name: str, table: dict[str, Any],
                problems: list[str]) -> tuple[PolicyException, ...]:
    exceptions = []
    for where, entry, match in _entries(name, table, problems, ("match", "versions", "reason")):
        versions = entry.get("versions")
        if versions is not None:
            try:
                if not isinstance(versions, str) or not parse_constraint(versions):
                    raise ValueError(versions)
            except ValueError:
                problems.append(f"{where}.versions: expected a Terraform version constraint "
                                f"such as \">= 1.1.0, < 1.1.3\", got {str(versions)[:60]!r}")
                continue
        reason = entry.get("reason", "")
        if not isinstance(reason, str):
            problems.append(f"{where}.reason: expected a string")
            reason = ""
        exceptions.append(PolicyException(match, versions, reason))
    return tuple(exceptions)
