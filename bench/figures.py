"""A figure: the proxy's value and its reference's, measured in the same run, once per run;
the ratio of the two; and the issue's target, on that ratio or on the proxy's own value."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class Target:
    """What a figure must meet: `ratio` (proxy / reference) or `proxy` (its own value) compared
    with bound by op. Judged on the median over runs."""

    on: Literal["ratio", "proxy"]
    op: Literal[">=", "<=", "=="]
    bound: float

    def met(self, value: float) -> bool:
        if self.op == ">=":
            return value >= self.bound
        if self.op == "<=":
            return value <= self.bound
        return value == self.bound


@dataclass
class Figure:
    """One row of the results table."""

    group: str  # json, archive, cold, herd, rss, terraform
    name: str
    unit: str  # of the absolute values: req/s, ms, MB/s, s/GB, s, MiB, "" (a count)
    reference_name: str = ""  # floor, nginx, direct; "" when the figure has no reference
    target: Target | None = None
    proxy: list[float] = field(default_factory=list)
    reference: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, proxy: float, reference: float | None = None) -> None:
        """One run's values."""
        self.proxy.append(proxy)
        if reference is not None:
            self.reference.append(reference)

    @property
    def ratios(self) -> list[float]:
        """proxy / reference per run; none for a figure without a reference."""
        if not self.reference:
            return []
        return [p / r for p, r in zip(self.proxy, self.reference, strict=True) if r]

    def judged(self) -> float | None:
        """The value the target is judged on (median over runs), None if nothing measured."""
        if self.target is None:
            return None
        values = self.ratios if self.target.on == "ratio" else self.proxy
        return statistics.median(values) if values else None

    def met(self) -> bool | None:
        """Whether the target is met; None when there is no target or no value."""
        value = self.judged()
        return None if value is None or self.target is None else self.target.met(value)

    def target_text(self) -> str:
        if self.target is None:
            return ""
        bound = f"{self.target.bound:g}"
        if self.target.on == "ratio":
            return f"{self.target.op} {bound} x {self.reference_name}"
        return f"{self.target.op} {bound} {self.unit}".rstrip()


def number(value: float) -> str:
    """A value with as many digits as it deserves."""
    if value == int(value) and abs(value) < 1e6:
        return f"{int(value):,}"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    if abs(value) >= 1:
        return f"{value:.2f}"
    return f"{value:.2g}"  # 0.8, 0.47, 0.0012: two significant digits


def spread(values: list[float], unit: str = "") -> str:
    """median, and (min - max) when there were several runs."""
    if not values:
        return ""
    text = number(statistics.median(values))
    if len(values) > 1:
        text += f" ({number(min(values))} - {number(max(values))})"
    return f"{text} {unit}".rstrip()
