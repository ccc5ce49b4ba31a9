"""The `[auth]` table: static tokens (each with an optional `allow` list) and `[[auth.oidc]]`
identity providers whose rules say what each identity may pull. Every problem is collected,
as for the rest of the configuration (proxy.config.parser)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

from proxy.config.settings import AuthConfig, OidcProvider, OidcRule, Secret
from proxy.core.access import PULL_PATTERN

_TOKEN_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
_PROVIDER_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
_OIDC_KEYS = ("name", "issuer", "audience", "jwks_file", "jwks_url", "leeway", "rules")


class Fields(Protocol):
    """What the configuration's parser offers to read a table's fields with."""

    problems: list[str]

    def unknown(self, table: dict[str, Any], prefix: str, known: tuple[str, ...]) -> None:
        """Report keys of table not in known."""

    def number(self, where: str, table: dict[str, Any], key: str, default: float) -> float:
        """A non-negative number (or default)."""
        ...

    def path(self, where: str, table: dict[str, Any], key: str) -> Path | None:
        """A path (or None)."""
        ...


def parse_auth(table: dict[str, Any], fields: Fields) -> AuthConfig:
    """AuthConfig from the [auth] table (problems go to fields.problems)."""
    problems = fields.problems
    fields.unknown(table, "auth.", ("tokens", "tokens_file", "signed_url_ttl", "oidc"))
    named = _named_tokens(table.get("tokens", []), problems)
    tokens_file = fields.path("auth.tokens_file", table, "tokens_file")
    if tokens_file is not None:
        try:
            lines = tokens_file.read_text().splitlines()
        except OSError as exc:
            problems.append(f"auth.tokens_file: cannot read {str(tokens_file)!r}: "
                            f"{exc.strerror}")
            lines = []
        # "TOKEN" or "NAME TOKEN" (a token has no spaces).
        for line in lines:
            words = line.split()
            if words and not words[0].startswith("#"):
                named.append((words[0], words[-1], None) if len(words) == 2
                             else ("", line.strip(), None))
    for name, _token, _allow in named:
        if name and not _TOKEN_NAME.fullmatch(name):
            problems.append(f"auth.tokens: token name {name[:40]!r}: expected letters, "
                            "digits, '.', '_' or '-' (at most 64)")
            break
    for _name, token, _allow in named:
        if len(token) < 16 or not token.isprintable() or " " in token:
            problems.append("auth.tokens: every token must be at least 16 printable "
                            "characters without spaces")
            break
    ttl = fields.number("auth.signed_url_ttl", table, "signed_url_ttl",
                        AuthConfig().signed_url_ttl)
    return AuthConfig(tokens=tuple(Secret(token) for _name, token, _allow in named),
                      signed_url_ttl=ttl,
                      token_names=tuple(name for name, _token, _allow in named),
                      token_allow=tuple(allow for _name, _token, allow in named),
                      oidc=_providers(table.get("oidc", []), fields))


def _named_tokens(raw: object, problems: list[str]
                  ) -> list[tuple[str, str, tuple[str, ...] | None]]:
    """auth.tokens: strings, or {name = "...", token = "...", allow = [...]} tables; (name,
    token, allow) with "" for no name and None for no allow list (everything)."""
    named: list[tuple[str, str, tuple[str, ...] | None]] = []
    for entry in raw if isinstance(raw, list) else [None]:
        if isinstance(entry, str):
            named.append(("", entry, None))
        elif isinstance(entry, dict) and {"name", "token"} <= set(entry) <= \
                {"name", "token", "allow"} and isinstance(entry["name"], str) \
                and isinstance(entry["token"], str):
            allow = None
            if "allow" in entry:
                allow = _patterns(f"auth.tokens {entry['name'][:40]!r}: allow", entry["allow"],
                                  problems)
            named.append((entry["name"], entry["token"], allow))
        else:
            problems.append('auth.tokens: expected a list of tokens, each a string or '
                            '{ name = "...", token = "...", allow = [...] }')
            return []
    return named


def _patterns(where: str, raw: object, problems: list[str]) -> tuple[str, ...]:
    if not isinstance(raw, list) or not all(isinstance(p, str) for p in raw):
        problems.append(f"{where}: expected a list of patterns such as "
                        '"registry.terraform.io/hashicorp/*" or "releases/terraform"')
        return ()
    for pattern in raw:
        if not PULL_PATTERN.fullmatch(pattern):
            problems.append(f"{where}: {pattern[:80]!r} is not HOST/NAMESPACE/NAME (globs "
                            "allowed) nor releases/terraform or releases/opentofu")
    return tuple(raw)


def _providers(raw: object, fields: Fields) -> tuple[OidcProvider, ...]:
    problems = fields.problems
    if not isinstance(raw, list) or not all(isinstance(entry, dict) for entry in raw):
        problems.append("auth.oidc: expected [[auth.oidc]] tables")
        return ()
    providers = [provider for index, entry in enumerate(raw)
                 if (provider := _provider(index, entry, fields)) is not None]
    names = [provider.name for provider in providers]
    for name in sorted({name for name in names if names.count(name) > 1}):
        problems.append(f"auth.oidc: the name {name!r} is given to more than one provider")
    return tuple(providers)


def _provider(index: int, entry: dict[str, Any], fields: Fields) -> OidcProvider | None:
    problems = fields.problems
    where = f"auth.oidc[{index}]"
    fields.unknown(entry, f"{where}.", _OIDC_KEYS)
    name, issuer = entry.get("name"), entry.get("issuer")
    if not isinstance(name, str) or not _PROVIDER_NAME.fullmatch(name):
        problems.append(f"{where}.name: expected a short name (lower case letters, digits, "
                        "'-', '_'), shown in audit lines and metrics")
        return None
    where = f"auth.oidc {name!r}"
    if not isinstance(issuer, str) or urlsplit(issuer).scheme != "https":
        problems.append(f"{where}: issuer: expected the https URL tokens name in `iss`")
        return None
    audience = entry.get("audience")
    audiences = (audience,) if isinstance(audience, str) else audience
    if not isinstance(audiences, list | tuple) or not audiences \
            or not all(isinstance(a, str) and a for a in audiences):
        problems.append(f"{where}: audience: expected a string or a list of strings (what "
                        "tokens must name in `aud`)")
        return None
    jwks_file = fields.path(f"{where}: jwks_file", entry, "jwks_file")
    jwks_url = entry.get("jwks_url")
    if (jwks_file is None) == (jwks_url is None):
        problems.append(f"{where}: give exactly one of jwks_file (air-gapped: a file) and "
                        "jwks_url (fetched and cached)")
        return None
    if jwks_url is not None and (not isinstance(jwks_url, str)
                                 or urlsplit(jwks_url).scheme != "https"):
        problems.append(f"{where}: jwks_url: expected an https URL")
        return None
    if jwks_file is not None and not jwks_file.is_file():
        problems.append(f"{where}: jwks_file: no such file {str(jwks_file)!r}")
    leeway = fields.number(f"{where}: leeway", entry, "leeway", 60.0)
    rules = _rules(where, entry.get("rules"), fields)
    return OidcProvider(name=name, issuer=issuer, audiences=tuple(audiences),
                        jwks_file=jwks_file, jwks_url=jwks_url, leeway=leeway, rules=rules)


def _rules(where: str, raw: object, fields: Fields) -> tuple[OidcRule, ...]:
    problems = fields.problems
    if not isinstance(raw, list) or not raw or not all(isinstance(r, dict) for r in raw):
        problems.append(f"{where}: expected at least one [[auth.oidc.rules]] table (claims "
                        "to match, and what a matching token may pull)")
        return ()
    rules = []
    for number, rule in enumerate(raw, 1):
        at = f"{where} rule {number}"
        fields.unknown(rule, f"{at}.", ("claims", "allow"))
        claims = rule.get("claims", {})
        if not isinstance(claims, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in claims.items()):
            problems.append(f"{at}: claims: expected a table of claim = \"glob\"")
            claims = {}
        rules.append(OidcRule(claims=dict(claims),
                              allow=_patterns(f"{at}: allow", rule.get("allow"), problems)))
    return tuple(rules)
