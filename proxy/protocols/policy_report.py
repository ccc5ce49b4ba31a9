"""`policy check`'s findings: for every provider, module and CLI product the cache holds a
version list or sightings of (or those the addresses given select), which versions the
version policy hides, why, and from when they will be served. Judged by the same
VersionPolicy the server runs, with the release times the store holds (the verified
signatures over SHA256SUMS, the sightings): nothing is asked of upstream."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from proxy.config.policy import Verdict
from proxy.core.access import allows, pull_target
from proxy.core.errors import BadRequest
from proxy.core.models import ModuleAddress, ProviderAddress
from proxy.protocols.version_policy import (
    VersionPolicy,
    module_target,
    newest_first,
    provider_target,
)
from proxy.store import layout
from proxy.store.protocol import MetadataIndex
from proxy.verification.releases import VerifiedRelease
from proxy.verification.signatures import signature_time


@dataclass(frozen=True)
class Checked:
    """One address: every version known, and the verdict on each the policy hides."""

    kind: str  # provider, module, cli
    address: str  # as the artifact is named (a module's with its system)
    target: str  # as the policy matches it
    versions: tuple[str, ...]  # newest first
    hidden: tuple[tuple[str, Verdict], ...]


class PolicyReport:
    """The policy's verdicts on what a store holds."""

    def __init__(self, index: MetadataIndex, policy: VersionPolicy) -> None:
        self._index = index
        self._policy = policy
        policy.dated_by("provider", self._provider_signed_at)
        policy.dated_by("cli", self._release_signed_at)

    async def check(self, selected: Sequence[str] = ()) -> list[Checked]:
        """Every address held (those matching one of selected, when given), sorted."""
        found = []
        for kind, address, target in sorted(await self._addresses()):
            if selected and not allows(tuple(selected), target) and \
                    not allows(tuple(selected), address):
                continue
            versions = sorted(await self._versions(kind, address), key=newest_first,
                              reverse=True)
            hidden = []
            for version in versions:
                verdict = await self._policy.verdict(kind, address, target, version)
                if not verdict.served:
                    hidden.append((version, verdict))
            found.append(Checked(kind, address, target, tuple(versions), tuple(hidden)))
        return found

    async def _addresses(self) -> set[tuple[str, str, str]]:
        """(kind, address, target) of every version list and sightings record held."""
        found: set[tuple[str, str, str]] = set()
        for prefix, kind in (("versions/", "provider"), ("module-versions/", "module"),
                             ("release-versions/", "cli")):
            for key in await self._index.keys(prefix):
                named = _named(kind, key.removeprefix(prefix))
                if named is not None:
                    found.add(named)
        for key in await self._index.keys(layout.SIGHTINGS_RECORDS):
            kind, _, address = key.removeprefix(layout.SIGHTINGS_RECORDS).partition("/")
            named = _named(kind, address)
            if named is not None:
                found.add(named)
        return found

    async def _versions(self, kind: str, address: str) -> set[str]:
        """The versions of the list held, and those ever seen in upstream's list."""
        key = {"provider": "versions/", "module": "module-versions/",
               "cli": "release-versions/"}[kind] + address
        record = await self._index.get(key)
        listed = record.get("value") if isinstance(record, dict) else None
        versions = set(await self._policy.times.sightings(kind, address))
        if isinstance(listed, dict):  # the CLI releases: version -> files
            versions.update(str(version) for version in listed)
        elif isinstance(listed, list):  # providers' entries, modules' versions
            versions.update(str(entry["version"]) if isinstance(entry, dict) else str(entry)
                            for entry in listed
                            if isinstance(entry, str) or (isinstance(entry, dict)
                                                          and "version" in entry))
        return versions

    async def _provider_signed_at(self, address: str, version: str) -> float | None:
        """The creation time of the held, verified signature over the version's SHA256SUMS."""
        for key in sorted(await self._index.keys(f"sums/{address}/{version}/")):
            record = await self._index.get(key)
            if isinstance(record, dict) and record.get("signature"):
                return signature_time(bytes(record["signature"]))
        return None

    async def _release_signed_at(self, product: str, version: str) -> float | None:
        """The newest of the held, verified signatures over the release's SHA256SUMS."""
        record = await self._index.get(layout.release_record(product, version))
        if record is None:
            return None
        try:
            release = VerifiedRelease.from_record(product, version, record)
        except (ValueError, KeyError, TypeError):
            return None
        times = [t for t in (signature_time(s) for s in release.signatures.values()) if t]
        return max(times, default=None)


def _named(kind: str, address: str) -> tuple[str, str, str] | None:
    """(kind, address, target) for a record's address; None for one that is not valid."""
    parts = address.split("/")
    try:
        if kind == "provider" and len(parts) == 3:
            provider = ProviderAddress.parse(*parts)
            return kind, str(provider), provider_target(provider)
        if kind == "module" and len(parts) == 4:
            module = ModuleAddress.parse(*parts)
            return kind, str(module), module_target(module)
    except BadRequest:
        return None
    if kind == "cli" and len(parts) == 1 and parts[0] in ("terraform", "opentofu"):
        return kind, parts[0], pull_target("cli", "", "", parts[0])
    return None

