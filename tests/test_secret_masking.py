"""Credentials in module source URLs, presigned download URLs, git's output and our own
signed URLs never reach a client, a log line, /metrics or warm's output."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from aiohttp.test_utils import TestClient

import proxy
from proxy.airgap.sources import read_sources
from proxy.airgap.warm import summary, warm_cache
from proxy.config import Config
from tests.support.fake_registry import FakeRegistry
from tests.support.git_repos import publish_repo
from tests.support.proxy_process import ProxyProcess, free_port

HOST = "registry.terraform.io"
TOKEN = "client-token-0123456789"
MODULE_MAIN = b'output "x" {\n  value = 1\n}\n'

# name -> (location the registry answers, status the proxy answers, what its error says).
# Every secret contains "SECRET"; nothing else the tests see does.
LEAKS: dict[str, tuple[str, int, str]] = {
    "gitlab-token": ("git::https://user:glpat-SECRET@{host}/git/nosuch.git?ref=v1", 502,
                     "git clone of https://***@{host}/git/nosuch.git failed"),
    "oauth2-password": ("git::https://oauth2:Zq9SECRETq9Z@{host}/git/nosuch.git?ref=v1.0.0",
                        502, "git clone of https://***@{host}/git/nosuch.git failed"),
    # git itself prints a submodule's URL, credentials included, when its clone fails.
    "submodule": ("git::https://{host}/git/leaky.git?ref=v1.0.0", 502,
                  "clone of 'https://***@{host}/git/nosuch.git' into submodule path"),
    "query-token": ("https://{host}/archives/missing.tgz?token=SECRETtok&ref=main", 502,
                    "answered 404"),
    "amz-signature": ("https://{host}/archives/missing.tar.gz?X-Amz-Algorithm=AWS4-HMAC-SHA256"
                      "&X-Amz-Credential=AKIA%2FSECRETcred&X-Amz-Signature=SECRETsig"
                      "&X-Amz-Security-Token=SECRETst", 502, "answered 404"),
    "not-an-archive": ("https://{host}/archives/blob?X-Amz-Signature=SECRETsig", 502,
                       "blob?X-Amz-Signature=*** is not an archive"),
    "s3-keys": ("s3::https://AKIAEXAMPLE:SECRETkey@s3.amazonaws.com/b/m.zip", 502,
                "s3::https://***@s3.amazonaws.com/b/m.zip"),
    "plain-http": ("http://user:SECRETpw@{host}/archives/m.tgz", 502,
                   "must be fetched over https: http://***@{host}/archives/m.tgz"),
    # Long enough that a 200-character cut of the location falls inside the password.
    "cut-in-half": ("hg::https://" + "u" * 180 + ":SECRETcut@{host}/repo", 502,
                    "module source type 'hg' is not supported"),
    "working-presigned": ("https://{host}/archives/tarball-1.0.0.tgz?archive=tar.gz"
                          "&sig=SECRETok&token=SECRETok2", 200, ""),
}


@pytest.fixture(scope="module")
def leaky_modules(registry_server: FakeRegistry,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The LEAKS modules on the shared fake registry: acme/NAME/aws 1.0.0. Returns name ->
    what the error message must say."""
    host = f"127.0.0.1:{registry_server.port}"
    publish_repo(registry_server.git_root, "leaky", tmp_path_factory.mktemp("leaky") / "repo",
                 {"main.tf": MODULE_MAIN}, tag="v1.0.0",
                 submodules={"sub": (f"https://user:SECRETsub@{host}/git/nosuch.git",
                                     "1" * 40)})
    for name, (location, _status, _says) in LEAKS.items():
        registry_server.add_module("acme", name, "aws", "1.0.0", location.format(host=host))
    yield {name: says.format(host=host) for name, (_l, _s, says) in LEAKS.items()}
    for name in LEAKS:
        del registry_server.modules[("acme", name, "aws", "1.0.0")]


def assert_no_secret(*texts: str) -> None:
    for text in texts:
        assert "SECRET" not in text, text


@pytest.mark.parametrize("name", list(LEAKS))
async def test_module_source_secrets_stay_out_of_answers_logs_and_metrics(
        client: TestClient, registry: FakeRegistry, leaky_modules: dict[str, str],
        caplog: pytest.LogCaptureFixture, name: str) -> None:
    caplog.set_level(logging.DEBUG)
    download = await client.get(f"/modules/{HOST}/acme/{name}/aws/1.0.0/download")
    answer = await download.text()
    assert download.status == 200, answer  # the version exists; the archive tells the rest
    response = await client.get(urlsplit(json.loads(answer)["location"]).path)
    body = (await response.read()).decode("utf-8", "replace")
    assert response.status == LEAKS[name][1], body
    if response.status != 200:
        assert leaky_modules[name] in json.loads(body)["errors"][0]  # still says what failed
    metrics = await (await client.get("/metrics")).text()
    # The fake upstream runs in this process: its own access log is not the proxy's (the
    # proxy's access log is checked on the real server below).
    logged = "\n".join(logging.Formatter().format(r) for r in caplog.records
                       if r.name != "aiohttp.access")
    assert f"fetching module {HOST}/acme/{name}/aws 1.0.0" in logged \
        or name in ("s3-keys", "plain-http", "cut-in-half")  # refused before any fetch
    assert_no_secret(answer, body, logged, metrics)


async def test_presigned_provider_download_urls_are_masked_in_logs(
        client: TestClient, registry: FakeRegistry, caplog: pytest.LogCaptureFixture) -> None:
    registry.faults.add("expiring")  # download_url carries ?token=N, as presigned URLs do
    caplog.set_level(logging.INFO)
    response = await client.get("/mirror/registry.terraform.io/hashicorp/null/"
                                "terraform-provider-null_3.2.1_linux_amd64.zip")
    assert response.status == 200
    logged = "\n".join(r.getMessage() for r in caplog.records if r.name != "aiohttp.access")
    assert "terraform-provider-null_3.2.1_linux_amd64.zip?token=***" in logged
    assert not re.search(r"token=\d", logged)


async def test_warm_reports_failures_without_secrets(
        proxy_config: Config, registry: FakeRegistry, leaky_modules: dict[str, str],
        tmp_path: Path) -> None:
    listing = tmp_path / "wanted.txt"
    listing.write_text("".join(f"acme/{name}/aws 1.0.0\n" for name in LEAKS))
    out = io.StringIO()
    results = await warm_cache(proxy_config, read_sources([str(listing)]), ["linux_amd64"],
                               out=out)
    failed = [r for r in results if not r.ok]
    assert len(failed) == len(LEAKS) - 1  # the presigned one is warmed
    assert all("HTTP 502" in r.problems[0] for r in failed)
    assert_no_secret(out.getvalue(), summary(results), *(p for r in failed for p in r.problems))


def _get(url: str, context: ssl.SSLContext, token: str | None = None) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    context=context, timeout=60) as response:
            return response.status, response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


def test_served_logs_metrics_and_warm_output_hold_no_secrets(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry,
        leaky_modules: dict[str, str]) -> None:
    """The real `serve` process: its log (application and access lines), its answers and
    /metrics; and `warm --proxy` against it."""
    port = free_port()
    config = write_config(cache_dir=tmp_path / "served", port=port,
                          extra=f'[auth]\ntokens = ["{TOKEN}"]\n')
    log = tmp_path / "served.log"
    here = str(Path(proxy.__file__).resolve().parents[1])  # the package under test
    listing = tmp_path / "wanted.txt"
    listing.write_text("".join(f"acme/{name}/aws 1.0.0\n" for name in LEAKS))
    with ProxyProcess(config, tmp_path / "served", port, log,
                      env={"PYTHONPATH": here}) as served:
        context = ssl.create_default_context(cafile=str(served.ca_file))
        bodies = []
        for name in LEAKS:
            status, body = _get(f"{served.url}modules/{HOST}/acme/{name}/aws/1.0.0/download",
                                context, TOKEN)
            assert status == 200, body
            bodies.append(body)
            status, body = _get(json.loads(body)["location"], context)
            assert status == LEAKS[name][1], body
            bodies.append(body)
        # Our own signed archive URL: fetched without a token, its sig is the credential.
        status, body = _get(f"{served.url}modules/{HOST}/acme/tarball/aws/1.0.0/download",
                            context, TOKEN)
        assert status == 200, body
        location = json.loads(body)["location"]
        signature = parse_qs(urlsplit(location).query)["sig"][0]
        assert _get(location, context)[0] == 200
        metrics = _get(f"{served.url}metrics", context)[1]
        warmed = served.cli("warm", "--proxy", served.url, "--ca-file", str(served.ca_file),
                            "--token", TOKEN, str(listing))
    assert warmed.returncode == 1, warmed.stderr  # the leaky sources fail
    text = log.read_text()
    assert "fetching module" in text and '"GET /modules/' in text  # INFO and access lines
    assert "sig=***" in text and signature not in text
    assert TOKEN not in text
    assert_no_secret(text, metrics, warmed.stdout, warmed.stderr, *bodies)


def test_command_line_messages_hold_no_secrets(tmp_path: Path) -> None:
    """Problems the commands report quote what the user wrote, which may hold credentials."""
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path),
           "PYTHONPATH": str(Path(proxy.__file__).resolve().parents[1])}
    bad_config = tmp_path / "bad.toml"
    bad_config.write_text('[server]\npublic_url = "ftp://user:SECRETpw@mirror.example/"\n')
    listing = tmp_path / "wanted.txt"
    listing.write_text("git::https://oauth2:SECRETtok@gitlab.example/g/net.git\n")
    good_config = tmp_path / "good.toml"
    good_config.write_text(f'[cache]\ndir = "{tmp_path / "cache"}"\n')
    for args, says in ((["client-config", "--config", str(bad_config)],
                        "got 'ftp://***@mirror.example/'"),
                       (["warm", "--config", str(good_config), str(listing)],
                        "'git::https://***@gitlab.example/g/net.git' is not a")):
        result = subprocess.run([sys.executable, "-m", "proxy", *args], capture_output=True,
                                text=True, env=env, timeout=60, cwd=tmp_path)
        assert result.returncode == 2, result.stderr
        assert says in result.stderr
        assert_no_secret(result.stdout, result.stderr)
