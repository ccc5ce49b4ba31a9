"""OpenPGP verification of a detached signature over SHA256SUMS, with pysequoia."""

from __future__ import annotations

from collections.abc import Sequence

import pysequoia

from proxy.core.errors import IntegrityError


def verify_detached(data: bytes, signature: bytes, armored_keys: Sequence[str]) -> str:
    """Check that `signature` is a valid signature over `data` by one of `armored_keys`.

    Returns the fingerprint of the key that signed. Raises IntegrityError otherwise; an empty
    key list is a failure (the caller decides the rare hosts where unsigned is allowed).
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
    try:
        result = pysequoia.verify(bytes=data, signature=sig, store=lambda _ids: certs)
    except Exception as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise IntegrityError("signature", "SHA256SUMS signature does not verify with "
                             f"upstream's signing keys: {first_line}") from None
    valid = list(getattr(result, "valid_sigs", []) or [])
    if not valid:
        raise IntegrityError("signature", "SHA256SUMS signature does not verify with "
                             "upstream's signing keys")
    return str(valid[0].certificate)
