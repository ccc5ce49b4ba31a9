"""SIGHUP's second job (the first: reopen the audit log): put the `[policy]` of the
configuration file in force again, without a restart. A file that does not load keeps the
policy in force, and says why; other changes to the file wait for a restart."""

from __future__ import annotations

import logging
from dataclasses import replace

from proxy.config import Config, ConfigError, load_config
from proxy.protocols.version_policy import VersionPolicy

log = logging.getLogger(__name__)


def reload_policy(config: Config, policy: VersionPolicy) -> None:
    """Read config's file again and put its [policy] in force (or keep the old one)."""
    if config.source is None:
        log.info("SIGHUP: no configuration file to read the version policy from; "
                 "it stays as it is")
        return
    try:
        fresh = load_config(config.source)
    except ConfigError as exc:
        log.error("SIGHUP: %s does not load, the version policy in force stays: %s",
                  config.source, "; ".join(exc.problems))
        return
    if replace(fresh, policy=config.policy) != config:
        log.warning("SIGHUP: only [policy] is reloaded; the other changes in %s take effect "
                    "at the next restart", config.source)
    policy.reload(fresh.policy)
