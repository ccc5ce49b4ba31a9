"""Version constraints as Terraform reads them."""

from __future__ import annotations

import pytest

from proxy.core.constraints import newest_matching, parse_constraint

VERSIONS = ["1.0.0", "1.2.0", "1.2.5", "1.3.0", "2.0.0", "2.1.0-beta.1", "5.0.1", "5.9.0"]


@pytest.mark.parametrize(("constraint", "expected"), [
    ("", "5.9.0"), ("1.2.0", "1.2.0"), ("= 1.2.5", "1.2.5"), ("~> 1.2", "1.3.0"),
    ("~> 1.2.0", "1.2.5"), ("~> 5.0", "5.9.0"), (">= 1.0, < 2.0", "1.3.0"),
    ("!= 5.9.0, > 5.0.0", "5.0.1"), ("> 9.0", None), ("2.1.0-beta.1", "2.1.0-beta.1"),
    (">= 2.0.0", "5.9.0"), ("<= 1.2.5", "1.2.5"),
])
def test_newest_matching_picks_the_highest_allowed_version(constraint: str,
                                                           expected: str | None) -> None:
    assert newest_matching(VERSIONS, constraint) == expected


@pytest.mark.parametrize("bad", ["about 5", ">= 1.2.3abc", "~> 1.x", "~> 1..2", "=> 1.0",
                                 ">= 1\u0663"])  # the last: a Unicode digit
def test_malformed_constraint_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        parse_constraint(bad)


def test_pre_releases_compare_by_identifier() -> None:
    versions = ["2.1.0-beta.2", "2.1.0-beta.10"]
    assert newest_matching(versions, ">= 2.1.0-beta.2, = 2.1.0-beta.10") == "2.1.0-beta.10"
