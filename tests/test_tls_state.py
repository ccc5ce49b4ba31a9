"""The generated CA is state that clients trust, not cache: it survives clearing the cache,
is never replaced without `tls rotate`, and names outside it stop `serve` with a clear
message. Run as users run it, with the default state directory (XDG_STATE_HOME)."""

from __future__ import annotations

import shutil
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.proxy_process import ProxyProcess, free_port


def minimal_config(tmp_path: Path, port: int) -> Path:
    """Only what an operator sets first: the port and the cache directory."""
    path = tmp_path / "proxy.toml"
    path.write_text(f'[server]\nlisten = "127.0.0.1:{port}"\n\n[cache]\ndir = "{tmp_path}/cache"\n')
    return path


def healthz(proxy: ProxyProcess, ca_file: Path) -> int:
    context = ssl.create_default_context(cafile=str(ca_file))
    with urllib.request.urlopen(f"{proxy.url}healthz", context=context, timeout=10) as answer:
        return int(answer.status)


def test_clearing_the_cache_keeps_the_ca(tmp_path: Path) -> None:
    port, cache = free_port(), tmp_path / "cache"
    config = minimal_config(tmp_path, port)
    with ProxyProcess(config, cache, port, tmp_path / "first.log") as first:
        ca_file = first.ca_file
        ca = ca_file.read_bytes()
    assert not ca_file.is_relative_to(cache)
    assert ca_file == Path(f"{cache}-state/tf-registry-proxy/tls/ca.pem")  # XDG_STATE_HOME

    shutil.rmtree(cache)  # what the README's "Clearing the cache" says to do
    with ProxyProcess(config, cache, port, tmp_path / "second.log") as second:
        assert second.ca_file == ca_file and ca_file.read_bytes() == ca
        assert healthz(second, ca_file) == 200
    assert "created a CA" not in (tmp_path / "second.log").read_text()


def test_names_outside_the_ca_stop_serve_until_tls_rotate(tmp_path: Path) -> None:
    port, cache = free_port(), tmp_path / "cache"
    config = minimal_config(tmp_path, port)
    with ProxyProcess(config, cache, port, tmp_path / "first.log") as first:
        ca_file = first.ca_file
        old_ca = tmp_path / "old-ca.pem"
        shutil.copy(ca_file, old_ca)

    public_url = {"TF_REGISTRY_PROXY_SERVER_PUBLIC_URL": f"https://mirror.corp.example:{port}/"}
    # 192.0.2.1 (TEST-NET-1) is no address of this machine: the CA must be kept even though
    # the bind would fail.
    for env, named in (({"TF_REGISTRY_PROXY_SERVER_LISTEN": f"192.0.2.1:{port}"},
                        "server.listen names 192.0.2.1"),
                       (public_url, "server.public_url names mirror.corp.example")):
        refused = first.cli("serve", env=env, timeout=30)
        assert refused.returncode == 2, refused.stderr
        assert named in refused.stderr and "tf-registry-proxy tls rotate" in refused.stderr
        assert "Traceback" not in refused.stderr
        assert ca_file.read_bytes() == old_ca.read_bytes()  # clients still trust it

    rotated = first.cli("tls", "rotate", env=public_url)
    assert rotated.returncode == 0, rotated.stderr
    assert str(ca_file) in rotated.stdout
    assert ca_file.read_bytes() != old_ca.read_bytes()
    shown = first.cli("tls", "show", env=public_url)
    assert shown.returncode == 0, shown.stderr
    assert f"CA: {ca_file}" in shown.stdout and "mirror.corp.example" in shown.stdout

    with ProxyProcess(config, cache, port, tmp_path / "rotated.log", env=public_url) as proxy:
        assert proxy.ca_file == ca_file
        assert healthz(proxy, ca_file) == 200
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            healthz(proxy, old_ca)  # a client left with the old CA fails, loudly


def test_a_ca_from_the_old_cache_location_is_adopted(tmp_path: Path) -> None:
    """Earlier versions kept the CA and the URL-signing key under <cache.dir>/tls."""
    port, cache = free_port(), tmp_path / "cache"
    config = minimal_config(tmp_path, port)
    with ProxyProcess(config, cache, port, tmp_path / "first.log") as first:
        state = first.ca_file.parent.parent
    legacy = cache / "tls"
    shutil.move(state / "tls", legacy)  # the layout an earlier version left behind
    (legacy / "url-signing.key").write_bytes(b"k" * 32)
    shutil.rmtree(state)
    ca = (legacy / "ca.pem").read_bytes()

    with ProxyProcess(config, cache, port, tmp_path / "second.log") as second:
        assert second.ca_file == state / "tls" / "ca.pem"
        assert second.ca_file.read_bytes() == ca  # clients keep trusting it
        assert (state / "url-signing.key").read_bytes() == b"k" * 32
        assert (state / "url-signing.key").stat().st_mode & 0o077 == 0
    log = (tmp_path / "second.log").read_text()
    assert "INFO proxy.tls.state: adopted" in log and str(legacy) in log
    assert "created a CA" not in log
