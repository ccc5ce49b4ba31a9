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
    passphrase: str = ""

    def detach_sign(self, data: bytes, at: str | None = None) -> bytes:
        """A binary detached signature over data (what registries publish as `.sig`),
        made at the faked time `at` (gpg's YYYYMMDDTHHMMSS) if given."""
        result = subprocess.run(
            ["gpg", "--batch", "--yes", "--pinentry-mode", "loopback", "--passphrase",
             self.passphrase, *_faked(at),
             "--local-user", self.fingerprint, "--detach-sign", "--output", "-"],
            input=data, capture_output=True, env=_env(self.home), check=True, timeout=60)
        return result.stdout

    def armored_secret_key(self) -> str:
        """The secret key as `gpg --armor --export-secret-keys` writes it (still protected
        by its passphrase, if it has one)."""
        return subprocess.run(
            ["gpg", "--batch", "--pinentry-mode", "loopback", "--passphrase", self.passphrase,
             "--armor", "--export-secret-keys", self.fingerprint],
            capture_output=True, env=_env(self.home), check=True, text=True,
            timeout=60).stdout


def _env(home: Path) -> dict[str, str]:
    return {"GNUPGHOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def _faked(at: str | None) -> list[str]:
    return ["--faked-system-time", at] if at else []


def generate_key(home: Path, name: str, at: str | None = None,
                 expire: str = "never", passphrase: str = "") -> GpgKey:
    """An RSA signing key, as `gpg --quick-gen-key` makes it (created at the faked time
    `at` and expiring after `expire`, e.g. "1y", when given; protected by passphrase if
    not empty)."""
    home.mkdir(parents=True, mode=0o700, exist_ok=True)
    env = _env(home)
    subprocess.run(
        ["gpg", "--batch", "--pinentry-mode", "loopback", "--passphrase", passphrase,
         *_faked(at),
         "--quick-gen-key", f"{name} <{name.lower().replace(' ', '-')}@example.test>",
         "rsa2048", "sign", expire],
        capture_output=True, env=env, check=True, timeout=120)
    listing = subprocess.run(["gpg", "--batch", "--with-colons", "--list-secret-keys"],
                             capture_output=True, env=env, check=True, text=True).stdout
    fingerprint = next(line.split(":")[9] for line in listing.splitlines()
                       if line.startswith("fpr:"))
    armored = subprocess.run(["gpg", "--batch", "--armor", "--export", fingerprint],
                             capture_output=True, env=env, check=True, text=True).stdout
    return GpgKey(home, fingerprint, armored, passphrase)


def stop_agent(key: GpgKey) -> None:
    """Stop the gpg-agent that signing started for this key's home."""
    subprocess.run(["gpgconf", "--kill", "gpg-agent"], env=_env(key.home),
                   capture_output=True, timeout=30, check=False)
