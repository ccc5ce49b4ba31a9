"""Reading samples out of the proxy's /metrics (Prometheus text exposition)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def sample(exposition: str, name: str, **labels: str) -> float | None:
    """One sample, matched on its name and exactly these labels; None when it is not there
    (so a comparison cannot pass by accident once a series disappears or is renamed)."""
    for family in text_string_to_metric_families(exposition):
        for found in family.samples:
            if found.name == name and found.labels == labels:
                return float(found.value)
    return None


def declared(exposition: str, family: str) -> bool:
    """Whether the exposition declares the metric family (its # TYPE line), samples or not."""
    return any(line.startswith(f"# TYPE {family} ") for line in exposition.splitlines())


def total(exposition: str, name: str, **labels: str) -> float | None:
    """The sum of the samples of name whose labels include these; None when there is none
    (so a comparison cannot pass by accident once the series disappear)."""
    found = [s.value for family in text_string_to_metric_families(exposition)
             for s in family.samples
             if s.name == name and labels.items() <= s.labels.items()]
    return float(sum(found)) if found else None
