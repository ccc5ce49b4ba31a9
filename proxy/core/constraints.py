"""Terraform version constraints ("~> 5.0", ">= 1.2, < 2.0", "1.2.0"): pick versions. Pure."""

from __future__ import annotations

import re
from collections.abc import Iterable

from proxy.core.digits import is_decimal

_CONSTRAINT = re.compile(
    r"^\s*(=|!=|>=|<=|>|<|~>)?\s*v?(\d+(?:\.\d+){0,3}(?:-[0-9A-Za-z.-]+)?(?:\+[0-9A-Za-z.-]+)?)\s*$",
    re.ASCII)


def _parts(version: str) -> tuple[tuple[int, ...], str]:
    """(numbers padded to three, pre-release) of a version; build metadata ignored."""
    core = version.lstrip("v").split("+", 1)[0]
    numbers, _, pre = core.partition("-")
    values = tuple(int(n) for n in numbers.split(".") if is_decimal(n))
    return (*values, 0, 0, 0)[:max(3, len(values))], pre


def _key(version: str) -> tuple[tuple[int, ...], int, tuple[tuple[int, int | str], ...]]:
    numbers, pre = _parts(version)
    # Pre-release identifiers compare numerically where numeric (beta.10 after beta.2).
    idents = tuple((0, int(p)) if is_decimal(p) else (1, p) for p in pre.split(".")) if pre \
        else ()
    return numbers, 0 if pre else 1, idents


def _satisfies(version: str, op: str, wanted: str) -> bool:
    have, want = _key(version), _key(wanted)
    if op in ("", "="):
        return have == want
    if op == "!=":
        return have != want
    if op == ">":
        return have > want
    if op == ">=":
        return have >= want
    if op == "<":
        return have < want
    if op == "<=":
        return have <= want
    # "~>": only the rightmost given part may grow.
    given = [int(n) for n in wanted.lstrip("v").split("-")[0].split("+")[0].split(".")]
    if have < want:
        return False
    prefix = given[:-1] if len(given) > 1 else given
    return list(_parts(version)[0][:len(prefix)]) == prefix


def parse_constraint(text: str) -> list[tuple[str, str]]:
    """The (operator, version) pairs of a constraint string; ValueError when malformed."""
    pairs = []
    for piece in text.split(","):
        if not piece.strip():
            continue
        match = _CONSTRAINT.match(piece)
        if not match:
            raise ValueError(f"invalid version constraint {text!r}")
        pairs.append((match.group(1) or "=", match.group(2)))
    return pairs


def newest_matching(versions: Iterable[str], constraint: str) -> str | None:
    """The newest version that meets the constraint (an empty one: the newest release).
    Pre-releases are chosen only when named exactly, as Terraform does."""
    pairs = parse_constraint(constraint)
    exact = {v for op, v in pairs if op == "="}
    candidates = [v for v in versions
                  if all(_satisfies(v, op, w) for op, w in pairs)
                  and (not _parts(v)[1] or v in exact)]
    return max(candidates, key=_key, default=None)


def satisfies(version: str, constraint: str) -> bool:
    """Whether version meets every part of the constraint (pre-releases included: a policy
    rule about a range covers its pre-releases too)."""
    return all(_satisfies(version, op, wanted) for op, wanted in parse_constraint(constraint))
