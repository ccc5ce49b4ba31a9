"""The WARNING line that tells an operator why a Terraform user's request was refused: one per
artifact and reason (rate-limited), naming the artifact, the status, the reason and what to
do; nothing for requests that name no artifact (scanners, typos), so they cannot flood the
log."""

from __future__ import annotations

import logging

import pytest
from aiohttp.test_utils import TestClient

from proxy.core.errors import (
    BadRequest,
    FilteredOut,
    HostNotServed,
    InsufficientStorage,
    IntegrityError,
    NotFound,
    Offline,
    ProxyError,
    Unauthorized,
    Unavailable,
    UpstreamError,
    UpstreamTimeout,
)
from proxy.core.log_limits import KeyedRateLimitedLog
from proxy.web.error_warnings import ErrorWarnings, artifact_named
from tests.conftest import AppClient

LOGGER = "proxy.web.error_warnings"
NULL = {"hostname": "registry.terraform.io", "namespace": "hashicorp", "type": "null"}
NET = {"hostname": "registry.terraform.io", "namespace": "acme", "name": "net",
       "system": "aws"}
SUMS = "0123456789abcdef0123456789abcdef"


def warnings_logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == LOGGER and r.levelno == logging.WARNING]


# --- the rate limit -----------------------------------------------------------------------

def test_one_line_per_key_per_interval_then_the_count_of_dropped_ones(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    lines = KeyedRateLimitedLog(logging.getLogger("test.keyed"), interval=60,
                                clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="test.keyed")
    assert lines.log("a", "about %s", "a")
    assert lines.log("b", "about %s", "b")  # another key has its own allowance
    for second in range(1, 59):
        now[0] = second
        assert not lines.log("a", "about %s", "a")
    now[0] = 61.0
    assert lines.log("a", "about %s", "a")
    assert [r.getMessage() for r in caplog.records] == [
        "about a", "about b",
        "about a (58 more like it in the last 61s were not logged)"]


def test_many_keys_cannot_flood_the_log(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    lines = KeyedRateLimitedLog(logging.getLogger("test.keyed"), interval=60, max_lines=3,
                                max_keys=10, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="test.keyed")
    logged = [lines.log(n, "artifact %d", n) for n in range(50)]
    assert logged == [True] * 3 + [False] * 47
    now[0] = 60.0
    assert lines.log("new", "artifact %s", "new")
    assert [r.getMessage() for r in caplog.records] == [
        "artifact 0", "artifact 1", "artifact 2",
        "artifact new (47 other warnings were not logged: too many at once)"]
    assert len(lines._limits) == 10  # the least recently used keys are forgotten


# --- which requests name an artifact --------------------------------------------------------

@pytest.mark.parametrize(("route", "params", "named"), [
    ("mirror", {**NULL, "name": "index.json"}, "provider registry.terraform.io/hashicorp/null"),
    ("mirror", {**NULL, "name": "3.2.1.json"},
     "provider registry.terraform.io/hashicorp/null 3.2.1"),
    ("mirror", {**NULL, "name": "terraform-provider-null_3.2.1_linux_amd64.zip"},
     "provider registry.terraform.io/hashicorp/null 3.2.1 linux_amd64"),
    ("mirror", {**NULL, "hostname": "Registry.Terraform.IO:443", "name": "index.json"},
     "provider registry.terraform.io/hashicorp/null"),
    ("provider_versions", NULL, "provider registry.terraform.io/hashicorp/null"),
    ("provider_download", {**NULL, "version": "3.2.1", "os": "darwin", "arch": "arm64"},
     "provider registry.terraform.io/hashicorp/null 3.2.1 darwin_arm64"),
    ("provider_sums", {**NULL, "version": "3.2.1", "sums": SUMS, "file": "SHA256SUMS.sig"},
     "provider registry.terraform.io/hashicorp/null 3.2.1"),
    ("module_versions", NET, "module registry.terraform.io/acme/net/aws"),
    ("module", {**NET, "version": "1.2.0", "action": "download"},
     "module registry.terraform.io/acme/net/aws 1.2.0"),
    ("module", {**NET, "version": "1.2.0", "action": "net-aws-1.2.0.tar.gz"},
     "module registry.terraform.io/acme/net/aws 1.2.0"),
    # Names no artifact, or not validly: what scanners and typos send.
    ("mirror", {**NULL, "name": "wp-login.php"}, None),
    ("mirror", {**NULL, "name": "not-a-version.json"}, None),
    ("mirror", {**NULL, "name": "terraform-provider-random_3.6.0_linux_amd64.zip"}, None),
    ("mirror", {**NULL, "hostname": "10.0.0.1", "name": "index.json"}, None),
    ("mirror", {**NULL, "namespace": "has space", "name": "index.json"}, None),
    ("provider_sums", {**NULL, "version": "3.2.1", "sums": "x", "file": "SHA256SUMS"}, None),
    ("provider_sums", {**NULL, "version": "3.2.1", "sums": SUMS, "file": "etc"}, None),
    ("module", {**NET, "version": "1.2.0", "action": ".env"}, None),
    ("unmatched", {"path": "mirror/registry.terraform.io/hashicorp/null/index.json"}, None),
    ("healthz", {}, None),
    ("metrics", {}, None),
])
def test_the_artifact_a_request_names(route: str, params: dict[str, str],
                                      named: str | None) -> None:
    assert artifact_named(route, params) == named


@pytest.mark.parametrize("error", [
    HostNotServed("host evil.example.com is not served by this proxy"),
    FilteredOut("linux_arm packages are not served by this proxy (filters)"),
    NotFound("registry.terraform.io/hashicorp/null has no version 9.9.9"),
    Offline("no version of registry.terraform.io/hashicorp/null is in the cache, and the "
            "proxy is offline"),
    Unauthorized("a bearer token is required"),
    UpstreamError("cannot reach upstream registry.terraform.io: connection refused"),
    UpstreamTimeout("upstream registry.terraform.io did not answer in time"),
    IntegrityError("checksum", "package sha256 abc does not match the SHA256SUMS entry"),
    InsufficientStorage("the proxy's cache disk is full"),
    Unavailable("the object store is unreachable"),
])
def test_each_reason_gets_its_own_advice_in_one_line(
        error: ProxyError, caplog: pytest.LogCaptureFixture) -> None:
    warnings = ErrorWarnings()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(3):
            warnings.refused("mirror", {**NULL, "name": "3.2.1.json"}, "/mirror/x", error)
    [line] = warnings_logged(caplog)
    assert line == (f"provider registry.terraform.io/hashicorp/null 3.2.1: answered "
                    f"{error.status}, {error.message}; what to do: {error.advice}")
    assert error.advice != ProxyError.advice


def test_advice_differs_for_each_kind_of_refusal() -> None:
    kinds: list[type[ProxyError]] = [
        BadRequest, Unauthorized, NotFound, HostNotServed, FilteredOut, Offline, Unavailable,
        UpstreamError, IntegrityError, UpstreamTimeout, InsufficientStorage]
    assert len({kind.advice for kind in kinds}) == len(kinds)


def test_secrets_in_the_reason_are_masked(caplog: pytest.LogCaptureFixture) -> None:
    error = UpstreamError("x")
    error.message = "upstream https://user:glpat-SECRETSECRET@git.example.com failed"
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        ErrorWarnings().refused("module", {**NET, "version": "1.2.0", "action": "download"},
                                "/modules/x", error)
    [line] = warnings_logged(caplog)
    assert "SECRETSECRET" not in line and "module registry.terraform.io/acme/net/aws" in line


def test_no_artifact_no_warning_but_a_5xx_is_still_news(
        caplog: pytest.LogCaptureFixture) -> None:
    warnings = ErrorWarnings()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        warnings.refused("unmatched", {"path": "wp-login.php"}, "/wp-login.php", NotFound("no"))
        warnings.refused("mirror", {**NULL, "name": "3.2.1.json"}, "/mirror/x",
                         BadRequest("dot segments are not allowed in paths"))
        for _ in range(2):
            warnings.refused("metrics", {}, "/metrics", Unavailable("store down"))
    assert warnings_logged(caplog) == ["/metrics -> 503: store down"]


def test_an_answer_cut_off_mid_download_is_explained_once(
        caplog: pytest.LogCaptureFixture) -> None:
    warnings = ErrorWarnings()
    error = IntegrityError("checksum", "package sha256 abc does not match the signed checksum")
    params = {**NULL, "name": "terraform-provider-null_3.2.1_linux_amd64.zip"}
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert all(warnings.cut_off("mirror", params, error) for _ in range(3))
        assert not warnings.cut_off("mirror", {**NULL, "name": "x.php"}, error)
    assert warnings_logged(caplog) == [
        "provider registry.terraform.io/hashicorp/null 3.2.1 linux_amd64: cut off "
        f"mid-download, {error.message}; what to do: {IntegrityError.advice}"]


# --- through the app ------------------------------------------------------------------------

SCANNER_PATHS = [
    "/wp-login.php", "/.env", "/admin/config.php", "/mirror/", "/mirror/a/b/c/d/e",
    "/mirror/registry.terraform.io/hashicorp/null/wp-login.php",
    "/mirror/registry.terraform.io/hashicorp/null/1.0.json",
    "/mirror/bad_host!/x/y/index.json", "/mirror/127.0.0.1/x/y/index.json",
    "/providers/registry.terraform.io/hashicorp/null/x/download/linux/amd64",
    "/modules/registry.terraform.io/acme/net/aws/1.2.0/../../etc/passwd",
    "/mirror/registry.terraform.io/hashicorp/null/%2e%2e/index.json",
]


async def test_requests_that_name_no_artifact_log_no_warning(
        client: TestClient, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[type-arg]
    with caplog.at_level(logging.WARNING, logger="proxy"):
        for path in SCANNER_PATHS:
            response = await client.get(path)
            assert 400 <= response.status < 500, path
        response = await client.post("/mirror/registry.terraform.io/hashicorp/null/index.json")
        assert response.status == 405
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_a_refused_artifact_is_one_warning_however_often_it_is_asked(
        make: AppClient, caplog: pytest.LogCaptureFixture) -> None:
    client = await make()
    with caplog.at_level(logging.WARNING, logger="proxy"):
        for _ in range(5):
            response = await client.get("/mirror/evil.example.com/acme/thing/index.json")
            assert response.status == 404
        for _ in range(2):  # Terraform's mirror client also asks for the version document
            response = await client.get("/mirror/evil.example.com/acme/thing/1.0.0.json")
            assert response.status == 404
    assert warnings_logged(caplog) == [
        "provider evil.example.com/acme/thing: answered 404, host evil.example.com is not "
        f"served by this proxy; what to do: {HostNotServed.advice}",
        "provider evil.example.com/acme/thing 1.0.0: answered 404, host evil.example.com is "
        f"not served by this proxy; what to do: {HostNotServed.advice}"]


async def test_a_filtered_platform_and_an_unauthenticated_client_are_explained(
        make: AppClient, caplog: pytest.LogCaptureFixture) -> None:
    client = await make(extra='[filters]\nplatforms = ["darwin_*"]\n'
                              '[auth]\ntokens = ["a-troubleshooting-token-0123456789"]\n')
    token = {"Authorization": "Bearer a-troubleshooting-token-0123456789"}
    zip_path = ("/mirror/registry.terraform.io/hashicorp/null/"
                "terraform-provider-null_3.2.1_linux_amd64.zip")
    with caplog.at_level(logging.WARNING, logger="proxy"):
        assert (await client.get(zip_path, headers=token)).status == 404
        assert (await client.get("/mirror/registry.terraform.io/hashicorp/null/index.json")
                ).status == 401
    assert warnings_logged(caplog) == [
        "provider registry.terraform.io/hashicorp/null 3.2.1 linux_amd64: answered 404, "
        f"linux_amd64 packages are not served by this proxy (filters); what to do: "
        f"{FilteredOut.advice}",
        "provider registry.terraform.io/hashicorp/null: answered 401, a bearer token is "
        "required (Terraform: a credentials block or TF_TOKEN_ variable for this proxy's "
        f"hostname); what to do: {Unauthorized.advice}"]
