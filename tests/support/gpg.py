"""Throwaway OpenPGP keys made with the real gpg binary, for signing fake releases."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class GpgKey:
    """A signing key living in its own GNUPGHOME."""

    home: Path
    fingerprint: str
    armored_public_key: str

    def detach_sign(self, data: bytes) -> bytes:
        """A binary detached signature over data (what registries publish as `.sig`)."""
        result = subprocess.run(
            ["gpg", "--batch", "--yes", "--pinentry-mode", "loopback", "--passphrase", "",
             "--local-user", self.fingerprint, "--detach-sign", "--output", "-"],
            input=data, capture_output=True, env=_env(self.home), check=True, timeout=60)
        return result.stdout


def _env(home: Path) -> dict[str, str]:
    return {"GNUPGHOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def generate_key(home: Path, name: str) -> GpgKey:
    """An RSA signing key, as `gpg --quick-gen-key` makes it."""
    home.mkdir(parents=True, mode=0o700, exist_ok=True)
    env = _env(home)
    subprocess.run(
        ["gpg", "--batch", "--pinentry-mode", "loopback", "--passphrase", "",
         "--quick-gen-key", f"{name} <{name.lower().replace(' ', '-')}@example.test>",
         "rsa2048", "sign", "never"],
        capture_output=True, env=env, check=True, timeout=120)
    listing = subprocess.run(["gpg", "--batch", "--with-colons", "--list-secret-keys"],
                             capture_output=True, env=env, check=True, text=True).stdout
    fingerprint = next(line.split(":")[9] for line in listing.splitlines()
                       if line.startswith("fpr:"))
    armored = subprocess.run(["gpg", "--batch", "--armor", "--export", fingerprint],
                             capture_output=True, env=env, check=True, text=True).stdout
    return GpgKey(home, fingerprint, armored)


def stop_agent(key: GpgKey) -> None:
    """Stop the gpg-agent that signing started for this key's home."""
    subprocess.run(["gpgconf", "--kill", "gpg-agent"], env=_env(key.home),
                   capture_output=True, timeout=30, check=False)
