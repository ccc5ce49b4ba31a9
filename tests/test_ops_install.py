"""The shipped install files: the systemd unit (checked by systemd-analyze, its directories and
environment the ones the proxy uses when started as the unit starts it) and the Docker Compose
example (its ports, paths, health check and grace period the ones the Dockerfile and its
config name)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from proxy.config import CONFIG_ENV, load_config
from proxy.config.settings import ServerConfig
from tests.support.proxy_process import ProxyProcess, free_port

ROOT = Path(__file__).resolve().parents[1]
UNIT = ROOT / "ops" / "tf-registry-proxy.service"
COMPOSE_DIR = ROOT / "deploy" / "compose"
# What the main process gives its workers after the grace period before it kills them.
WORKER_KILL_DELAY = 5.0


# --- the systemd unit ------------------------------------------------------------------------

def unit_settings(text: str) -> dict[str, list[str]]:
    """Key -> every value assigned to it, in order (units repeat keys such as Environment=)."""
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def one(settings: dict[str, list[str]], key: str) -> str:
    [value] = settings[key]
    return value


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(s|min)?", value)
    assert match is not None, value
    return float(match.group(1)) * (60 if match.group(2) == "min" else 1)


def unit_environment(settings: dict[str, list[str]], credentials: Path) -> dict[str, str]:
    """The environment the unit gives the proxy, with %d (the credentials directory) as
    credentials."""
    environment: dict[str, str] = {}
    for assignments in settings["Environment"]:
        for assignment in assignments.split():
            name, _, value = assignment.partition("=")
            environment[name] = value.replace("%d", str(credentials))
    return environment


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None, "systemd-analyze (Debian package systemd) is needed"
    text = UNIT.read_text()
    executable = one(unit_settings(text), "ExecStart").split()[0]
    fake = tmp_path / "tf-registry-proxy"  # an executable that exists where ExecStart points
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    unit = tmp_path / UNIT.name
    unit.write_text(text.replace(executable, str(fake)))
    checked = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                             timeout=60)
    # Lines about other units of this machine are not the unit's business.
    own = [line for line in (checked.stdout + checked.stderr).splitlines()
           if UNIT.name in line]
    assert checked.returncode == 0 and own == [], checked.stdout + checked.stderr

    broken = tmp_path / "broken" / UNIT.name
    broken.parent.mkdir()
    broken.write_text(text.replace(executable, str(fake)).replace("ProtectHome=yes",
                                                                  "ProtectHome=maybe"))
    failed = subprocess.run([analyze, "verify", str(broken)], capture_output=True, text=True,
                            timeout=60)
    # The check does read the unit: a bad value is a line naming it.
    assert [line for line in (failed.stdout + failed.stderr).splitlines()
            if UNIT.name in line and "protect home" in line], failed.stderr


def test_the_unit_is_hardened_and_waits_for_the_shutdown() -> None:
    settings = unit_settings(UNIT.read_text())
    assert one(settings, "DynamicUser") == "yes"
    for key, value in {"NoNewPrivileges": "yes", "ProtectSystem": "strict",
                       "ProtectHome": "yes", "PrivateTmp": "yes", "PrivateDevices": "yes",
                       "ProtectKernelTunables": "yes", "ProtectKernelModules": "yes",
                       "ProtectKernelLogs": "yes", "ProtectControlGroups": "yes",
                       "SystemCallFilter": "@system-service",
                       "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
                       "CapabilityBoundingSet": "", "Restart": "on-failure",
                       "KillMode": "mixed"}.items():
        assert one(settings, key) == value, key
    assert "CAP_NET_BIND_SERVICE" in UNIT.read_text()  # how to listen on 443 is documented
    assert int(one(settings, "LimitNOFILE")) >= 4 * ServerConfig().max_connections
    assert seconds(one(settings, "TimeoutStopSec")) > (ServerConfig().shutdown_timeout
                                                       + WORKER_KILL_DELAY)
    assert one(settings, "ExecReload") == "/bin/kill -HUP $MAINPID"
    assert one(settings, "ExecStart").split()[1:] == ["serve"]


def test_the_proxy_started_as_the_unit_starts_it_uses_the_units_directories(
        tmp_path: Path) -> None:
    """systemd creates /var/lib/NAME, /var/cache/NAME and the credentials directory, and
    starts the proxy with the unit's environment: here under tmp_path."""
    settings = unit_settings(UNIT.read_text())
    root = tmp_path / "root"
    state = root / "var/lib" / one(settings, "StateDirectory")
    cache = root / "var/cache" / one(settings, "CacheDirectory")
    credentials = root / "run/credentials" / UNIT.name
    for directory in (state, cache, credentials):
        directory.mkdir(parents=True)
    # LoadCredential=NAME:/etc/...: the file the operator installed, under NAME.
    name, _, source = one(settings, "LoadCredential").partition(":")
    assert source == f"/etc/{one(settings, 'ConfigurationDirectory')}/config.toml"
    port = free_port()
    (credentials / name).write_text(f'[server]\nlisten = "127.0.0.1:{port}"\n')

    environment = unit_environment(settings, credentials)
    assert environment[CONFIG_ENV] == str(credentials / name)
    # Paths the unit names are under / on a real system: here under root.
    environment = {key: str(root) + value if value.startswith("/var/") else value
                   for key, value in environment.items()}
    proxy = ProxyProcess(Path(environment[CONFIG_ENV]), cache, port, tmp_path / "proxy.log",
                         env=environment)
    with proxy:
        assert proxy.ca_file.is_relative_to(state)
        assert (cache / "tmp").is_dir()
    assert sorted(p.name for p in root.glob("*/*/*")) == sorted(
        [state.name, cache.name, UNIT.name])  # nothing written elsewhere


# --- Docker Compose --------------------------------------------------------------------------

def compose() -> dict[str, object]:
    loaded = yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())
    assert isinstance(loaded, dict)
    return loaded


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_the_compose_service_matches_the_dockerfile_and_its_config() -> None:
    service = compose()["services"]["proxy"]  # type: ignore[index]
    assert (COMPOSE_DIR / service["build"]["context"] / "Dockerfile").resolve() == \
        ROOT / "Dockerfile"
    image_config = re.search(r"TF_REGISTRY_PROXY_CONFIG=(\S+)", dockerfile())
    assert image_config is not None
    mounts = {}
    for volume in service["volumes"]:
        source, target, *_ = volume.split(":")
        mounts[target] = source
    config_file = COMPOSE_DIR / mounts[image_config.group(1)]
    config = load_config(config_file, environ={})

    volumes = re.search(r'VOLUME \[(.*)\]', dockerfile())
    assert volumes is not None
    image_volumes = {v.strip().strip('"') for v in volumes.group(1).split(",")}
    named = {target for target, source in mounts.items() if source in compose()["volumes"]}  # type: ignore[operator]
    # /tmp is the image's third volume: a tmpfs here.
    assert named == image_volumes - {"/tmp"} == {str(config.cache.dir),
                                                 str(config.server.state_dir)}

    [port] = service["ports"]
    assert int(port.split(":")[-1]) == config.server.port
    assert f"EXPOSE {config.server.port}" in dockerfile()
    assert config.server.host in ("::", "0.0.0.0")

    healthcheck = re.search(r'HEALTHCHECK .*?CMD (\[.*?\])', dockerfile(), re.S)
    assert healthcheck is not None
    assert service["healthcheck"]["test"] == ["CMD", *yaml.safe_load(healthcheck.group(1))]
    assert seconds(service["stop_grace_period"]) > (config.server.shutdown_timeout
                                                    + WORKER_KILL_DELAY)
    assert service["read_only"] is True and service["tmpfs"] == ["/tmp"]


def test_docker_compose_accepts_the_file() -> None:
    docker = shutil.which("docker")
    plugin = docker is not None and subprocess.run(
        [docker, "compose", "version"], capture_output=True, timeout=60).returncode == 0
    standalone = shutil.which("docker-compose")
    # Fails, never skips: the README's test command installs docker-compose (no daemon needed).
    assert plugin or standalone is not None, "neither `docker compose` nor docker-compose"
    command = [str(docker), "compose"] if plugin else [str(standalone)]
    checked = subprocess.run([*command, "-f", str(COMPOSE_DIR / "docker-compose.yml"),
                              "config", "--quiet"], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stderr
