"""Operator signatures on air-gap bundles: an OpenPGP key pair (made by `keygen`, or by gpg),
a detached signature over the exact bytes of a bundle's manifest at export, and its check
against the exporters' public keys at import. pysequoia does the OpenPGP work."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pysequoia

SECRET_KEY_FILE = "bundle-key.secret.asc"
PUBLIC_KEY_FILE = "bundle-key.public.asc"
_USER_ID = "tf-registry-proxy bundle signing key"
_MAX_KEY_FILE = 1 << 20


class SigningError(Exception):
    """A key that cannot be made, read or used, or a signature that does not verify."""


@dataclass(frozen=True)
class KeyPair:
    """Where `keygen` wrote a key pair, and its fingerprint."""

    secret: Path
    public: Path
    fingerprint: str


def _reason(exc: Exception) -> str:
    # pysequoia's messages may carry a Rust backtrace after the first line.
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def generate_key_pair(directory: Path) -> KeyPair:
    """Write a new signing key pair into directory: the secret half readable by its owner
    only, the public half for importers. Existing files are never overwritten."""
    secret_path, public_path = directory / SECRET_KEY_FILE, directory / PUBLIC_KEY_FILE
    for path in (secret_path, public_path):
        if path.exists() or path.is_symlink():
            raise SigningError(f"{path} exists; keygen never overwrites a key")
    # Ed25519 in the v4 format (RFC 4880), which every gpg release in use reads; no expiry,
    # so that bundles made years apart verify the same way.
    key = pysequoia.Tsk.generate(_USER_ID, profile=pysequoia.Profile.RFC4880)
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        _write_new(secret_path, str(key).encode(), 0o600)
        try:
            _write_new(public_path, str(key.extract_certificate()).encode(), 0o644)
        except OSError:
            secret_path.unlink(missing_ok=True)  # never leave half a pair
            raise
    except FileExistsError as exc:
        raise SigningError(f"{exc.filename} exists; keygen never overwrites a key") from None
    except OSError as exc:
        raise SigningError(f"cannot write {exc.filename or directory}: {exc.strerror}") \
            from None
    return KeyPair(secret_path, public_path, key.extract_certificate().fingerprint.upper())


def _write_new(path: Path, data: bytes, mode: int) -> None:
    # O_EXCL: refuses an existing file or symlink, so nothing is overwritten or followed.
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)


def _read_key_file(path: Path) -> bytes:
    try:
        with open(path, "rb") as handle:
            data = handle.read(_MAX_KEY_FILE + 1)
    except OSError as exc:
        raise SigningError(f"cannot read {path}: {exc.strerror}") from None
    if len(data) > _MAX_KEY_FILE:
        raise SigningError(f"{path} is too large to be an OpenPGP key")
    return data


def _has_secret(key: pysequoia.Tsk) -> bool:
    # A key without secret material serializes exactly like its public certificate.
    return bytes(key) != bytes(key.extract_certificate())


def _holds_secret(data: bytes) -> bool:
    if b"PRIVATE KEY BLOCK" in data:
        return True
    try:
        return _has_secret(pysequoia.Tsk.from_bytes(data))
    except Exception:
        return False


class ManifestSigner:
    """An unlocked secret key that signs bundle manifests."""

    def __init__(self, signer: pysequoia.PySigner, fingerprint: str) -> None:
        self._signer = signer
        self.fingerprint = fingerprint

    def sign(self, manifest: bytes) -> bytes:
        """A binary detached signature over the manifest bytes."""
        try:
            return pysequoia.sign(self._signer, manifest,
                                  mode=pysequoia.SignatureMode.DETACHED, armor=False)
        except Exception as exc:
            raise SigningError(f"cannot sign with key {self.fingerprint}: {_reason(exc)}") \
                from None


def load_signer(path: Path, passphrase_file: Path | None = None) -> ManifestSigner:
    """The signing key in path (armored or binary OpenPGP secret key), unlocked with the
    first line of passphrase_file if it is passphrase-protected."""
    data = _read_key_file(path)
    try:
        key = pysequoia.Tsk.from_bytes(data)
    except Exception as exc:
        raise SigningError(f"{path} holds no OpenPGP secret key ({_reason(exc)})") from None
    if not _has_secret(key):
        raise SigningError(f"{path} holds a public key only: --signing-key takes the secret "
                           f"half ({SECRET_KEY_FILE} from keygen)")
    passphrase = None
    if passphrase_file is not None:
        try:
            lines = passphrase_file.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as exc:
            raise SigningError(f"cannot read the passphrase file {passphrase_file}: "
                               f"{getattr(exc, 'strerror', None) or exc}") from None
        passphrase = lines[0] if lines else ""
    try:
        signer = key.signer(passphrase)
    except Exception as exc:
        reason = _reason(exc)
        if passphrase is None and "encrypted" in reason:
            raise SigningError(f"the key in {path} is passphrase-protected: give "
                               "--passphrase-file FILE") from None
        if passphrase is not None:
            raise SigningError(f"cannot unlock the key in {path} with the passphrase "
                               f"given ({reason})") from None
        raise SigningError(f"cannot sign with the key in {path} ({reason})") from None
    return ManifestSigner(signer, key.extract_certificate().fingerprint.upper())


def load_public_keys(path: Path) -> list[pysequoia.Cert]:
    """The OpenPGP public keys (armored or binary) in a file that may hold several."""
    data = _read_key_file(path)
    try:
        certs = pysequoia.Cert.split_bytes(data)
    except Exception as exc:
        raise SigningError(f"{path} holds no OpenPGP public key ({_reason(exc)})") from None
    if not certs:
        raise SigningError(f"{path} holds no OpenPGP public key")
    if _holds_secret(data):
        # A secret key has no business on the importing side: say so rather than use it.
        raise SigningError(f"{path} holds a secret key: give the public half "
                           f"({PUBLIC_KEY_FILE} from keygen, or `gpg --export`)")
    return certs


def verify_manifest(manifest: bytes, signature: bytes,
                    keys: Sequence[pysequoia.Cert]) -> str:
    """Check the detached signature over the exact manifest bytes with one of keys; returns
    the fingerprint of the key that made it. Raises SigningError with the reason."""
    try:
        sig = pysequoia.Sig.from_bytes(signature)
    except Exception:
        raise SigningError("not an OpenPGP signature") from None
    try:
        certs = list(keys)
        result = pysequoia.verify(bytes=manifest, signature=sig, store=lambda _ids: certs)
    except Exception as exc:
        issuer = sig.issuer_fingerprint or sig.issuer_key_id
        made_by = f"signing key {issuer.upper()}" if issuer else "an unnamed key"
        raise SigningError(f"the manifest signature (made by {made_by}) "
                           "does not verify with any bundle key: the manifest was changed "
                           f"after signing, or another key signed it ({_reason(exc)})") from None
    valid = list(result.valid_sigs or [])
    if not valid:
        raise SigningError("the manifest signature does not verify with any bundle key")
    return str(valid[0].certificate).upper()
