"""Who is asking, and what they may pull: the identity a request authenticated as (a static
token of `auth.tokens`, or an OIDC token verified against `auth.oidc`) with the `allow`
patterns of the rule that admitted it. Patterns are globs over `HOST/NAMESPACE/NAME` (a
provider's type, a module's name: a module's target system is not matched) and
`releases/terraform`, `releases/opentofu` for the CLI releases. Pure: no I/O."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

# The `method` label of tfproxy_auth_total, and of an identity.
METHODS = ("token", "oidc", "signed_url", "issued")
# The `result` label of tfproxy_auth_total.
RESULTS = ("ok", "missing", "invalid", "expired", "forbidden")
# Why the version policy refused a version: the `reason` label of
# tfproxy_policy_refusals_total.
REFUSAL_KINDS = ("cooldown", "deny")


# What an allow pattern, or a policy entry's match, may be: a HOST/NAMESPACE/NAME glob, or
# releases/PRODUCT (matched against pull_target).
PULL_PATTERN = re.compile(r"[A-Za-z0-9._:*?\[\]-]+(/[A-Za-z0-9._*?\[\]-]+){2}|releases/[a-z*?]+")


def pull_target(kind: str, host: str, namespace: str, name: str) -> str:
    """What allow patterns are matched against for an artifact: `HOST/NAMESPACE/NAME` for
    providers and modules, `releases/PRODUCT` for a CLI (kind "cli", name the product)."""
    if kind == "cli":
        return f"releases/{name}".lower()
    return f"{host}/{namespace}/{name}".lower()


def allows(patterns: tuple[str, ...], target: str) -> bool:
    """Whether any pattern (a glob, without regard to case) matches target."""
    lowered = target.lower()
    return any(fnmatch.fnmatchcase(lowered, pattern.lower()) for pattern in patterns)


@dataclass(frozen=True)
class Identity:
    """A request's authenticated identity. allow None: everything may be pulled."""

    name: str  # what audit lines, signed URLs and the status page call it (never a secret)
    method: str  # one of METHODS
    rules: str  # the rule set that admitted it, as refusals name it
    allow: tuple[str, ...] | None = None
    issuer: str | None = None  # OIDC: the token's issuer and subject
    subject: str | None = None
    claims: Mapping[str, str] = field(default_factory=dict)  # the claims its rule matched
    expires_at: float | None = None  # epoch seconds (OIDC: the token's exp)

    def may_pull(self, target: str) -> bool:
        """Whether this identity may pull target (see pull_target)."""
        return self.allow is None or allows(self.allow, target)

    def audit_details(self) -> dict[str, object] | None:
        """What an audit line says of it beyond its name: the issuer, subject and matched
        claims of an OIDC identity (never the token); None for a static token."""
        if self.method != "oidc":
            return None
        return {"method": self.method, "provider": self.rules, "issuer": self.issuer,
                "subject": self.subject, "claims": dict(self.claims)}
