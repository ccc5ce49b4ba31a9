"""How failures are answered, with client authentication off and on: a handler's error, an
unexpected exception, a path no route serves, a method a route does not take, an odd path and
a failure after the headers went out each give the same answer, count and log line either way
(the error handling wraps every route, in front of authentication)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

import pytest
import trustme
from aiohttp.test_utils import TestClient
from yarl import URL

from proxy.app import create_app
from proxy.config import Config, load_config
from proxy.web.routes import MIRROR_KEY
from tests.support.fake_registry import FakeRegistry
from tests.support.metrics import sample
from tests.support.raw_http import raw_request, served

TOKEN = "an-error-test-token-0123456789"
BASE = "/mirror/registry.terraform.io/hashicorp/null"
ZIP = "terraform-provider-null_3.2.1_linux_amd64.zip"
REQUESTS = "tfproxy_http_requests_total"


@pytest.fixture(params=["auth off", "auth on"])
def config(request: pytest.FixtureRequest, write_config: Callable[..., Path]) -> Config:
    extra = f'[auth]\ntokens = ["{TOKEN}"]\n' if request.param == "auth on" else ""
    return load_config(write_config(extra=extra), environ={})


@pytest.fixture
async def client(aiohttp_client, config: Config) -> TestClient:  # type: ignore[no-untyped-def, type-arg]
    return await aiohttp_client(create_app(config))  # type: ignore[no-any-return]


def credentials(config: Config) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"} if config.auth.enabled else {}


async def metrics(client: TestClient) -> str:  # type: ignore[type-arg]
    return await (await client.get("/metrics")).text()


async def test_a_handlers_proxy_error_is_its_json_answer(
        client: TestClient, config: Config) -> None:  # type: ignore[type-arg]
    response = await client.get(f"{BASE}/not-a-version.json", headers=credentials(config))
    assert response.status == 400
    assert response.content_type == "application/json"
    assert "version" in (await response.json())["errors"][0]
    text = await metrics(client)
    assert sample(text, REQUESTS, route="mirror", status_class="4xx") == 1


async def test_an_unexpected_exception_is_a_json_500_logged_and_counted(
        client: TestClient, config: Config, monkeypatch: pytest.MonkeyPatch,  # type: ignore[type-arg]
        caplog: pytest.LogCaptureFixture) -> None:
    async def broken(*_args: object) -> None:
        raise RuntimeError("a bug with internal details")

    monkeypatch.setattr(client.app[MIRROR_KEY], "list_versions_body", broken)
    with caplog.at_level(logging.ERROR, logger="proxy"):
        response = await client.get(f"{BASE}/index.json", headers=credentials(config))
    assert response.status == 500
    assert await response.json() == {"errors": ["internal error"]}
    assert "internal details" not in await response.text()
    assert [r.getMessage() for r in caplog.records if r.exc_info] == [
        f"unexpected error on GET {BASE}/index.json"]
    text = await metrics(client)
    assert sample(text, REQUESTS, route="mirror", status_class="5xx") == 1


async def test_a_path_no_route_serves_is_a_json_404_without_asking_for_credentials(
        client: TestClient) -> None:  # type: ignore[type-arg]
    for path in ("/nothing-here", "/mirror/registry.terraform.io/hashicorp"):
        response = await client.get(path)
        assert response.status == 404, path
        assert await response.json() == {"errors": ["Not Found"]}
        assert "WWW-Authenticate" not in response.headers
    assert (await client.head("/nothing-here")).status == 404
    text = await metrics(client)
    assert sample(text, REQUESTS, route="unmatched", status_class="4xx") == 3


@pytest.mark.parametrize("target", [b"OPTIONS *", b"CONNECT registry.terraform.io:443"])
async def test_a_request_target_without_a_path_is_a_json_404_and_counted(
        client: TestClient, target: bytes) -> None:  # type: ignore[type-arg]
    assert client.host and client.port
    answer = await asyncio.to_thread(raw_request, client.host, client.port,
                                     target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    assert answer.status == 404
    assert answer.headers["content-type"] == "application/json"
    assert answer.body == b'{"errors": ["Not Found"]}'
    text = await metrics(client)
    assert sample(text, REQUESTS, route="unmatched", status_class="4xx") == 1


async def test_a_method_a_route_does_not_take_is_a_json_405_saying_what_it_takes(
        client: TestClient) -> None:  # type: ignore[type-arg]
    for path in ("/healthz", f"{BASE}/index.json"):
        response = await client.post(path, data=b"x")
        assert response.status == 405, path
        assert response.headers["Allow"] == "GET,HEAD"
        assert await response.json() == {"errors": ["Method Not Allowed"]}
    text = await metrics(client)
    assert sample(text, REQUESTS, route="unmatched", status_class="4xx") == 2


@pytest.mark.parametrize(("path", "route"), [
    ("/nothing/../here", "unmatched"), ("/healthz/..", "unmatched"),
    (f"{BASE}/a%5cb.json", "mirror"), (f"{BASE}/..%2f.json", "mirror"),
    (f"{BASE}/%2e%2e", "mirror")])
async def test_an_odd_path_is_refused_before_routing_and_authentication(
        client: TestClient, path: str, route: str) -> None:  # type: ignore[type-arg]
    # Sent as written: an HTTP client would resolve the dot segments itself.
    url = URL(f"http://{client.host}:{client.port}{path}", encoded=True)
    response = await client.session.get(url, allow_redirects=False)
    assert response.status == 400, path
    assert response.content_type == "application/json"
    assert "not allowed in paths" in (await response.json())["errors"][0]
    assert "WWW-Authenticate" not in response.headers
    text = await metrics(client)
    assert sample(text, REQUESTS, route=route, status_class="4xx") == 1


async def test_a_failure_after_the_headers_cuts_the_connection_and_is_counted(
        config: Config, registry: FakeRegistry, upstream_ca: trustme.CA) -> None:
    zip_path = f"{BASE}/{ZIP}"
    head = "".join(f"{k}: {v}\r\n" for k, v in credentials(config).items())
    async with served(create_app(config), upstream_ca) as proxy:
        registry.faults.update({"slowzip", "corrupt"})
        answer = await proxy.raw_request(
            f"GET {zip_path} HTTP/1.1\r\nHost: x\r\n{head}\r\n".encode())
        assert answer.status == 200
        assert len(answer.body) < answer.content_length
        assert b"errors" not in answer.body
        assert answer.ended == "reset"
        text = await proxy.text("/metrics")
        assert sample(text, "tfproxy_aborted_responses_total", route="mirror",
                      reason="integrity") == 1
        assert sample(text, REQUESTS, route="mirror", status_class="2xx") == 1
