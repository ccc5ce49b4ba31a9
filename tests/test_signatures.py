"""OpenPGP verification with keys and signatures made by the real gpg binary."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.core.errors import IntegrityError
from proxy.verification.signatures import verify_detached
from tests.support.gpg import GpgKey, generate_key, stop_agent

DATA = b"0123  terraform-provider-x_1.0.0_linux_amd64.zip\n"


def test_good_signature_verifies_to_its_fingerprint(signer: GpgKey) -> None:
    fingerprint = verify_detached(DATA, signer.detach_sign(DATA), [signer.armored_public_key])
    assert fingerprint.lower() == signer.fingerprint.lower()


def test_signature_by_any_of_several_keys_verifies(signer: GpgKey, impostor: GpgKey) -> None:
    assert verify_detached(DATA, signer.detach_sign(DATA),
                           [impostor.armored_public_key, signer.armored_public_key])


def test_signature_by_another_key_fails(signer: GpgKey, impostor: GpgKey) -> None:
    with pytest.raises(IntegrityError, match="does not verify"):
        verify_detached(DATA, impostor.detach_sign(DATA), [signer.armored_public_key])


def test_a_failed_check_names_the_signing_key_and_the_keys_tried(
        signer: GpgKey, impostor: GpgKey) -> None:
    signer_id, impostor_id = signer.fingerprint[-16:], impostor.fingerprint[-16:]
    with pytest.raises(IntegrityError) as raised:
        verify_detached(DATA, impostor.detach_sign(DATA), [signer.armored_public_key])
    assert f"made by key {impostor_id}; tried key {signer_id}" in raised.value.message
    assert (raised.value.signed_by, raised.value.keys_tried) == (impostor_id, (signer_id,))
    with pytest.raises(IntegrityError) as raised:  # the right key, other bytes
        verify_detached(DATA + b"x", signer.detach_sign(DATA),
                        [impostor.armored_public_key, signer.armored_public_key])
    assert f"made by key {signer_id}; tried keys {impostor_id}, {signer_id}" \
        in raised.value.message


def test_altered_data_fails(signer: GpgKey) -> None:
    with pytest.raises(IntegrityError, match="does not verify"):
        verify_detached(DATA + b"\n", signer.detach_sign(DATA), [signer.armored_public_key])


def test_no_keys_fails(signer: GpgKey) -> None:
    with pytest.raises(IntegrityError, match="no signing keys"):
        verify_detached(DATA, signer.detach_sign(DATA), [])


def test_garbage_key_and_signature(signer: GpgKey) -> None:
    with pytest.raises(IntegrityError, match="could be parsed"):
        verify_detached(DATA, signer.detach_sign(DATA), ["not a key"])
    with pytest.raises(IntegrityError, match="not an OpenPGP signature"):
        verify_detached(DATA, b"garbage", [signer.armored_public_key])


def test_key_expired_since_signing_is_accepted(tmp_path: Path) -> None:
    """Release keys expire; signatures made while they were valid stay good (as clients
    accept them)."""
    old = generate_key(tmp_path / "old", "Old Signer", at="20200101T000000", expire="1y")
    try:
        signature = old.detach_sign(DATA, at="20200601T000000")
        assert verify_detached(DATA, signature, [old.armored_public_key])
    finally:
        stop_agent(old)
