"""What a running proxy writes on stderr: with log_format = "json" every line is a JSON object,
with access_log = "json" every access line is one whatever the rest; the start-up log is
written once (by the parent of the workers), says what operators need, and no secret."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from proxy.cli.logs import JsonLineFormatter
from proxy.cli.startup import startup_lines
from proxy.config import load_config
from proxy.core.redaction import SecretMaskingFilter
from tests.support.fake_registry import FakeRegistry
from tests.support.proxy_process import ProxyProcess, free_port
from tests.support.s3_replicas import s3_env, s3_table
from tests.support.seaweedfs import S3Server

CLIENT_TOKEN = "client-token-NEVER-LOGGED-0123456789"
HOST_TOKEN = "host-token-NEVER-LOGGED"
ENV_TOKEN = "env-token-NEVER-LOGGED"
SERVICE_PASSWORD = "service-password-NEVER-LOGGED"
TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR) ")


def _run_proxy(tmp_path: Path, write_config: Callable[..., Path], s3_server: S3Server,
               log_format: str) -> tuple[str, S3Server]:
    """A proxy with 2 workers, its cache in a bucket, client tokens and upstream credentials
    set; a few requests; its whole output once stopped."""
    bucket = s3_server.new_bucket()
    extra = s3_table(s3_server, bucket) + f"""
[auth]
tokens = ["{CLIENT_TOKEN}"]

[upstream.hosts."private.example"]
token = "{HOST_TOKEN}"

[upstream.hosts."private.example".services]
"providers.v1" = "https://svc:{SERVICE_PASSWORD}@private.example/v1/providers/"
"""
    port, cache = free_port(), tmp_path / "cache"
    env = {**s3_env(s3_server), "TF_TOKEN_registry_terraform_io": ENV_TOKEN,
           "TF_REGISTRY_PROXY_SERVER_WORKERS": "2",
           "TF_REGISTRY_PROXY_SERVER_LOG_FORMAT": log_format,
           "TF_REGISTRY_PROXY_SERVER_ACCESS_LOG": "json"}
    proxy = ProxyProcess(write_config(extra=extra, cache_dir=cache, port=port), cache, port,
                         tmp_path / "proxy.log", env=env)
    with proxy:
        for _ in range(6):
            proxy.get("/healthz")
        proxy.get(f"/readyz?token={CLIENT_TOKEN}")  # a secret in a URL: masked in the log
    return proxy.log.read_text(), s3_server


def _assert_startup_once(messages: list[str], s3_server: S3Server) -> None:
    def once(pattern: str) -> str:
        found = [m for m in messages if re.search(pattern, m)]
        assert len(found) == 1, (pattern, found)
        return found[0]

    first = once(r"^tf-registry-proxy \S+ starting, online; server\.listen 127\.0\.0\.1:\d+, "
                 r"clients use https://127\.0\.0\.1:\d+/, ")
    assert "2 worker processes" in first
    once(r"clients add the CA \S+ to their trust")
    hosts = once(r"^upstream hosts allowed: ")
    assert "registry.terraform.io" in hosts and "private.example" in hosts
    assert "providers.v1 https://***@private.example/v1/providers/" in hosts
    assert once(r"^upstream credentials configured for: ") == (
        "upstream credentials configured for: private.example, registry.terraform.io")
    cache = once(r"^cache: S3 bucket ")
    assert "prefix 'tfproxy/'" in cache and s3_server.endpoint_url in cache
    once(r"^limits: 1000 connections and 8 upstream fills at once per worker")
    once(r"^client authentication: on \(1 token")
    once(r"^access log: json; audit log: ")


def _assert_no_secret(output: str, s3_server: S3Server) -> None:
    for secret in (CLIENT_TOKEN, HOST_TOKEN, ENV_TOKEN, SERVICE_PASSWORD, s3_server.access_key,
                   s3_server.secret_key):
        assert secret not in output


def test_json_logs_are_json_lines_only(tmp_path: Path, write_config: Callable[..., Path],
                                       registry: FakeRegistry, s3_server: S3Server) -> None:
    output, s3 = _run_proxy(tmp_path, write_config, s3_server, "json")
    lines = [json.loads(line) for line in output.splitlines() if line]  # every line
    assert all(isinstance(line, dict) and line["time"].endswith("Z") for line in lines)
    application = [line for line in lines if line["logger"] != "proxy.access"]
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in application)
    _assert_startup_once([line["message"] for line in application], s3)
    startup = next(line for line in application if "starting" in line["message"])
    assert "worker" not in startup  # the parent's
    assert {line.get("worker") for line in application} >= {None, 0, 1}
    access = [line for line in lines if line["logger"] == "proxy.access"]
    health = [line for line in access if line["path"] == "/healthz"]
    assert len(health) >= 6 and all(line["status"] == 200 for line in health)
    assert {line["worker"] for line in access} <= {0, 1}
    assert any(line["path"] == "/readyz?token=***" for line in access)
    _assert_no_secret(output, s3)


def test_text_logs_with_json_access_lines(tmp_path: Path, write_config: Callable[..., Path],
                                          registry: FakeRegistry, s3_server: S3Server) -> None:
    output, s3 = _run_proxy(tmp_path, write_config, s3_server, "text")
    access: list[dict[str, Any]] = []
    messages = []
    for line in output.splitlines():
        if line.startswith("{"):
            access.append(json.loads(line))  # pure JSON: nothing before or after it
        elif line:
            assert TEXT_LINE.match(line), line
            messages.append(line.split(": ", 1)[1])
    assert all(line["logger"] == "proxy.access" for line in access)
    assert len([line for line in access if line["path"] == "/healthz"]) >= 6
    _assert_startup_once(messages, s3)
    _assert_no_secret(output, s3)


@pytest.mark.parametrize("worker", [None, 3])
def test_a_json_line_carries_the_masked_exception(worker: int | None) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonLineFormatter(worker))
    handler.addFilter(SecretMaskingFilter())
    logger = logging.getLogger("proxy.test_json_lines")
    logger.addHandler(handler)
    try:
        try:
            raise RuntimeError("git clone https://u:SECRET1@h/x.git failed\nsecond line")
        except RuntimeError:
            logger.error("fetching %s failed", "https://h/x?token=SECRET2", exc_info=True)
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert text.count("\n") == 1 and "SECRET" not in text
    line = json.loads(text)
    assert line["message"] == "fetching https://h/x?token=*** failed"
    assert (line["level"], line["logger"]) == ("ERROR", "proxy.test_json_lines")
    assert "RuntimeError: git clone https://***@h/x.git failed" in line["exception"]
    assert line.get("worker") == worker


def test_startup_lines_of_an_offline_proxy_on_a_directory(
        write_config: Callable[..., Path]) -> None:
    config = load_config(write_config(), environ={
        "TF_REGISTRY_PROXY_UPSTREAM_MODE": "offline", "TF_REGISTRY_PROXY_SERVER_WORKERS": "1",
        "TF_REGISTRY_PROXY_CACHE_MAX_SIZE": "10GiB"})
    lines = startup_lines(config, None)
    assert lines[0].startswith("tf-registry-proxy ") and "starting, offline: upstream is " \
        "never contacted" in lines[0] and lines[0].endswith(", 1 worker process")
    assert f"cache: directory {config.cache.dir} (at most 10 GiB)" in lines
    assert "client authentication: off" in lines
    assert not any("the CA" in line or "credentials" in line for line in lines)
