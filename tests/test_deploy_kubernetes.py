"""The Kubernetes manifests in deploy/kubernetes: valid against the Kubernetes API schemas
(strict: an unknown field fails), and consistent with the proxy they run: the ConfigMap is a
configuration the proxy loads, the Secret made as the README says is the state directory the
proxy reads without writing to it, probes and ports are the ones the config serves, the user
is the image's, and the IAM policy allows what the README explains."""

from __future__ import annotations

import copy
import json
import re
import secrets
import socket
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from aiohttp import web
from cryptography import x509
from kubernetes_validate.utils import latest_version

from proxy.cli import main
from proxy.cli.client_config import render_client_config
from proxy.config import Config, load_config
from proxy.tls.certificates import ensure_certificate, ssl_context
from proxy.tls.state import StatePaths
from proxy.web.auth import load_signing_key
from proxy.web.routes import add_routes

ROOT = Path(__file__).parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
# The oldest release the README promises (native sidecars since 1.29, the preStop sleep
# action since 1.30, both on by default in 1.33) and the newest whose schemas
# kubernetes-validate ships (offline).
KUBERNETES_VERSION = "1.33.0"
VERSIONS = [KUBERNETES_VERSION, latest_version()]
SECRET_NAME = "tf-registry-proxy-state"
SERVICE_NAME = "tf-registry-proxy.example.svc"


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """The schemas are local files: no check here may reach the network."""
    def refuse(*_args: object) -> None:
        raise AssertionError("a manifest check tried to connect")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def manifest_files() -> list[Path]:
    return sorted(p for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")


def documents() -> list[tuple[str, dict[str, Any]]]:
    """Every Kubernetes object in the manifests, with its file's name."""
    found = []
    for path in manifest_files():
        for document in yaml.safe_load_all(path.read_text()):
            assert isinstance(document, dict), f"{path.name}: not an object"
            found.append((path.name, document))
    return found


def find(kind: str, name: str) -> dict[str, Any]:
    matches = [d for _, d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} found"
    return matches[0]


def deployment() -> dict[str, Any]:
    return find("Deployment", "tf-registry-proxy")


def runner_pod() -> dict[str, Any]:
    return find("Pod", "tf-ci-runner")


def proxy_container(pod_spec: dict[str, Any]) -> dict[str, Any]:
    """The container that runs `serve` (in containers, or a native sidecar)."""
    candidates = [c for c in [*pod_spec.get("initContainers", []), *pod_spec["containers"]]
                  if c.get("args") == ["serve"]]
    assert len(candidates) == 1
    return candidates[0]


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", [])}


def config_toml() -> str:
    text = find("ConfigMap", "tf-registry-proxy-config")["data"]["config.toml"]
    assert isinstance(text, str)
    return text


def readme_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("## Several replicas on Kubernetes")
    return text[start:text.index("\n## ", start + 1)]


def mounted_state(tmp_path: Path, pod_spec: dict[str, Any]) -> dict[str, Path]:
    """The proxy container's volumes as directories under tmp_path, filled as the kubelet
    would: the Secret made by the README's commands (from a CA that `tls rotate` creates),
    through the volume's items; the ConfigMap's file; empty dirs. Maps each mountPath to its
    directory here."""
    source = tmp_path / "tfproxy-state"
    tls_config = tmp_path / "tls.toml"
    tls_config.write_text(f'[server]\nstate_dir = "{source}"\npublic_url = '
                          f'"https://{SERVICE_NAME}/"\n[cache]\ndir = "{tmp_path}/unused"\n')
    assert main(["tls", "rotate", "--config", str(tls_config)]) == 0
    (source / "url-signing.key").write_bytes(secrets.token_bytes(32))
    # kubectl create secret generic ... --from-file=KEY=tfproxy-state/PATH, as documented.
    secret = {key: (source / path.removeprefix("tfproxy-state/")).read_bytes()
              for key, path in re.findall(r"--from-file=([\w.-]+)=(\S+)", readme_section())}
    volumes = {v["name"]: v for v in pod_spec["volumes"]}
    mounts: dict[str, Path] = {}
    for mount in proxy_container(pod_spec)["volumeMounts"]:
        here = tmp_path / "pod" / mount["name"]
        here.mkdir(parents=True)
        volume = volumes[mount["name"]]
        if "secret" in volume:
            assert volume["secret"]["secretName"] == SECRET_NAME
            for item in volume["secret"]["items"]:
                (here / item["path"]).parent.mkdir(parents=True, exist_ok=True)
                (here / item["path"]).write_bytes(secret[item["key"]])
        elif "configMap" in volume:  # every key of it, as the kubelet writes them
            for key, text in find("ConfigMap", volume["configMap"]["name"])["data"].items():
                (here / key).write_text(text)
        mounts[mount["mountPath"]] = here
    return mounts


def load_as_mounted(mounts: dict[str, Path], environ: dict[str, str]) -> Config:
    """The ConfigMap's TOML with the pod's paths moved to their directories here."""
    text = config_toml()
    # One pass, longest first: a directory here may itself start with a mount path (/tmp).
    pattern = "|".join(re.escape(m) for m in sorted(mounts, key=len, reverse=True))
    text = re.sub(f'"({pattern})(?=[/"])', lambda m: f'"{mounts[m.group(1)]}', text)
    path = mounts["/etc/tf-registry-proxy"] / "loaded.toml"
    path.write_text(text)
    return load_config(path, environ=environ)


def tree(root: Path) -> dict[str, tuple[int, bytes]]:
    return {str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes())
            for p in root.rglob("*") if p.is_file()}


# --- the API schemas ---------------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("name", "document"), documents(),
                         ids=[f"{n}:{d['kind']}" for n, d in documents()])
def test_every_manifest_is_valid_against_the_api_schemas(name: str, document: dict[str, Any],
                                                         version: str) -> None:
    kubernetes_validate.validate(document, version, strict=True)


BREAKAGES = {
    "unknown field in a container": lambda d: d["spec"]["template"]["spec"]["containers"][0]
    .update(readinesProbe={"httpGet": {"path": "/readyz", "port": "https"}}),
    "unknown field in the security context": lambda d: d["spec"]["template"]["spec"]
    ["containers"][0]["securityContext"].update(readOnlyRootFilesystems=True),
    "replicas as a string": lambda d: d["spec"].update(replicas="three"),
    "a container without a name": lambda d: d["spec"]["template"]["spec"]
    ["containers"][0].pop("name"),
}


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_a_broken_manifest_fails_validation(breakage: str) -> None:
    broken = copy.deepcopy(deployment())
    BREAKAGES[breakage](broken)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_kustomization_lists_the_service_manifests() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    listed = set(kustomization["resources"])
    # The sidecar pod is a template for CI jobs, applied by them, not part of the service.
    assert listed == {p.name for p in manifest_files()} - {"sidecar-ci-runner.yaml"}
    assert [i["name"] for i in kustomization["images"]] == [
        proxy_container(deployment()["spec"]["template"]["spec"])["image"]]


# --- the Deployment runs what the proxy and the image expect -----------------------------

def test_the_configmap_loads_and_the_secret_serves_without_writes(tmp_path: Path) -> None:
    spec = deployment()["spec"]["template"]["spec"]
    mounts = mounted_state(tmp_path, spec)
    state = mounts["/var/lib/tf-registry-proxy"]
    before = tree(state)
    config = load_as_mounted(mounts, environ={})

    assert config.server.state_dir == state
    assert config.cache.dir == mounts["/var/cache/tf-registry-proxy"]
    certificate = ensure_certificate(config.server)
    ssl_context(certificate)
    assert load_signing_key(StatePaths(state).signing_key) \
        == (tmp_path / "tfproxy-state" / "url-signing.key").read_bytes()
    # The Secret is mounted read-only: the proxy must not need to create or re-issue anything.
    assert tree(state) == before
    # Each Secret item lands where the proxy keeps that piece of state.
    paths = StatePaths(state)
    assert {paths.ca_cert, paths.server_cert, paths.server_key, paths.signing_key} \
        == {p for p in state.rglob("*") if p.is_file()}
    assert not paths.ca_key.exists()  # the CA's key stays out of the cluster
    served = x509.load_pem_x509_certificate(paths.server_cert.read_bytes())
    names = served.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"localhost", SERVICE_NAME} <= set(names.get_values_for_type(x509.DNSName))


def test_the_configmap_names_the_shared_bucket(tmp_path: Path) -> None:
    spec = deployment()["spec"]["template"]["spec"]
    s3 = load_as_mounted(mounted_state(tmp_path, spec), environ={}).cache.s3
    assert s3 is not None and s3.endpoint_url is None  # AWS, as iam-policy.json is for
    policy = json.loads((DEPLOY / "iam-policy.json").read_text())
    resources = {s["Resource"] for s in policy["Statement"]}
    assert resources == {f"arn:aws:s3:::{s3.bucket}", f"arn:aws:s3:::{s3.bucket}/{s3.prefix}*"}


def quantity(text: str) -> int:
    """A Kubernetes binary quantity ("30Gi") in bytes."""
    match = re.fullmatch(r"(\d+)([KMGT])i", text)
    assert match is not None, text
    return int(match.group(1)) * 1024 ** ("KMGT".index(match.group(2)) + 1)


@pytest.mark.parametrize("pod", ["deployment", "sidecar"])
def test_the_cache_fits_its_empty_dir(pod: str, tmp_path: Path) -> None:
    spec = deployment()["spec"]["template"]["spec"] if pod == "deployment" \
        else runner_pod()["spec"]
    config = load_as_mounted(mounted_state(tmp_path, spec), environ={})
    (mount,) = [m for m in proxy_container(spec)["volumeMounts"]
                if m["mountPath"] == "/var/cache/tf-registry-proxy"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    # The hot copies (bounded by max_size) and a spool for every fill that may run at once:
    # past sizeLimit the kubelet evicts the pod.
    assert config.cache.max_size is not None
    needed = config.cache.max_size \
        + config.upstream.max_concurrent_fills * config.upstream.max_archive_size
    assert needed <= quantity(volume["emptyDir"]["sizeLimit"])


def test_probes_and_ports_are_the_ones_the_proxy_serves(tmp_path: Path) -> None:
    spec = deployment()["spec"]["template"]["spec"]
    config = load_as_mounted(mounted_state(tmp_path, spec), environ={})
    container = proxy_container(spec)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"https": config.server.port}
    assert config.server.host in ("0.0.0.0", "::")  # the kubelet probes the pod's address

    app = web.Application()
    add_routes(app, lambda _route, handler, _shape=None: handler)  # the paths are what matters here
    routes = {name: app.router[name].canonical for name in ("healthz", "readyz", "metrics")}
    probes = {kind: container[kind]["httpGet"]
              for kind in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert probes["livenessProbe"]["path"] == routes["healthz"]
    assert probes["startupProbe"]["path"] == routes["healthz"]
    assert probes["readinessProbe"]["path"] == routes["readyz"]
    for probe in probes.values():
        assert probe["scheme"] == "HTTPS"
        assert ports[probe["port"]] == config.server.port

    annotations = deployment()["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/path"] == routes["metrics"]
    assert annotations["prometheus.io/scheme"] == "https"
    assert int(annotations["prometheus.io/port"]) == config.server.port

    service = find("Service", "tf-registry-proxy")["spec"]
    assert [p["targetPort"] for p in service["ports"]] == ["https"]
    labels = deployment()["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= labels.items()
    pdb = find("PodDisruptionBudget", "tf-registry-proxy")["spec"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()


def test_shutdown_fits_in_the_grace_period(tmp_path: Path) -> None:
    spec = deployment()["spec"]["template"]["spec"]
    config = load_as_mounted(mounted_state(tmp_path, spec), environ={})
    pause = proxy_container(spec)["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert spec["terminationGracePeriodSeconds"] > pause + config.server.shutdown_timeout


def dockerfile_uid() -> int:
    match = re.search(r"useradd [^\n]*--uid (\d+)", (ROOT / "Dockerfile").read_text())
    assert match is not None
    return int(match.group(1))


@pytest.mark.parametrize("pod", ["deployment", "sidecar"])
def test_the_proxy_runs_as_the_image_user_on_a_read_only_root(pod: str, tmp_path: Path) -> None:
    spec = deployment()["spec"]["template"]["spec"] if pod == "deployment" \
        else runner_pod()["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == dockerfile_uid()
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for container in [*spec.get("initContainers", []), *spec["containers"]]:
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
    # What the proxy writes is on volumes: the cache and temp files.
    mounts = mounted_state(tmp_path, spec)
    config = load_as_mounted(mounts, environ=env_of(proxy_container(spec)))
    volumes = {v["name"]: v for v in spec["volumes"]}
    writable = {m["mountPath"] for m in proxy_container(spec)["volumeMounts"]
                if "emptyDir" in volumes[m["name"]]}
    assert writable == {"/var/cache/tf-registry-proxy", "/tmp"}
    assert all(m.get("readOnly") for m in proxy_container(spec)["volumeMounts"]
               if m["mountPath"] not in writable)
    assert config.cache.dir == mounts["/var/cache/tf-registry-proxy"]
    assert env_of(proxy_container(spec))["TMPDIR"] == "/tmp"


# --- the CI runner's sidecar --------------------------------------------------------------

def test_the_runner_uses_the_sidecar_as_client_config_prints_it(tmp_path: Path) -> None:
    spec = runner_pod()["spec"]
    sidecar = proxy_container(spec)
    assert sidecar in spec["initContainers"] and sidecar["restartPolicy"] == "Always"
    config = load_as_mounted(mounted_state(tmp_path, spec), environ=env_of(sidecar))
    assert config.server.host == "127.0.0.1"
    assert spec["serviceAccountName"] == deployment()["spec"]["template"]["spec"][
        "serviceAccountName"]  # the same role, so the same bucket

    runner_files = find("ConfigMap", "tf-ci-runner")["data"]
    def hcl(text: str) -> list[str]:
        return [line for line in text.splitlines() if line.strip()
                and not line.lstrip().startswith("#")]
    # Registry mode, without the credentials blocks: the runner's identity is its own token.
    printed = render_client_config(config, None, "registry")
    printed = re.sub(r'credentials "[^"]+" \{\n[^}]*\}\n', "", printed)
    assert hcl(runner_files["terraform.tfrc"]) == hcl(printed)
    assert config.auth.oidc and config.auth.oidc[0].audiences == ("tf-registry-proxy",)

    (runner,) = spec["containers"]
    assert env_of(runner)["TF_CLI_CONFIG_FILE"] == "/etc/tf-ci-runner/terraform.tfrc"
    ca_volumes = [v for v in spec["volumes"] if v["name"] == "proxy-ca"]
    assert ca_volumes[0]["secret"]["items"] == [{"key": "ca.pem", "path": "ca.pem"}]
    assert "/etc/tf-registry-proxy-ca/ca.pem" in runner["args"][0]
    # Its identity: the projected service-account token, for the proxy's audience.
    [identity] = [v for v in spec["volumes"] if v["name"] == "proxy-identity"]
    [source] = identity["projected"]["sources"]
    assert source["serviceAccountToken"]["audience"] in config.auth.oidc[0].audiences
    assert 'TF_TOKEN_registry_terraform_io="$(cat /var/run/secrets/tf-registry-proxy/' \
        f'{source["serviceAccountToken"]["path"]})"' in runner["args"][0]


# --- the IAM policy and the README --------------------------------------------------------

def test_the_iam_policy_allows_exactly_what_the_readme_explains() -> None:
    policy = json.loads((DEPLOY / "iam-policy.json").read_text())
    allowed = {a for s in policy["Statement"] if s["Effect"] == "Allow" for a in s["Action"]}
    section = readme_section()
    explained = set(re.findall(r"^- `(s3:\w+)`", section, re.MULTILINE))
    assert allowed == explained
    assert {"s3:GetObject", "s3:PutObject", "s3:DeleteObject", "s3:ListBucket"} <= allowed
    bucket_level = {a for s in policy["Statement"] if not s["Resource"].endswith("*")
                    for a in s["Action"]}
    assert bucket_level == {"s3:ListBucket"}  # object actions only under the prefix


def test_the_readme_secret_keys_are_the_mounted_ones() -> None:
    documented = set(re.findall(r"--from-file=([\w.-]+)=", readme_section()))
    for spec in (deployment()["spec"]["template"]["spec"], runner_pod()["spec"]):
        for volume in spec["volumes"]:
            if volume.get("secret", {}).get("secretName") == SECRET_NAME:
                assert {i["key"] for i in volume["secret"]["items"]} <= documented

