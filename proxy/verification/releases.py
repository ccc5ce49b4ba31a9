"""What makes a CLI release trusted: its SHA256SUMS signed (OpenPGP) by a configured release
key (HashiCorp's or OpenTofu's, shipped with the proxy, replaceable in config), and each
archive's sha256 equal to the signed line. Pure but for reading key files."""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

import pysequoia

from proxy.config.settings import ReleasesConfig
from proxy.core.errors import IntegrityError, NotFound
from proxy.core.releases import HASHICORP_KEY_ID, OPENTOFU, TERRAFORM, Product
from proxy.upstream.documents import parse_sha256sums
from proxy.verification.signatures import verify_detached

_ARMORED = re.compile(r"-----BEGIN PGP PUBLIC KEY BLOCK-----.*?-----END PGP PUBLIC KEY BLOCK-----",
                      re.S)
SHIPPED_KEYS = {TERRAFORM.name: "hashicorp.asc", OPENTOFU.name: "opentofu.asc"}


class ReleaseKeyError(ValueError):
    """A configured key file holds no usable OpenPGP public key."""


@dataclass(frozen=True)
class ReleaseKeys:
    """The armored public keys one product's SHA256SUMS must be signed by."""

    armored: tuple[str, ...]
    fingerprints: tuple[str, ...]
    source: str  # the file they came from, for messages

    @property
    def text(self) -> str:
        """All of them, as one armored file (what clients are given to verify with)."""
        return "\n".join(self.armored) + "\n"


def load_release_keys(config: ReleasesConfig) -> dict[str, ReleaseKeys]:
    """The keys of each product: its configured file, else the one shipped. Raises
    ReleaseKeyError naming the file when one holds no key."""
    configured = {TERRAFORM.name: config.terraform_keys, OPENTOFU.name: config.opentofu_keys}
    keys = {}
    for product, path in configured.items():
        if path is None:
            shipped = resources.files("proxy.verification") / "release_keys" / \
                SHIPPED_KEYS[product]
            keys[product] = parse_keys(shipped.read_text(encoding="ascii"),
                                       f"the shipped {SHIPPED_KEYS[product]}")
        else:
            keys[product] = parse_keys(Path(path).read_text(encoding="utf-8", errors="replace"),
                                       str(path))
    return keys


def parse_keys(text: str, source: str) -> ReleaseKeys:
    """Every OpenPGP public key in text: armored blocks, each of which may hold several keys
    (what `gpg --armor --export K1 K2` writes). ReleaseKeyError if none parses."""
    armored, fingerprints = [], []
    for block in _ARMORED.findall(text):
        try:
            certs = pysequoia.Cert.split_bytes(block.encode())
        except Exception:  # not OpenPGP data: the other blocks may still be keys
            continue
        for cert in certs:
            fingerprint = str(cert.fingerprint).upper()
            if fingerprint not in fingerprints:
                armored.append(str(cert))
                fingerprints.append(fingerprint)
    if not armored:
        raise ReleaseKeyError(f"{source} holds no armored OpenPGP public key")
    return ReleaseKeys(tuple(armored), tuple(fingerprints), source)


@dataclass(frozen=True)
class VerifiedRelease:
    """A release whose SHA256SUMS verified: the files served as published with it."""

    product: str
    version: str
    sums: bytes
    signatures: dict[str, bytes]  # by file name, each one verified
    signed_by: str  # the fingerprint of the key that made the first of them
    extras: dict[str, bytes] = field(default_factory=dict)  # served, not checked (cosign)

    @property
    def checksums(self) -> dict[str, str]:
        """sha256 by file name, from the signed SHA256SUMS."""
        return parse_sha256sums(self.sums)

    def small_files(self, product: Product) -> dict[str, bytes]:
        """Every file served from this record, by name."""
        return {product.sums_name(self.version): self.sums, **self.signatures, **self.extras}

    def with_signature(self, name: str, signature: bytes) -> VerifiedRelease:
        """The same release serving one more signature file (verified by the caller)."""
        return replace(self, signatures={**self.signatures, name: signature})

    def to_record(self) -> dict[str, Any]:
        """As the index keeps it."""
        return {"sums": _b64(self.sums), "signed_by": self.signed_by,
                "signatures": {k: _b64(v) for k, v in self.signatures.items()},
                "extras": {k: _b64(v) for k, v in self.extras.items()}}

    @classmethod
    def from_record(cls, product: str, version: str, record: Mapping[str, Any]
                    ) -> VerifiedRelease:
        """From the index (ValueError, KeyError, TypeError: not such a record)."""
        return cls(product, version, base64.b64decode(record["sums"], validate=True),
                   {str(k): base64.b64decode(v, validate=True)
                    for k, v in dict(record["signatures"]).items()},
                   str(record["signed_by"]),
                   {str(k): base64.b64decode(v, validate=True)
                    for k, v in dict(record.get("extras") or {}).items()})


def verify_release(product: Product, version: str, sums: bytes,
                   signatures: Mapping[str, bytes], keys: ReleaseKeys,
                   extras: Mapping[str, bytes] | None = None) -> VerifiedRelease:
    """The release, keeping the signatures that verify with keys; IntegrityError (the first
    failure, naming the keys tried) when none does."""
    whose = f"the {product.name} release keys"
    verified: dict[str, bytes] = {}
    signed_by = ""
    failure: IntegrityError | None = None
    for name, signature in signatures.items():
        try:
            fingerprint = verify_detached(sums, signature, keys.armored, whose)
        except IntegrityError as exc:
            failure = failure or exc
            continue
        verified[name] = signature
        signed_by = signed_by or fingerprint
    if not verified:
        raise failure or IntegrityError("signature", f"{product.name} {version} publishes no "
                                        "signature over its SHA256SUMS")
    _require_this_version(product, version, parse_sha256sums(sums))
    return VerifiedRelease(product.name, version, sums, verified, signed_by,
                           dict(extras or {}))


def _require_this_version(product: Product, version: str, checksums: Mapping[str, str]) -> None:
    """A signed SHA256SUMS vouches for names, not for the version it was asked for: it must
    list an archive of this version and none of another (a mirror serving one version's
    sums under another's name would otherwise be stored under the wrong version)."""
    others = [name for name in checksums if name.startswith(f"{product.prefix}_")
              and not name.startswith(f"{product.prefix}_{version}_")]
    if others or not any(product.platform_of(version, name) for name in checksums):
        raise IntegrityError("checksum", f"{product.name} {version}: its SHA256SUMS is not "
                             f"that release's (it lists {', '.join(sorted(checksums)[:3])})")


def signature_candidates(product: Product, version: str, keys: ReleaseKeys,
                         listed: Sequence[str] = ()) -> list[str]:
    """The signature files to fetch for a version: those upstream lists for it (index.json's
    `shasums_signatures`), HashiCorp's `.KEYID.sig` of each key configured and the plain
    `.sig` (releases before 2021 have a plain one by a key since revoked; the keyed one is by
    the current key); OpenTofu's `.gpgsig`. A mirror re-signed with another key keeps the
    names clients ask for (tfenv always asks for `.72D7468F.sig`, HashiCorp's key ID): each
    is served only if it verifies with a configured key."""
    sums = product.sums_name(version)
    own = [name for name in listed if _is_signature(product, version, name)]
    if product is OPENTOFU:
        return [*dict.fromkeys([*own, f"{sums}.gpgsig"])]
    keyed = [f"{sums}.{fingerprint[-8:]}.sig" for fingerprint in keys.fingerprints]
    return [*dict.fromkeys([*own, *keyed, f"{sums}.{HASHICORP_KEY_ID}.sig", f"{sums}.sig"])]


def _is_signature(product: Product, version: str, name: object) -> bool:
    try:
        return isinstance(name, str) and product.kind_of(version, name) == "signature"
    except NotFound:
        return False


def extra_names(product: Product, version: str) -> Sequence[str]:
    """The files served as published beside the verified ones (OpenTofu's cosign files)."""
    return [product.sums_name(version) + suffix for suffix in product.extra_suffixes]


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")
