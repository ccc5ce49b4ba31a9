"""`keys export`: the registry signing keys the cache holds, per provider namespace, for the
operator to review and to hand to `import --trusted-keys` on the air-gapped side.

Where they are: a verified package's record keeps upstream's download document, whose
`signing_keys.gpg_public_keys` are the keys its SHA256SUMS signature was checked with; the
SHA256SUMS record names the key that did sign (`signed_by`). The cache is only read (safe
while the proxy runs)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pysequoia
from botocore.exceptions import BotoCoreError, ClientError

from proxy.airgap.manifest import BundleError
from proxy.app import open_for_commands
from proxy.config.settings import Config
from proxy.core.errors import ProxyError
from proxy.core.models import ProviderAddress
from proxy.store import layout
from proxy.store.disk import index_dir
from proxy.store.index import MetadataCache
from proxy.store.protocol import MetadataIndex
from proxy.verification.signatures import key_id_of

INDEX_FILE = "keys.json"
_MAX_KEYS = 16  # per document, as a live fill reads them


@dataclass
class HeldKey:
    """One signing key as the cache holds it, and what it vouches for."""

    key_id: str
    fingerprint: str
    armor: str
    providers: set[str] = field(default_factory=set)  # that list it
    signed: set[str] = field(default_factory=set)  # "type version" whose SHA256SUMS it signed

    def summary(self) -> dict[str, Any]:
        """What keys.json says about it."""
        return {"key_id": self.key_id, "fingerprint": self.fingerprint,
                "providers": sorted(self.providers), "signed": sorted(self.signed)}


# Per namespace ("host/namespace"), its keys by fingerprint.
HeldKeys = dict[str, dict[str, HeldKey]]


def held_keys(config: Config) -> HeldKeys:
    """Every signing key recorded with a verified package, per provider namespace;
    BundleError if the cache cannot be read."""
    try:
        return asyncio.run(_read(config))
    except (ProxyError, OSError, sqlite3.Error, BotoCoreError, ClientError) as exc:
        reason = exc.message if isinstance(exc, ProxyError) else repr(exc)[:300]
        raise BundleError(f"cannot read the cache: {reason}") from None


async def _read(config: Config) -> HeldKeys:
    if config.cache.s3 is None:  # the index alone: nothing else of the cache is touched
        directory = index_dir(config.cache.dir)
        if not directory.is_dir():
            return {}
        index = MetadataCache(directory)
        try:
            return await _collect(index)
        finally:
            index.close()
    async with AsyncExitStack() as opened:
        storage = await open_for_commands(config, opened)
        return await _collect(storage.index)


async def _collect(index: MetadataIndex) -> HeldKeys:
    found: HeldKeys = {}
    for record_key in await index.keys(layout.PACKAGE_RECORDS):
        named = layout.parse_package_record(record_key)
        record = await index.get(record_key) if named is not None else None
        if named is None or not isinstance(record, dict):
            continue
        provider, version, _platform = named
        keys = found.setdefault(f"{provider.hostname}/{provider.namespace}", {})
        for armor in _armored_keys(record.get("document")):
            try:
                cert = pysequoia.Cert.from_bytes(armor.encode())
            except Exception:  # not a key: a live fill skipped it too
                continue
            fingerprint = str(cert.fingerprint).upper()
            held = keys.setdefault(fingerprint, HeldKey(key_id_of(cert), fingerprint,
                                                        str(cert)))
            held.providers.add(str(provider))
        signer = await _signer(index, provider, version, record.get("sums_id"))
        if signer is not None and signer in keys:
            keys[signer].signed.add(f"{provider.type} {version}")
    return {namespace: keys for namespace, keys in sorted(found.items()) if keys}


def _armored_keys(document: object) -> list[str]:
    block = document.get("signing_keys") if isinstance(document, dict) else None
    listed = block.get("gpg_public_keys") if isinstance(block, dict) else None
    if not isinstance(listed, list):
        return []
    return [key["ascii_armor"] for key in listed[:_MAX_KEYS]
            if isinstance(key, dict) and isinstance(key.get("ascii_armor"), str)]


async def _signer(index: MetadataIndex, provider: ProviderAddress, version: str,
                  sums_id: object) -> str | None:
    if not isinstance(sums_id, str):
        return None
    record = await index.get(layout.sums_record(provider, version, sums_id))
    signed_by = record.get("signed_by") if isinstance(record, dict) else None
    return signed_by.upper() if isinstance(signed_by, str) and signed_by else None


def write_keys(found: HeldKeys, output: Path) -> list[Path]:
    """Write the keys: one armored file with every key when output ends in .asc (what
    `import --trusted-keys` takes), else into the directory output one HOST/NAMESPACE.asc
    per namespace and keys.json (what each key is and signed). Returns the files written."""
    try:
        if output.suffix == ".asc":
            unique = {key.fingerprint: key.armor for keys in found.values()
                      for key in keys.values()}
            output.write_text("".join(_block(armor) for armor in unique.values()))
            return [output]
        written = []
        index: dict[str, Any] = {}
        for namespace, keys in found.items():
            path = output / f"{namespace}.asc"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("".join(_block(key.armor) for key in keys.values()))
            written.append(path)
            index[namespace] = {"file": f"{namespace}.asc",
                                "keys": [key.summary() for key in keys.values()]}
        output.mkdir(parents=True, exist_ok=True)
        (output / INDEX_FILE).write_text(json.dumps({"namespaces": index}, indent=1) + "\n")
        return [*written, output / INDEX_FILE]
    except OSError as exc:
        raise BundleError(f"cannot write {exc.filename or output}: {exc.strerror}") from None


def _block(armor: str) -> str:
    return armor if armor.endswith("\n") else armor + "\n"


def describe(found: HeldKeys) -> str:
    """One line per key and namespace: what an operator reviews before trusting them."""
    lines = []
    for namespace, keys in found.items():
        for key in keys.values():
            signed = f"; signed {len(key.signed)} release(s)" if key.signed else ""
            lines.append(f"{namespace}  key {key.key_id}  fingerprint {key.fingerprint}  "
                         f"({', '.join(sorted(key.providers))}{signed})\n")
    return "".join(lines)
