"""Configuration loading: defaults, overrides, and every problem reported at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.config import (
    ConfigError,
    default_cache_dir,
    default_state_dir,
    load_config,
    parse_size,
)
from proxy.core.cpus import process_cpus


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_no_file_means_defaults() -> None:
    config = load_config(None, environ={})
    assert (config.server.host, config.server.port) == ("127.0.0.1", 8443)
    assert config.server.base_url == "https://127.0.0.1:8443/"
    assert config.cache.dir == default_cache_dir()
    assert config.server.state_dir == default_state_dir() != config.cache.dir
    assert config.upstream.allowed_hosts == ("registry.terraform.io", "registry.opentofu.org")
    assert config.upstream.ca_bundle is None
    assert config.upstream.hosts == {}
    assert config.server.shutdown_timeout == 30


def test_shutdown_timeout_is_read_and_checked(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nshutdown_timeout = 2.5\n")
    assert load_config(path, environ={}).server.shutdown_timeout == 2.5
    environ = {"TF_REGISTRY_PROXY_SERVER_SHUTDOWN_TIMEOUT": "7"}
    assert load_config(None, environ=environ).server.shutdown_timeout == 7
    # float() reads "٣" (Arabic-Indic 3) as 3: numbers are ASCII digits, as everywhere else.
    for bad in ("-1", "0", "soon", "inf", "\u0663", "1\u0663.5"):
        with pytest.raises(ConfigError) as caught:
            load_config(None, environ={"TF_REGISTRY_PROXY_SERVER_SHUTDOWN_TIMEOUT": bad})
        assert caught.value.problems[0].startswith("server.shutdown_timeout: expected a "), bad


def test_every_setting_of_a_full_file_is_read(tmp_path: Path, upstream_ca_file: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_bytes(upstream_ca_file.read_bytes())
    (tmp_path / "c.pem").write_text("")
    (tmp_path / "k.pem").write_text("")
    config = load_config(write(tmp_path, f"""
[server]
listen = "0.0.0.0:9443"
tls_cert = "{tmp_path}/c.pem"
tls_key = "{tmp_path}/k.pem"
public_url = "https://mirror.example:9443"
[cache]
dir = "{tmp_path}/cache"
[upstream]
ca_bundle = "{ca}"
allowed_hosts = ["Registry.Terraform.IO", "bücher.example:443", "private.example:8443"]
versions_ttl = 60
max_archive_size = "512MiB"
[upstream.hosts."registry.terraform.io".services]
"providers.v1" = "https://127.0.0.1:1234/v1/providers"
"modules.v1" = "https://127.0.0.1:1234/v1/modules/"
"""), environ={})
    assert (config.server.host, config.server.port) == ("0.0.0.0", 9443)
    assert config.server.base_url == "https://mirror.example:9443/"
    assert config.cache.dir == tmp_path / "cache"
    assert config.upstream.allowed_hosts == (
        "registry.terraform.io", "xn--bcher-kva.example", "private.example:8443")
    assert config.upstream.versions_ttl == 60
    assert config.upstream.max_archive_size == 512 * 2**20
    services = config.upstream.hosts["registry.terraform.io"].services
    assert services["providers.v1"] == "https://127.0.0.1:1234/v1/providers/"
    assert "private.example:8443" in config.upstream.all_hosts


def test_every_problem_is_reported_at_once(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, """
[server]
listen = "nonsense"
tls_cert = "/only/cert.pem"
public_url = "http://plain.example/"
colour = "blue"
[upstream]
ca_bundle = "/no/such/ca.pem"
allowed_hosts = ["ok.example", "bad host"]
versions_ttl = -1
max_archive_size = "lots"
[upstream.hosts."x.example"]
services = { "providers.v1" = "http://x.example/", "login.v1" = "https://x.example/" }
"""), environ={})
    problems = "\n".join(caught.value.problems)
    for key in ("server.listen", "server.tls_cert and server.tls_key", "server.public_url",
                "server.colour: unknown key", "upstream.ca_bundle", "upstream.allowed_hosts",
                "upstream.versions_ttl", "upstream.max_archive_size",
                "services.providers.v1: expected an https URL", "unknown service 'login.v1'",
                "server.tls_cert: no such file"):
        assert key in problems, key
    assert len(caught.value.problems) == 11


def test_a_mistyped_key_is_answered_with_the_key_it_resembles(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, """
[server]
lisen = "127.0.0.1:8443"
[cache]
max_sise = "1GiB"
[upstream]
allowed_host = ["registry.terraform.io"]
nonsense_entirely = 1
"""), environ={})
    assert caught.value.problems == [
        "server.lisen: unknown key (did you mean server.listen?)",
        "cache.max_sise: unknown key (did you mean cache.max_size?)",
        "upstream.allowed_host: unknown key (did you mean upstream.allowed_hosts?)",
        "upstream.nonsense_entirely: unknown key"]


def test_invalid_toml_is_one_clear_problem(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, "[server\n"), environ={})
    assert "invalid TOML" in caught.value.problems[0]


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "absent.toml", environ={})


def test_environment_overrides_and_config_path(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nlisten = "127.0.0.1:1"\n')
    config = load_config(None, environ={
        "TF_REGISTRY_PROXY_CONFIG": str(path),
        "TF_REGISTRY_PROXY_SERVER_LISTEN": "[::1]:9000",
        "TF_REGISTRY_PROXY_CACHE_DIR": str(tmp_path / "elsewhere"),
        "TF_REGISTRY_PROXY_UPSTREAM_DISCOVERY_TTL": "5",
        "TF_REGISTRY_PROXY_SERVER_STATE_DIR": str(tmp_path / "state"),
    })
    assert (config.server.host, config.server.port) == ("::1", 9000)
    assert config.server.base_url == "https://[::1]:9000/"
    assert config.cache.dir == tmp_path / "elsewhere"
    assert config.server.state_dir == tmp_path / "state"
    assert config.upstream.discovery_ttl == 5


@pytest.mark.parametrize(("text", "expected"), [
    (1024, 1024), ("1024", 1024), ("2KiB", 2048), ("3 MB", 3_000_000), ("1GiB", 2**30),
    ("x", None), (True, None), ("1.5GiB", None), ("\u0663 MiB", None),  # a Unicode digit
])
def test_sizes_parse_with_units_and_nonsense_is_refused(text: object, expected: int | None) -> None:
    assert parse_size(text) == expected


def test_example_config_is_valid_and_documents_every_key() -> None:
    example = Path(__file__).parent.parent / "config.example.toml"
    text = example.read_text()
    config = load_config(example, environ={})
    assert config.upstream.allowed_hosts == ("registry.terraform.io", "registry.opentofu.org")
    for key in ("listen", "tls_cert", "tls_key", "public_url", "log_level", "dir",
                "ca_bundle", "allowed_hosts", "discovery_ttl", "versions_ttl",
                "connect_timeout", "metadata_timeout", "download_timeout",
                "max_archive_size", "services", "default_host", "git_timeout", "max_size",
                "mode", "max_concurrent_fills", "allowed_networks", "internal_zones",
                "access_log", "log_format", "token",
                "providers", "exclude_providers", "modules", "exclude_modules", "platforms",
                "tokens", "tokens_file", "signed_url_ttl", "workers", "event_loop",
                "shutdown_timeout", "state_dir"):
        assert f"{key} =" in text, key


def test_more_problems_users_make(tmp_path: Path) -> None:
    not_pem = tmp_path / "hostname"
    not_pem.write_text("myhost\n")
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, f"""
[server]
listen = "127.0.0.1:99999"
public_url = "https://mirror.example/tf/"
log_format = "xml"
[upstream]
ca_bundle = "{not_pem}"
versions_ttl = nan
connect_timeout = inf
[modules]
default_host = "elsewhere.example"
"""), environ={"TF_REGISTRY_PROXY_SERVER_LISTENN": "x"})
    problems = "\n".join(caught.value.problems)
    for expected in ("server.listen: expected \"host:port\" with a port from 1 to 65535",
                     "server.public_url: a path prefix is not supported",
                     "server.log_format: expected text or json, got 'xml'",
                     "upstream.ca_bundle:", "no usable PEM CA certificate",
                     "upstream.versions_ttl", "upstream.connect_timeout",
                     "modules.default_host: elsewhere.example is not an allowed upstream host",
                     "TF_REGISTRY_PROXY_SERVER_LISTENN: unknown environment setting"):
        assert expected in problems, expected


def test_cache_size_mode_and_fill_cap(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, """
[cache]
max_size = "50GiB"
[upstream]
mode = "offline"
max_concurrent_fills = 2
"""), environ={})
    assert config.cache.max_size == 50 * 2**30
    assert config.upstream.offline and config.upstream.max_concurrent_fills == 2
    assert load_config(None, environ={}).cache.max_size is None
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, '[cache]\nmax_size = "lots"\n[upstream]\nmode = "sometimes"'
                                    '\nmax_concurrent_fills = 0\n'), environ={})
    assert len(caught.value.problems) == 3


def test_workers_default_to_one_per_available_cpu_and_a_number_wins(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: {0, 1, 2, 3, 4}, raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 5)
    process_cpus.cache_clear()  # read once per process: read again under the patches
    request.addfinalizer(process_cpus.cache_clear)
    assert load_config(None, environ={}).server.workers == 5
    assert load_config(write(tmp_path, '[server]\nworkers = "auto"\n'),
                       environ={}).server.workers == 5
    assert load_config(write(tmp_path, "[server]\nworkers = 3\n"), environ={}).server.workers == 3
    environ = {"TF_REGISTRY_PROXY_SERVER_WORKERS": "2"}
    assert load_config(None, environ=environ).server.workers == 2
    for bad in ('"many"', "0", "true", "1.5", '"\u00b9"', '"\u0663"'):
        with pytest.raises(ConfigError, match=r'server\.workers: expected "auto"'):
            load_config(write(tmp_path, f"[server]\nworkers = {bad}\n"), environ={})


def test_a_port_written_in_other_digits_is_a_problem_not_a_crash(tmp_path: Path) -> None:
    # str.isdigit takes "¹" (int() raises on it) and "٣" (int() reads 3): neither is a port.
    for port in ("\u00b9", "\u0663"):
        with pytest.raises(ConfigError, match=r"server\.listen"):
            load_config(write(tmp_path, f'[server]\nlisten = "127.0.0.1:{port}"\n'), environ={})
