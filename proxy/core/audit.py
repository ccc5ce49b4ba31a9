"""The audit log: one JSON line per package or module served, fetched, imported, exported or
refused, appended to a file (or stdout) that several processes share.

Each line is written with ONE os.write on a descriptor opened with O_APPEND: the kernel
appends it whole, so lines of several worker processes never interleave. The write happens
on the caller's thread (the event loop): a line is a few hundred bytes into the page cache,
and a queue with a writer thread would only reorder lines and lose the last ones on a crash.
reopen() (on SIGHUP) opens the path again, so that the operator's log rotation (rename, then
signal) makes the next line land in a new file. No aiohttp here: the web layer supplies who
asked through REQUESTER."""

from __future__ import annotations

import contextvars
import getpass
import json
import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from proxy.core.errors import (
    FilteredOut,
    Forbidden,
    HostNotServed,
    InsufficientStorage,
    IntegrityError,
    Offline,
    ProxyError,
    Unauthorized,
    Unavailable,
    UnknownVersion,
    UpstreamError,
    UpstreamTimeout,
)
from proxy.core.log_limits import RateLimitedLog
from proxy.core.models import ModuleAddress, Platform, ProviderAddress
from proxy.core.redaction import mask_secrets

log = logging.getLogger(__name__)
STDOUT = "-"
_MODE = 0o640  # the log names clients and tokens: not for every local user


@dataclass(frozen=True)
class Requester:
    """Who asked: the client's address and the name of the token it authenticated with
    (never the token itself); both None for a local command."""

    client: str | None = None
    token: str | None = None
    # An OIDC identity's issuer, subject and the claims its rule matched (never the token).
    identity: Mapping[str, object] | None = None


# The requester of the work under way; a fill started by a request carries its first
# requester along (tasks copy the context they are created in).
REQUESTER: contextvars.ContextVar[Requester | None] = contextvars.ContextVar(
    "audit_requester", default=None)


@dataclass
class ServedFacts:
    """What the service knows about the archive a request is answered with (the protocol
    layer fills it in), for that request's `served` line."""

    sha256: str | None = None
    key_id: str | None = None
    # The archive whole, where the request's path names it only in part (an OCI blob is
    # named by its digest).
    artifact: Artifact | None = None


# Set per request by the web layer only while the audit log is on: the service reads the
# facts of what it serves (an index read on a hit) only when someone will write them down.
SERVED_FACTS: contextvars.ContextVar[ServedFacts | None] = contextvars.ContextVar(
    "audit_served_facts", default=None)


@dataclass(frozen=True)
class Artifact:
    """What a line is about: a provider (package) or a registry module, as far as known."""

    kind: str  # "provider", "module" or "cli"
    host: str
    namespace: str
    name: str  # the provider's type or the module's name
    version: str | None = None
    os: str | None = None
    arch: str | None = None
    system: str | None = None  # modules only

    @classmethod
    def provider(cls, address: ProviderAddress, version: str | None = None,
                 platform: Platform | None = None) -> Artifact:
        """A provider, one of its versions, or one package of it."""
        return cls("provider", address.hostname, address.namespace, address.type, version,
                   platform.os if platform else None, platform.arch if platform else None)

    @classmethod
    def module(cls, address: ModuleAddress, version: str | None = None) -> Artifact:
        """A registry module, or one version of it."""
        return cls("module", address.hostname, address.namespace, address.name, version,
                   system=address.system)

    @classmethod
    def release(cls, product: str, version: str | None = None,
                platform_key: str | None = None) -> Artifact:
        """A CLI (terraform, opentofu), one of its releases, or one archive of it."""
        os, _, arch = (platform_key or "").partition("_")
        return cls("cli", "", "", product, version, os or None, arch or None)

    def label(self) -> str:
        """As operators read it: `provider HOST/NS/TYPE VERSION OS_ARCH`, `module
        HOST/NS/NAME/SYSTEM VERSION`, `cli terraform VERSION OS_ARCH` (as far as known)."""
        address = f"{self.host}/{self.namespace}/{self.name}" if self.host else self.name
        if self.system is not None:
            address += f"/{self.system}"
        parts = [self.kind, address, self.version,
                 f"{self.os}_{self.arch}" if self.os and self.arch else None]
        return " ".join(part for part in parts if part)

    def fields(self) -> dict[str, str]:
        """The identity fields of a line (those that are known)."""
        named = {"kind": self.kind, "host": self.host, "namespace": self.namespace,
                 "type" if self.kind == "provider" else "name": self.name,
                 "version": self.version, "os": self.os, "arch": self.arch,
                 "system": self.system}
        return {key: value for key, value in named.items() if value}


def refusal(exc: ProxyError) -> str:
    """The outcome of a refused request, one bounded word per cause (the reason field says
    the rest)."""
    said = exc.audit_outcome()
    if said is not None:
        return said
    for kind, outcome in ((HostNotServed, "host_not_allowed"), (FilteredOut, "filtered"),
                          (Offline, "offline"),
                          (UnknownVersion, "unknown_version"), (IntegrityError, "integrity"),
                          (UpstreamTimeout, "upstream_timeout"),
                          (UpstreamError, "upstream_error"),
                          (InsufficientStorage, "no_space"), (Unavailable, "unavailable"),
                          (Unauthorized, "unauthorized"), (Forbidden, "forbidden")):
        if isinstance(exc, kind):
            return outcome
    return {404: "not_found", 400: "bad_request"}.get(exc.status, "error")


def key_id(fingerprint: str | None) -> str | None:
    """The 16-hex-digit OpenPGP key ID of a (v4) fingerprint, upper case; None for none."""
    return fingerprint[-16:].upper() if fingerprint else None


class AuditLog:
    """Where audit lines go: a file path, "-" for stdout, or None (off: record() does
    nothing)."""

    def __init__(self, target: str | None) -> None:
        self.target = target
        self._fd: int | None = None
        self._lock = threading.Lock()  # reopen() against a write from another thread
        self._failures = RateLimitedLog(log, level=logging.ERROR)

    @property
    def enabled(self) -> bool:
        """Whether lines are written at all."""
        return self.target is not None

    def open(self) -> None:
        """Open the target (appending; created 0640 if missing). Raises OSError."""
        if self.target is None or self._fd is not None:
            return
        self._fd = 1 if self.target == STDOUT else os.open(
            self.target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, _MODE)

    def reopen(self) -> None:
        """Open the path again (after the operator renamed the file: SIGHUP); lines go on
        to the old descriptor if it cannot be opened."""
        if self.target is None or self.target == STDOUT:
            return
        try:
            fresh = os.open(self.target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC,
                            _MODE)
        except OSError as exc:
            log.error("cannot reopen the audit log %s: %s; still writing to the old file",
                      self.target, exc.strerror)
            return
        with self._lock:
            old, self._fd = self._fd, fresh
        if old is not None:
            os.close(old)
        log.info("reopened the audit log %s", self.target)

    def close(self) -> None:
        """Close the file (stdout stays open)."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None and fd != 1:
            os.close(fd)

    def record(self, event: str, artifact: Artifact, *, outcome: str = "ok",
               requester: Requester | None = None, **details: Any) -> None:
        """Append one line: event (served, fetched, imported, exported, refused) about
        artifact, by requester (default: the one of the work under way), with details such
        as reason, status, bytes, cache, upstream_url (masked here), sha256, key_id. None
        values are left out."""
        if self.target is None:
            return
        who = requester or REQUESTER.get() or Requester()
        line: dict[str, Any] = {
            "time": datetime.now(UTC).isoformat(timespec="milliseconds").replace(
                "+00:00", "Z"),
            "event": event, "client": who.client, "token": who.token,
            **({"identity": dict(who.identity)} if who.identity else {}),
            **artifact.fields(), "outcome": outcome}
        for key, value in details.items():
            if value is not None:
                line[key] = mask_secrets(value) if isinstance(value, str) else value
        self._write((json.dumps(line, separators=(",", ":")) + "\n").encode())

    def _write(self, data: bytes) -> None:
        with self._lock:
            if self._fd is None:
                return
            try:
                os.write(self._fd, data)  # one write: appended whole (O_APPEND)
            except OSError as exc:  # a full disk must not fail the request it records
                self._failures.log("cannot write to the audit log %s: %s", self.target,
                                   exc.strerror)


NO_AUDIT = AuditLog(None)


def local_user() -> str | None:
    """The name of the user running this process, if the system knows it."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):
        return None
