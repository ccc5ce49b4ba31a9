"""OpenPGP verification of a detached signature over SHA256SUMS, with pysequoia."""

from __future__ import annotations

from collections.abc import Sequence

import pysequoia

from proxy.core.errors import IntegrityError


def key_id_of(cert: pysequoia.Cert) -> str:
    """The 16-hex-digit key ID of a certificate's primary key (what registries list as
    `key_id`), upper case."""
    return str(cert.fingerprint)[-16:].upper()


def issuer_of(sig: pysequoia.Sig) -> str | None:
    """The key ID that made a signature, as the signature names it (None: it names none)."""
    issuer = sig.issuer_fingerprint or sig.issuer_key_id
    return str(issuer)[-16:].upper() if issuer else None


def verify_detached(data: bytes, signature: bytes, armored_keys: Sequence[str],
                    whose: str = "upstream's signing keys") -> str:
    """Check that `signature` is a valid signature over `data` by one of `armored_keys`.

    Returns the fingerprint of the key that signed. Raises IntegrityError otherwise, naming
    the key ID that made the signature and the key IDs tried; an empty key list is a failure
    (the caller decides the rare hosts where unsigned is allowed).
    """
    if not armored_keys:
        raise IntegrityError("signature", "upstream offered no signing keys")
    certs = []
    for armor in armored_keys:
        try:
            certs.append(pysequoia.Cert.from_bytes(armor.encode("utf-8")))
        except Exception:
            continue
    if not certs:
        raise IntegrityError("signature", "none of upstream's signing keys could be parsed")
    try:
        sig = pysequoia.Sig.from_bytes(signature)
    except Exception:
        raise IntegrityError("signature", "the SHA256SUMS signature is not an OpenPGP "
                             "signature") from None
    tried = tuple(dict.fromkeys(key_id_of(cert) for cert in certs))
    issuer = issuer_of(sig)
    # The operator's first question about a bad signature: which key made it, and which
    # keys were expected (a rotated or foreign key, or bytes changed after signing).
    named = (f"made by key {issuer or '(unnamed)'}; tried key"
             f"{'s' if len(tried) > 1 else ''} {', '.join(tried)}")
    try:
        result = pysequoia.verify(bytes=data, signature=sig, store=lambda _ids: certs)
    except Exception as exc:
        first_line = (str(exc).splitlines()[0].rstrip(".") if str(exc)
                      else type(exc).__name__)
        raise IntegrityError("signature", "SHA256SUMS signature does not verify with "
                             f"{whose} ({named}): {first_line}",
                             signed_by=issuer, keys_tried=tried) from None
    valid = list(getattr(result, "valid_sigs", []) or [])
    if not valid:
        raise IntegrityError("signature", "SHA256SUMS signature does not verify with "
                             f"{whose} ({named})",
                             signed_by=issuer, keys_tried=tried)
    return str(valid[0].certificate)


def signature_time(signature: bytes) -> float | None:
    """When an OpenPGP signature says it was made (epoch seconds; its creation time, which
    the signature covers); None for bytes that are not one."""
    try:
        created = pysequoia.Sig.from_bytes(signature).created
    except Exception:
        return None
    return None if created is None else float(created.timestamp())
