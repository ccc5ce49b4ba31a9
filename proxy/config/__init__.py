"""Configuration loading: TOML (tomllib) plus environment overrides, into the typed frozen
dataclasses of proxy.config.settings (the common ones re-exported here). Every problem is
collected and reported at once, each with its key's name. No file at all means the built-in
defaults.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from proxy.config.parser import parse_tables
from proxy.config.settings import (
    CONFIG_ENV,
    ENV_KEYS,
    ENV_PREFIX,
    KNOWN_SERVICES,
    Config,
    ConfigError,
    FiltersConfig,
    Secret,
    ServerConfig,
    UpstreamConfig,
    default_cache_dir,
    default_state_dir,
    parse_size,
)
from proxy.core.errors import BadRequest
from proxy.core.models import normalize_hostname

# What callers take from proxy.config; the rest is imported from proxy.config.settings.
__all__ = ["CONFIG_ENV", "KNOWN_SERVICES", "Config", "ConfigError", "FiltersConfig", "Secret",
           "ServerConfig", "UpstreamConfig", "default_cache_dir", "default_state_dir",
           "load_config", "parse_size"]


def load_config(path: Path | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Read the TOML file (or none: defaults), apply environment overrides, validate all."""
    env = os.environ if environ is None else environ
    if path is None and env.get(CONFIG_ENV):
        path = Path(env[CONFIG_ENV])
    raw: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as handle:
                raw = tomllib.load(handle)
        except OSError as exc:
            raise ConfigError([f"cannot read config file {path}: {exc.strerror}"]) from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError([f"{path}: invalid TOML: {exc}"]) from None
    env_problems = _apply_env(raw, env)

    config = parse_tables(raw, env_problems)
    return replace(_with_env_tokens(config, env), source=path)


def _with_env_tokens(config: Config, env: Mapping[str, str]) -> Config:
    """TF_TOKEN_<host> variables, named as Terraform names them ("." as "_", "-" as "__").
    A token does not make its host allowed."""
    tokens: dict[str, Secret] = {}
    for name, value in env.items():
        if not name.upper().startswith("TF_TOKEN_") or not value:
            continue
        encoded = name[len("TF_TOKEN_"):]
        try:
            hostname = normalize_hostname(encoded.replace("__", "-").replace("_", "."))
        except BadRequest:
            continue  # not a hostname; Terraform ignores such variables too
        tokens[hostname] = Secret(value)
    if not tokens:
        return config
    return replace(config, upstream=replace(config.upstream, tokens=tokens))


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> list[str]:
    """Apply TF_REGISTRY_PROXY_<TABLE>_<KEY> overrides; returns problems for unknown ones."""
    known = {CONFIG_ENV}
    for section, keys in ENV_KEYS.items():
        for key in keys:
            name = f"{ENV_PREFIX}{section.replace('.', '_')}_{key}".upper()
            known.add(name)
            value = env.get(name)
            if value is not None:
                table: Any = raw
                for part in section.split("."):
                    table = table.setdefault(part, {}) if isinstance(table, dict) else None
                if isinstance(table, dict):
                    table[key] = value
    return [f"{name}: unknown environment setting (known: TF_REGISTRY_PROXY_<TABLE>_<KEY> "
            "for the scalar keys of config.example.toml)"
            for name in sorted(env) if name.startswith(ENV_PREFIX) and name not in known]
