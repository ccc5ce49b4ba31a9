"""The container image, built from the project's real Dockerfile and run (tests/support/
container_image.py: buildah on a Debian base from mmdebstrap, no Docker daemon): `serve` with
the shipped defaults answers over TLS as a non-root user, writes nothing outside its declared
volumes (so a read-only root file system works), `client-config` names the image's URL, the
image is small, and the compose file and Kubernetes manifests say what the image holds."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.container_image import (
    build_image,
    debian_base,
    inspect,
    mounted,
    remove_images,
    run_in,
    snapshot,
    volume_dir,
    working_container,
)
from tests.support.proxy_process import free_port

# End to end: the image is built and run (about a minute): left out by `-m "not e2e"`.
pytestmark = pytest.mark.e2e
DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
STATE, CACHE = "/var/lib/tf-registry-proxy", "/var/cache/tf-registry-proxy"
# What the image must stay under (README, "Docker").
SIZE_AIM = 300 * 10**6


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The image built from the Dockerfile (once for the module), removed afterwards."""
    base = debian_base(tmp_path_factory.mktemp("image"))
    try:
        built = build_image(base)
        try:
            yield built
        finally:
            remove_images(built)
    finally:
        remove_images(base)


@pytest.fixture(scope="module")
def config(image: str) -> dict[str, Any]:
    """The image's configuration as a runtime reads it."""
    return dict(inspect(image)["Docker"]["config"])


def test_serve_with_the_shipped_defaults_answers_over_tls_as_a_non_root_user_on_a_read_only_root(
        image: str, config: dict[str, Any]) -> None:
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["tf-registry-proxy"] and config["Cmd"] == ["serve"]
    assert config["Healthcheck"]["Test"] == ["CMD", "tf-registry-proxy", "healthcheck"]
    volumes = sorted(config["Volumes"])
    assert volumes == ["/tmp", CACHE, STATE]
    # The shipped config, but for the port: the container shares the host's network.
    listen = {"TF_REGISTRY_PROXY_SERVER_LISTEN": f"127.0.0.1:{free_port()}"}
    with working_container(image) as container, mounted(container) as root:
        before = snapshot(root, volumes)
        server = subprocess.Popen(run_in(container, "tf-registry-proxy", "serve", env=listen),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            state, cache = volume_dir(container, STATE), volume_dir(container, CACHE)
            port = int(listen["TF_REGISTRY_PROXY_SERVER_LISTEN"].rpartition(":")[2])
            assert _healthz(port, state / "tls" / "ca.pem", server) == {"status": "ok"}
            users = {_uid(pid) for pid in _processes_serving()}
            assert users == {10001}, users  # the supervisor and every worker
            # The image's HEALTHCHECK, as a runtime runs it (in the same container).
            healthcheck = subprocess.run(
                run_in(container, "tf-registry-proxy", "healthcheck", env=listen),
                capture_output=True, text=True, timeout=60)
            assert healthcheck.returncode == 0, healthcheck.stdout + healthcheck.stderr
            assert (cache / "index").is_dir()  # the cache on its volume
        finally:
            # As a runtime stops it: SIGTERM to the container's main process (buildah run
            # itself would kill it).
            for pid in _processes_serving():
                if Path(f"/proc/{pid}/cmdline").read_bytes().endswith(b"serve\x00"):
                    os.kill(pid, signal.SIGTERM)
            output = server.communicate(timeout=60)[0]
        assert server.returncode == 0, output[-3000:]
        assert "shutting down" in output
        # Everything it wrote is on the volumes: a read-only root would have done.
        after = snapshot(root, volumes)
        changed = {key for key in before.keys() | after.keys() if before.get(key) != after.get(key)}
        assert changed == set(), sorted(changed)[:20]


def test_client_config_prints_the_images_url(image: str) -> None:
    with working_container(image) as container:
        printed = subprocess.run(run_in(container, "tf-registry-proxy", "client-config"),
                                 capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0, printed.stderr
    assert 'url = "https://localhost:8443/mirror/"' in printed.stdout
    assert f"{STATE}/tls/ca.pem" in printed.stdout


def test_the_image_is_small(image: str) -> None:
    with working_container(image) as container, mounted(container) as root:
        size = sum(os.lstat(os.path.join(directory, name)).st_size
                   for directory, _dirs, files in os.walk(root) for name in files)
    print(f"image size: {size / 10**6:.0f} MB")  # the figure the README gives
    assert size < SIZE_AIM


def test_compose_and_kubernetes_name_what_the_image_holds(config: dict[str, Any]) -> None:
    uid, gid = (int(part) for part in config["User"].split(":"))
    ports = {int(port.split("/")[0]) for port in config["ExposedPorts"]}
    volumes = set(config["Volumes"])
    env = dict(item.split("=", 1) for item in config["Env"])
    config_dir = str(Path(env["TF_REGISTRY_PROXY_CONFIG"]).parent)

    compose = yaml.safe_load((DEPLOY / "compose" / "docker-compose.yml").read_text())
    service = compose["services"]["proxy"]
    mounts = {entry.split(":")[1] for entry in service["volumes"]}
    assert mounts == (volumes - {"/tmp"}) | {env["TF_REGISTRY_PROXY_CONFIG"]}
    assert service["tmpfs"] == ["/tmp"] and service["read_only"] is True
    assert {int(entry.split(":")[1]) for entry in service["ports"]} == ports

    for manifest, kind in (("deployment.yaml", "Deployment"),
                           ("sidecar-ci-runner.yaml", "Pod")):
        documents = list(yaml.safe_load_all((DEPLOY / "kubernetes" / manifest).read_text()))
        [found] = [d for d in documents if d and d.get("kind") == kind]
        spec = found["spec"]["template"]["spec"] if kind == "Deployment" else found["spec"]
        context = spec["securityContext"]
        assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == \
            (uid, gid, gid), manifest
        [proxy] = [c for c in spec["containers"] + spec.get("initContainers", [])
                   if c.get("args", [])[:1] == ["serve"]]
        assert {m["mountPath"] for m in proxy["volumeMounts"]} == volumes | {config_dir}
        if kind == "Deployment":
            assert {p["containerPort"] for p in proxy["ports"]} == ports
        assert proxy["securityContext"]["readOnlyRootFilesystem"] is True


def _healthz(port: int, ca: Path, server: subprocess.Popen[str]) -> Any:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"serve exited: {server.communicate()[0][-3000:]}")
        if ca.is_file():
            try:
                context = ssl.create_default_context(cafile=str(ca))
                with urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz",
                                            context=context, timeout=5) as response:
                    return json.loads(response.read())
            except OSError:
                pass
        time.sleep(0.2)
    raise AssertionError("serve did not answer /healthz over TLS within 60 s")


def _processes_serving() -> list[int]:
    """The proxy's processes: the supervisor and its workers (found by their command)."""
    found = subprocess.run(["pgrep", "-f", "tf-registry-proxy/bin/python3"],
                           capture_output=True, text=True).stdout.split()
    return [int(pid) for pid in found]


def _uid(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid in /proc/{pid}/status")
