"""The command line as users run it: serve with defaults, client-config, config errors."""

from __future__ import annotations

import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from aiohttp.test_utils import TestClient
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from proxy.cli.client_config import render_client_config
from proxy.config import Config, load_config
from proxy.tls.certificates import TlsStateError, ensure_certificate
from tests.support.cli_config_hcl import parse_cli_config
from tests.support.process_output import wait_for_line
from tests.support.proxy_process import free_port


def run_cli(*args: str, env: dict[str, str] | None = None,
            timeout: float = 30) -> subprocess.CompletedProcess[str]:
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": "/nonexistent"}
    return subprocess.run([sys.executable, "-m", "proxy", *args], capture_output=True,
                          text=True, env={**base, **(env or {})}, timeout=timeout)


def test_a_proxy_serving_from_a_directory_loads_no_s3_client_library() -> None:
    # botocore costs every serving process about 15 MiB: only a bucket (cache.s3) and the
    # air-gap commands need it.
    code = ("import sys\n"
            "from proxy.cli import main\n"
            "from proxy.app import configured_storage, create_app\n"
            "from proxy.config.settings import CacheConfig\n"
            "configured_storage(CacheConfig())\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'botocore', 'aiobotocore'}))")
    inherited = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **inherited},
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_client_config_prints_mirror_and_module_host_blocks(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path)}
    result = run_cli("client-config", env=env)
    assert result.returncode == 0, result.stderr
    assert 'url = "https://127.0.0.1:8443/mirror/"' in result.stdout
    assert "provider_installation {" in result.stdout
    assert f" {tmp_path}/tf-registry-proxy/tls/ca.pem > " in result.stdout
    assert "WARNING" not in result.stdout
    for host in ("registry.terraform.io", "registry.opentofu.org"):
        assert (f'host "{host}" {{\n  services = {{\n    "modules.v1" = '
                f'"https://127.0.0.1:8443/modules/{host}/"') in result.stdout


def test_client_config_uses_public_url(tmp_path: Path) -> None:
    config_file = tmp_path / "c.toml"
    (tmp_path / "c.pem").write_text("")
    (tmp_path / "k.pem").write_text("")
    config_file.write_text('[server]\npublic_url = "https://mirror.corp.example"\n'
                           f'tls_cert = "{tmp_path}/c.pem"\ntls_key = "{tmp_path}/k.pem"\n')
    text = render_client_config(load_config(config_file, environ={}), None)
    assert 'url = "https://mirror.corp.example/mirror/"' in text
    assert "SSL_CERT_FILE" not in text


def test_client_config_warns_about_wildcard_listen_without_public_url() -> None:
    config = load_config(None, environ={"TF_REGISTRY_PROXY_SERVER_LISTEN": "0.0.0.0:8443"})
    text = render_client_config(config, None)
    assert "WARNING" in text and "public_url" in text
    assert 'url = "https://localhost:8443/mirror/"' in text


def test_bad_config_is_one_clear_message_and_exit_2(tmp_path: Path) -> None:
    config_file = tmp_path / "c.toml"
    config_file.write_text('[server]\nlisten = "nope"\n[upstream]\nallowed_hosts = "x"\n')
    for command in ("serve", "client-config"):
        result = run_cli(command, "--config", str(config_file))
        assert result.returncode == 2
        assert "invalid configuration" in result.stderr
        assert "server.listen" in result.stderr and "upstream.allowed_hosts" in result.stderr
        assert "Traceback" not in result.stderr


def test_version_and_help() -> None:
    assert run_cli("--version").stdout.startswith("tf-registry-proxy ")
    result = run_cli("--help")
    assert "serve" in result.stdout and "client-config" in result.stdout


def test_serve_without_config_starts_https_with_generated_ca(tmp_path: Path) -> None:
    port = free_port()
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           "XDG_CACHE_HOME": str(tmp_path / "xdg"),
           "TF_REGISTRY_PROXY_SERVER_LISTEN": f"127.0.0.1:{port}"}
    process = subprocess.Popen([sys.executable, "-m", "proxy", "serve"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ca = tmp_path / ".local/state/tf-registry-proxy/tls/ca.pem"  # state, not cache
    try:
        status = None
        for _ in range(100):
            try:
                context = ssl.create_default_context(cafile=str(ca))
                with urllib.request.urlopen(f"https://localhost:{port}/healthz",
                                            context=context, timeout=2) as response:
                    status = response.status
                    break
            except (OSError, ssl.SSLError):
                if process.poll() is not None:
                    break
                time.sleep(0.1)
        assert status == 200
        # Announced once, at start, whatever the number of workers.
        announced = wait_for_line(process, f"clients add the CA {ca} to their trust",
                                  timeout=15)
    finally:
        process.terminate()
        process.communicate(timeout=10)
    assert announced
    assert process.returncode == 0


def test_generated_certificate_covers_names_and_is_reused(tmp_path: Path) -> None:
    config_file = tmp_path / "c.toml"
    state = f'state_dir = "{tmp_path}"\n'
    config_file.write_text('[server]\nlisten = "0.0.0.0:8443"\n' + state +
                           'public_url = "https://mirror.corp.example:8443/"\n')
    config = load_config(config_file, environ={})
    first = ensure_certificate(config.server)
    assert first.ca is not None
    cert = x509.load_pem_x509_certificate(first.cert.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    dns = names.get_values_for_type(x509.DNSName)
    assert "mirror.corp.example" in dns and "localhost" in dns
    ca_bytes, cert_bytes = first.ca.read_bytes(), first.cert.read_bytes()
    assert (first.cert.parent / "ca-key.pem").stat().st_mode & 0o077 == 0

    again = ensure_certificate(config.server)
    assert again.cert.read_bytes() == cert_bytes  # unchanged names: nothing regenerated

    # The CA may vouch only for the proxy's names (name constraints); dropping a name keeps
    # it (clients keep trusting) and re-issues only the server certificate.
    ca = x509.load_pem_x509_certificate(ca_bytes)
    constraints = ca.extensions.get_extension_for_class(x509.NameConstraints)
    assert constraints.critical
    permitted = constraints.value.permitted_subtrees or []
    assert x509.DNSName("mirror.corp.example") in permitted
    assert not any(isinstance(n, x509.DNSName) and n.value == "example.com" for n in permitted)

    config_file.write_text('[server]\nlisten = "127.0.0.1:8443"\n' + state)
    fewer = ensure_certificate(load_config(config_file, environ={}).server)
    assert fewer.ca is not None and fewer.ca.read_bytes() == ca_bytes
    assert fewer.cert.read_bytes() != cert_bytes
    sans = x509.load_pem_x509_certificate(fewer.cert.read_bytes()).extensions \
        .get_extension_for_class(x509.SubjectAlternativeName).value
    assert "mirror.corp.example" not in sans.get_values_for_type(x509.DNSName)

    # A name outside the CA: refused, never a silently replaced CA (clients trust it).
    config_file.write_text('[server]\npublic_url = "https://other.example/"\n' + state)
    with pytest.raises(TlsStateError, match=r"server\.public_url names other\.example"):
        ensure_certificate(load_config(config_file, environ={}).server)
    assert fewer.ca.read_bytes() == ca_bytes


def test_generated_ca_cannot_vouch_for_other_names(tmp_path: Path) -> None:
    """A certificate for a foreign name, signed with the generated CA's key, is refused."""
    server = replace(load_config(None, environ={}).server, state_dir=tmp_path)
    generated = ensure_certificate(server)
    assert generated.ca is not None
    ca = x509.load_pem_x509_certificate(generated.ca.read_bytes())
    ca_key = serialization.load_pem_private_key((tmp_path / "tls/ca-key.pem").read_bytes(), None)
    legit = x509.load_pem_x509_certificate(generated.cert.read_bytes())

    def signed(name: str) -> x509.Certificate:
        """The legit certificate's exact shape, for another name."""
        builder = (x509.CertificateBuilder().subject_name(legit.subject)
                   .issuer_name(ca.subject).public_key(legit.public_key())
                   .serial_number(x509.random_serial_number())
                   .not_valid_before(legit.not_valid_before_utc)
                   .not_valid_after(legit.not_valid_after_utc))
        for extension in legit.extensions:
            value = extension.value
            if isinstance(value, x509.SubjectAlternativeName):
                value = x509.SubjectAlternativeName([x509.DNSName(name)])
            builder = builder.add_extension(value, extension.critical)
        return builder.sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]

    def verify(cert: x509.Certificate, name: str) -> None:
        x509.verification.PolicyBuilder().store(x509.verification.Store([ca])) \
            .build_server_verifier(x509.DNSName(name)).verify(cert, [])

    verify(legit, "localhost")
    verify(signed("localhost"), "localhost")  # the forging method itself is sound
    with pytest.raises(x509.verification.VerificationError):
        verify(signed("bank.example"), "bank.example")


def test_concurrent_first_starts_create_one_ca(tmp_path: Path) -> None:
    """Workers (or instances) starting together on a fresh state directory share one CA."""
    server = replace(load_config(None, environ={}).server, state_dir=tmp_path / "state")
    start = threading.Barrier(8)

    def ensure(_: int) -> bytes:
        start.wait()
        ca = ensure_certificate(server).ca
        assert ca is not None
        return ca.read_bytes()

    with ThreadPoolExecutor(max_workers=8) as pool:
        assert len(set(pool.map(ensure, range(8)))) == 1


def test_tls_command_explains_what_it_cannot_do(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path)}
    shown = run_cli("tls", "show", env=env)
    assert shown.returncode == 2
    assert f"no CA yet: `serve` creates one at {tmp_path}/tf-registry-proxy/tls/ca.pem" \
        in shown.stderr
    (tmp_path / "c.pem").write_text("")
    (tmp_path / "k.pem").write_text("")
    operator = {**env, "TF_REGISTRY_PROXY_SERVER_TLS_CERT": f"{tmp_path}/c.pem",
                "TF_REGISTRY_PROXY_SERVER_TLS_KEY": f"{tmp_path}/k.pem"}
    rotated = run_cli("tls", "rotate", env=operator)
    assert rotated.returncode == 2 and "not a generated CA" in rotated.stderr
    assert not (tmp_path / "tf-registry-proxy").exists()


def test_state_dir_inside_the_cache_is_refused(tmp_path: Path) -> None:
    config_file = tmp_path / "c.toml"
    config_file.write_text(f'[server]\nstate_dir = "{tmp_path}/cache/state"\n'
                           f'[cache]\ndir = "{tmp_path}/cache"\n')
    result = run_cli("serve", "--config", str(config_file))
    assert result.returncode == 2
    assert "server.state_dir" in result.stderr and "inside cache.dir" in result.stderr


@pytest.mark.parametrize("module_args", [["-m", "proxy"]])
def test_console_script_and_module_agree(module_args: list[str]) -> None:
    script = Path(sys.executable).parent / "tf-registry-proxy"
    if not script.exists():
        pytest.fail("the tf-registry-proxy console script is not installed")
    a = subprocess.run([str(script), "--version"], capture_output=True, text=True)
    b = subprocess.run([sys.executable, *module_args, "--version"], capture_output=True,
                       text=True)
    assert a.stdout == b.stdout and a.returncode == b.returncode == 0


def test_serve_reports_a_port_in_use_clearly(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_cli("serve", env={"XDG_CACHE_HOME": str(tmp_path / "cache"),
                                       "XDG_STATE_HOME": str(tmp_path / "state"),
                                       "TF_REGISTRY_PROXY_SERVER_LISTEN": f"127.0.0.1:{port}"})
    assert result.returncode == 2
    assert f"server.listen: cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "Traceback" not in result.stderr
    assert "network mirror at" not in result.stderr  # nothing claims to serve


def test_serve_reports_an_unusable_certificate(tmp_path: Path) -> None:
    (tmp_path / "cert.pem").write_text("not a certificate")
    (tmp_path / "key.pem").write_text("not a key")
    config_file = tmp_path / "c.toml"
    config_file.write_text(f'[server]\ntls_cert = "{tmp_path}/cert.pem"\n'
                           f'tls_key = "{tmp_path}/key.pem"\n[cache]\ndir = "{tmp_path}/c"\n')
    result = run_cli("serve", "--config", str(config_file))
    assert result.returncode == 2
    assert "cannot load the serving certificate (server.tls_cert" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("workers", [1, 2])
def test_serve_with_a_damaged_url_signing_key_says_which_file_and_exits_2(
        tmp_path: Path, workers: int) -> None:
    state = tmp_path / "state"
    state.mkdir()
    key = state / "url-signing.key"
    key.write_bytes(b"torn")
    config_file = tmp_path / "c.toml"
    config_file.write_text(f'[auth]\ntokens = ["abcdefghijklmnopqrstuvwxyz"]\n'
                           f'[server]\nlisten = "127.0.0.1:{free_port()}"\n'
                           f'state_dir = "{state}"\nworkers = {workers}\n'
                           f'[cache]\ndir = "{tmp_path}/c"\n')
    result = run_cli("serve", "--config", str(config_file))
    assert result.returncode == 2
    ours = [line for line in result.stderr.splitlines()
            if line.startswith("tf-registry-proxy:")]
    assert len(ours) == 1, result.stderr
    assert str(key) in ours[0] and "delete it" in ours[0]
    assert "Traceback" not in result.stderr
    assert "Unclosed" not in result.stderr  # nothing opened before it was left open
    assert "ERROR" not in result.stderr
    assert key.read_bytes() == b"torn"  # never replaced behind the operator's back


def test_healthcheck_fails_until_the_server_answers_and_ignores_proxies(tmp_path: Path) -> None:
    port = free_port()
    env = {"XDG_CACHE_HOME": str(tmp_path), "TF_REGISTRY_PROXY_SERVER_LISTEN": f"[::]:{port}"}
    down = run_cli("healthcheck", env=env)  # nothing runs yet: says what it tried
    assert down.returncode == 1 and f"https://127.0.0.1:{port}/healthz" in down.stderr
    base = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}
    process = subprocess.Popen([sys.executable, "-m", "proxy", "serve"], env={**base, **env},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while run_cli("healthcheck", env=env).returncode != 0:
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        # "[::]" listens on IPv4 too.
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        # An egress proxy (here: nothing listens there) is not for the local probe, as in a
        # container whose HEALTHCHECK inherits HTTPS_PROXY.
        for variable in ("HTTPS_PROXY", "https_proxy"):
            result = run_cli("healthcheck",
                             env={**env, variable: f"http://127.0.0.1:{free_port()}"})
            assert result.returncode == 0, (variable, result.stderr)
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_client_config_with_auth_names_every_host_for_credentials(tmp_path: Path) -> None:
    config_file = tmp_path / "c.toml"
    config_file.write_text('[auth]\ntokens = ["abcdefghijklmnopqrstuvwxyz"]\n')
    text = render_client_config(load_config(config_file, environ={}), None)
    for host in ("127.0.0.1:8443", "registry.terraform.io", "registry.opentofu.org"):
        assert f'credentials "{host}" {{\n  token = "REPLACE-WITH-YOUR-TOKEN"\n}}' in text
    assert "abcdefghijklmnopqrstuvwxyz" not in text


def test_client_config_registry_mode() -> None:
    text = render_client_config(load_config(None, environ={}), None, "registry")
    assert "provider_installation" not in text
    for host in ("registry.terraform.io", "registry.opentofu.org"):
        assert (f'    "providers.v1" = "https://127.0.0.1:8443/providers/{host}/"\n'
                f'    "modules.v1" = "https://127.0.0.1:8443/modules/{host}/"') in text


def test_client_config_says_what_each_mode_writes_into_lock_files() -> None:
    config = load_config(None, environ={})
    mirror = render_client_config(config, None, "mirror")
    assert "Incomplete lock file information" in mirror
    assert "use `client-config --mode registry` instead" in mirror
    registry = render_client_config(config, None, "registry")
    assert "zh: hashes of every platform" in registry and "lock files to commit" in registry
    assert "--mode registry" in render_client_config(config, None, "oci")


def oci_mirror_of(parsed: dict[str, Any]) -> dict[str, Any]:
    """The one oci_mirror block, after checking it is the only installation method."""
    (installation,) = parsed["provider_installation"]
    assert set(installation) == {"oci_mirror"}, installation  # no direct, no network_mirror
    (mirror,) = installation["oci_mirror"]
    assert isinstance(mirror, dict)
    return mirror


def test_client_config_oci_mode_names_the_template_and_every_served_host(
        tmp_path: Path) -> None:
    config_file = tmp_path / "c.toml"
    config_file.write_text('[server]\npublic_url = "https://mirror.example.com"\n'
                           '[upstream]\nallowed_hosts = ["registry.opentofu.org", '
                           '"registry.terraform.io", "tf.corp.example"]\n')
    config = load_config(config_file, environ={})
    text = render_client_config(config, tmp_path / "ca.pem", "oci")
    parsed = parse_cli_config(text)
    mirror = oci_mirror_of(parsed)
    assert mirror["repository_template"] == (
        "mirror.example.com/providers/${hostname}/${namespace}/${type}")
    assert len(config.upstream.all_hosts) == 3
    assert sorted(mirror["include"]) == sorted(f"{h}/*/*" for h in config.upstream.all_hosts)
    assert "oci_credentials" not in parsed and "credentials" not in parsed
    # Modules still go through the proxy, by host blocks with modules.v1 only.
    hosts = {name: block for item in parsed["host"] for name, block in item.items()}
    assert hosts == {host: {"services": {
        "modules.v1": f"https://mirror.example.com/modules/{host}/"}}
        for host in config.upstream.all_hosts}
    assert f" {tmp_path}/ca.pem > ~/tfproxy-ca.pem" in text
    assert text.startswith("# OpenTofu CLI configuration")


async def test_client_config_oci_template_names_the_endpoints_repositories(
        client: TestClient, proxy_config: Config) -> None:  # type: ignore[type-arg]
    text = render_client_config(proxy_config, None, "oci")
    mirror = oci_mirror_of(parse_cli_config(text))
    assert "registry.terraform.io/*/*" in mirror["include"]
    # OpenTofu fills in the template, then splits the registry from the repository name.
    address = (mirror["repository_template"].replace("${hostname}", "registry.terraform.io")
               .replace("${namespace}", "hashicorp").replace("${type}", "null"))
    registry, _, repository = address.partition("/")
    assert registry == urlsplit(proxy_config.server.base_url).netloc
    response = await client.get(f"/v2/{repository}/tags/list")
    assert response.status == 200, await response.text()
    assert await response.json() == {"name": repository, "tags": ["3.1.0", "3.2.1"]}
    # The module source it shows, filled in: a module repository the endpoint serves.
    (source,) = [line.split('"')[1] for line in text.splitlines()
                 if line.startswith("#   source = \"oci://")]
    source = (source.replace("HOST", "registry.terraform.io").replace("NAMESPACE", "acme")
              .replace("NAME", "net").replace("SYSTEM", "aws").replace("VERSION", "1.2.0"))
    parts = urlsplit(source)
    assert parts.netloc == registry and parts.query == "tag=1.2.0"
    module = await client.head(f"/v2{parts.path}/manifests/1.2.0")
    assert module.status == 200, await module.text()


def test_client_config_oci_mode_with_auth_adds_oci_credentials_for_the_proxy(
        tmp_path: Path) -> None:
    config_file = tmp_path / "c.toml"
    config_file.write_text('[auth]\ntokens = ["abcdefghijklmnopqrstuvwxyz"]\n')
    text = render_client_config(load_config(config_file, environ={}), None, "oci")
    parsed = parse_cli_config(text)
    assert parsed["oci_credentials"] == [{"127.0.0.1:8443": {
        "username": "tofu", "password": "REPLACE-WITH-YOUR-TOKEN"}}]
    assert oci_mirror_of(parsed)["repository_template"].startswith("127.0.0.1:8443/providers/")
    # Registry modules through host blocks still need the token under every name.
    names = {name for item in parsed["credentials"] for name in item}
    assert names == {"127.0.0.1:8443", "registry.terraform.io", "registry.opentofu.org"}
    assert "abcdefghijklmnopqrstuvwxyz" not in text


def test_client_config_oci_mode_leaves_out_hosts_with_a_port(tmp_path: Path) -> None:
    # An OCI repository name cannot hold ':', so such a host cannot be in the template.
    config_file = tmp_path / "c.toml"
    config_file.write_text('[upstream]\nallowed_hosts = ["registry.opentofu.org", '
                           '"tf.corp.example:5000"]\n')
    text = render_client_config(load_config(config_file, environ={}), None, "oci")
    assert oci_mirror_of(parse_cli_config(text))["include"] == ["registry.opentofu.org/*/*"]
    assert "# use --mode mirror or registry for: tf.corp.example:5000" in text
    # With no host left, an empty include would mean every provider: refused, clearly.
    config_file.write_text('[upstream]\nallowed_hosts = ["tf.corp.example:5000"]\n')
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path)}
    result = run_cli("client-config", "--mode", "oci", "--config", str(config_file), env=env)
    assert result.returncode == 2
    assert "no upstream host can be named in an OCI repository" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_client_config_oci_mode_from_the_command_line(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path / "cache"), "XDG_STATE_HOME": str(tmp_path)}
    result = run_cli("client-config", "--mode", "oci", env=env)
    assert result.returncode == 0, result.stderr
    mirror = oci_mirror_of(parse_cli_config(result.stdout))
    assert mirror["repository_template"] == (
        "127.0.0.1:8443/providers/${hostname}/${namespace}/${type}")


def test_client_config_other_modes_parse_as_hcl(tmp_path: Path) -> None:
    config_file = tmp_path / "c.toml"
    config_file.write_text('[auth]\ntokens = ["abcdefghijklmnopqrstuvwxyz"]\n')
    for config in (load_config(None, environ={}), load_config(config_file, environ={})):
        mirror = parse_cli_config(render_client_config(config, None, "mirror"))
        assert mirror["provider_installation"] == [{"network_mirror": [
            {"url": "https://127.0.0.1:8443/mirror/"}]}]
        registry = parse_cli_config(render_client_config(config, None, "registry"))
        assert "provider_installation" not in registry
        assert len(registry["host"]) == len(config.upstream.all_hosts)
