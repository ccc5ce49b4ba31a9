"""Version managers install Terraform and OpenTofu through the proxy, as users run it (a
process over TLS): tfenv's and tenv's exact request sequences and a TofuDL mirror client,
each checking what they check, the binary unpacked and run; then with upstream down; and a
tampered or wrongly signed release refused by the proxy itself."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.fake_registry import FakeRegistry
from tests.support.fake_releases import release_requests
from tests.support.gpg import GpgKey
from tests.support.proxy_process import ProxyProcess, free_port
from tests.support.version_managers import InstallFailed, TenvTerraform, TenvTofu, Tfenv, TofuDl


@pytest.fixture
def proxy(tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry,
          release_keys: Path) -> Iterator[ProxyProcess]:
    port, cache = free_port(), tmp_path / "cache"
    config = write_config(extra=registry.cli.toml(release_keys), cache_dir=cache, port=port)
    with ProxyProcess(config, cache, port, tmp_path / "proxy.log") as process:
        yield process


def _runs(binary: Path) -> str:
    return subprocess.run([str(binary)], capture_output=True, text=True, check=True,
                          timeout=30).stdout


def _managers(proxy: ProxyProcess, signer: GpgKey) -> tuple[Tfenv, TenvTerraform, TenvTofu]:
    remote = proxy.url + "releases"
    return (Tfenv(remote, proxy.ca_file, keys=signer.armored_public_key.encode()),
            TenvTerraform(remote, proxy.ca_file, key_url=f"{remote}/keys/hashicorp.asc"),
            TenvTofu(remote, proxy.ca_file, key_url=f"{remote}/keys/opentofu.asc"))


def test_version_managers_install_the_pinned_cli_then_again_with_upstream_down(
        proxy: ProxyProcess, registry: FakeRegistry, signer: GpgKey, tmp_path: Path) -> None:
    for attempt in ("online", "upstream down"):
        tfenv, tenv_tf, tenv_tofu = _managers(proxy, signer)
        into = tmp_path / attempt.replace(" ", "-")
        assert tfenv.list_remote()[:2] == ["1.11.4", "1.10.5"]
        assert "Terraform v1.11.4" in _runs(tfenv.install("1.11.4", "linux_amd64",
                                                          into / "tfenv"))
        assert tenv_tf.list_remote() == ["1.11.4", "1.10.5"]
        assert "Terraform v1.10.5" in _runs(tenv_tf.install("1.10.5", "linux_amd64",
                                                            into / "tenv"))
        assert tenv_tofu.list_remote() == ["1.9.0", "1.8.8"]
        assert "OpenTofu v1.9.0" in _runs(tenv_tofu.install("1.9.0", "linux_amd64",
                                                            into / "tofuenv"))
        tofudl = TofuDl(proxy.url + "releases", proxy.ca_file)
        assert tofudl.versions(proxy.url + "releases/tofu/api.json") == ["1.9.0", "1.8.8"]
        template = (proxy.url + "releases/opentofu/opentofu/releases/download/"
                    "v{{ .Version }}/{{ .Artifact }}")
        release = registry.cli.releases[("opentofu", "1.9.0")]
        name = release.archive("linux_amd64", ".tar.gz")
        assert tofudl.artifact(template, "1.9.0", name) == release.files[name]
        if attempt == "online":
            assert len(release_requests(registry.requests)) == 4  # each archive once
            registry.faults.add("down")


def test_a_tampered_or_wrongly_signed_release_is_refused_and_not_kept(
        proxy: ProxyProcess, registry: FakeRegistry, signer: GpgKey, tmp_path: Path) -> None:
    tfenv, _tenv_tf, tenv_tofu = _managers(proxy, signer)
    registry.faults.add("tamper-release")
    # Refused by the proxy (an error, or the download cut off), not left to the client's
    # own checksum check.
    with pytest.raises(InstallFailed,
                       match=r"GET \S+" + re.escape("terraform_1.10.5_darwin_arm64.zip: ")):
        tfenv.install("1.10.5", "darwin_arm64", tmp_path / "tampered")
    registry.faults.clear()
    registry.faults.add("badsig-release")
    with pytest.raises(InstallFailed, match="HTTP 502"):
        tenv_tofu.install("1.8.8", "darwin_arm64", tmp_path / "badsig")
    registry.faults.clear()
    # Nothing bad was kept: both come from upstream again and install.
    assert "Terraform v1.10.5" in _runs(tfenv.install("1.10.5", "darwin_arm64",
                                                      tmp_path / "good"))
    assert "OpenTofu v1.8.8" in _runs(tenv_tofu.install("1.8.8", "darwin_arm64",
                                                        tmp_path / "good-tofu"))
    assert len([p for p in release_requests(registry.requests)
                if p.endswith("terraform_1.10.5_darwin_arm64.zip")]) == 2


def test_tfenv_with_a_replaced_key_file_refuses_a_signature_by_an_unrelated_key(
        proxy: ProxyProcess, registry: FakeRegistry, signer: GpgKey, tmp_path: Path) -> None:
    """The .72D7468F.sig tfenv asks for is made by a key the proxy was not given (the plain
    .sig is good): the proxy does not serve it, and tfenv's gpg check never runs on it."""
    tfenv, _tenv_tf, _tenv_tofu = _managers(proxy, signer)
    registry.faults.add("badsig-keyed")
    with pytest.raises(InstallFailed, match=re.escape(
            "terraform_1.10.5_SHA256SUMS.72D7468F.sig: HTTP 404")):
        tfenv.install("1.10.5", "linux_amd64", tmp_path / "unrelated")

