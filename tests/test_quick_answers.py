"""Held documents answered before routing (proxy.web.quick_answers), run as `serve` runs the
app: the same answer as the handler's, never a moment after what it was built from changed
(a package verified, a policy put in force), never where clients authenticate or a policy
is in force."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
import trustme
from aiohttp.test_utils import TestClient, make_mocked_request
from prometheus_client import CollectorRegistry, Counter

from proxy.app import create_app
from proxy.config import load_config
from proxy.core.json_bodies import json_body
from proxy.core.metrics import Metrics
from proxy.protocols.network_mirror import ProviderMirror
from proxy.store.freshness import RefreshingDocuments
from proxy.store.memory import MemoryIndex
from proxy.web.quick_answers import QuickAnswers
from proxy.web.routes import POLICY_KEY, QUICK_KEY
from tests.support.fake_registry import FakeRegistry
from tests.support.mirror_paths import BASE, ZIP, zip_h1
from tests.support.raw_http import Served, served

WriteConfig = Callable[..., Path]
INDEX = f"{BASE}/index.json"
DOCUMENT = f"{BASE}/3.2.1.json"
DENY_3_2_1 = """
[[policy.deny]]
match = "registry.terraform.io/hashicorp/null"
versions = "3.2.1"
reason = "broken"
"""


async def _get(proxy: Served, path: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as session, \
            session.get(proxy.url(path), ssl=proxy.client_tls, headers=headers) as response:
        return response.status, dict(response.headers), await response.read()


def _counting_index_lists(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The providers whose index.json the mirror's handler built an answer for."""
    asked: list[str] = []
    original = ProviderMirror.list_versions_body

    async def counted(mirror: ProviderMirror, provider: object) -> object:
        asked.append(str(provider))
        return await original(mirror, provider)  # type: ignore[arg-type]

    monkeypatch.setattr(ProviderMirror, "list_versions_body", counted)
    return asked


async def test_a_held_document_is_answered_again_without_its_handler(
        write_config: WriteConfig, upstream_ca: trustme.CA,
        monkeypatch: pytest.MonkeyPatch) -> None:
    asked = _counting_index_lists(monkeypatch)
    app = create_app(load_config(write_config(), environ={}))
    async with served(app, upstream_ca) as proxy:
        first = await _get(proxy, INDEX)
        again = await _get(proxy, INDEX)
        etag = first[1]["Etag"]
        unchanged = await _get(proxy, INDEX, **{"If-None-Match": etag})
        async with aiohttp.ClientSession() as session, \
                session.head(proxy.url(INDEX), ssl=proxy.client_tls) as head:
            head_status, head_body = head.status, await head.read()
    assert first[0] == again[0] == 200
    assert again[2] == first[2] == b'{"versions":{"3.1.0":{},"3.2.1":{}}}'
    for name in ("Etag", "Content-Type", "Server", "Content-Length"):
        assert again[1][name] == first[1][name], name
    assert unchanged[0] == 304 and unchanged[1]["Etag"] == etag and unchanged[2] == b""
    assert (head_status, head_body) == (200, b"")
    assert asked == ["registry.terraform.io/hashicorp/null"]  # the first request only


async def test_a_package_verified_drops_the_kept_documents_at_once(
        write_config: WriteConfig, upstream_ca: trustme.CA, registry: FakeRegistry) -> None:
    """VERSION.json shows a zip's h1 as soon as the zip is verified, not a moment later."""
    release = registry.releases[("hashicorp", "null", "3.2.1")]
    app = create_app(load_config(write_config(), environ={}))
    async with served(app, upstream_ca) as proxy:
        before = await _get(proxy, DOCUMENT)
        assert (await _get(proxy, f"{BASE}/{ZIP}"))[0] == 200
        after = await _get(proxy, DOCUMENT)
    h1 = zip_h1(release.zips["linux_amd64"])
    assert h1 not in before[2].decode()
    assert h1 in after[2].decode()


async def test_a_policy_put_in_force_drops_the_kept_lists_at_once(
        write_config: WriteConfig, upstream_ca: trustme.CA) -> None:
    app = create_app(load_config(write_config(), environ={}))
    denying = load_config(write_config(extra=DENY_3_2_1), environ={}).policy
    async with served(app, upstream_ca) as proxy:
        before = await _get(proxy, INDEX)
        app[POLICY_KEY].reload(denying)  # what SIGHUP does
        after = await _get(proxy, INDEX)
        again = await _get(proxy, INDEX)
        refused = await _get(proxy, DOCUMENT)
    assert b'"3.2.1"' in before[2]
    assert after[2] == again[2] == b'{"versions":{"3.1.0":{}}}'
    assert refused[0] == 403


async def test_nothing_is_kept_while_a_policy_is_in_force(
        write_config: WriteConfig, upstream_ca: trustme.CA,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A policy's answers change with time (a cooldown ends): each list is judged again."""
    asked = _counting_index_lists(monkeypatch)
    app = create_app(load_config(write_config(extra=DENY_3_2_1), environ={}))
    async with served(app, upstream_ca) as proxy:
        answers = [await _get(proxy, INDEX) for _ in range(3)]
    assert {answer[2] for answer in answers} == {b'{"versions":{"3.1.0":{}}}'}
    assert len(asked) == 3


async def test_nothing_is_kept_where_clients_authenticate(
        write_config: WriteConfig, upstream_ca: trustme.CA, tmp_path: Path) -> None:
    tokens = tmp_path / "tokens"
    tokens.write_text("ci-runner-token-abcdefghij\n")
    app = create_app(load_config(write_config(extra=f'[auth]\ntokens_file = "{tokens}"\n'),
                                 environ={}))
    assert QUICK_KEY not in app
    async with served(app, upstream_ca) as proxy:
        allowed = await _get(proxy, INDEX, Authorization="Bearer ci-runner-token-abcdefghij")
        anonymous = await _get(proxy, INDEX)
    assert allowed[0] == 200
    assert anonymous[0] == 401


@pytest.mark.parametrize(("versions_ttl", "kept_for"), [(600, 1.0), (0.25, 0.25)])
def test_answers_are_kept_no_longer_than_version_lists(
        write_config: WriteConfig, versions_ttl: float, kept_for: float) -> None:
    app = create_app(load_config(write_config(upstream_extra=f"versions_ttl = {versions_ttl}"),
                                 environ={}))
    assert app[QUICK_KEY].seconds == kept_for


def test_a_kept_answer_ends_with_its_moment_and_the_table_stays_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr("proxy.web.quick_answers.time.monotonic", lambda: now[0])
    requests = Counter("requests", "", ["route", "status"], registry=CollectorRegistry())
    quick = QuickAnswers(requests, "tf-registry-proxy", seconds=1.0, limit=2)
    document = json_body({"versions": {}})
    quick.keep(make_mocked_request("GET", "/a"), "mirror", document)
    assert quick.answer(make_mocked_request("POST", "/a")) is None
    assert quick.answer(make_mocked_request("GET", "/a", headers={"Expect": "x"})) is None
    answer = quick.answer(make_mocked_request("GET", "/a"))
    assert answer is not None and answer.body == document.body
    assert requests.labels("mirror", "2xx")._value.get() == 1
    now[0] += 1.5
    assert quick.answer(make_mocked_request("GET", "/a")) is None
    for path in ("/a", "/b", "/a"):  # a path kept again takes no new place
        quick.keep(make_mocked_request("GET", path), "mirror", document)
    quick.keep(make_mocked_request("GET", "/b?made-up=1"), "mirror", document)  # not kept
    assert [quick.answer(make_mocked_request("GET", p)) is not None
            for p in ("/a", "/b", "/b?made-up=1")] == [True, True, False]
    quick.keep(make_mocked_request("GET", "/c"), "mirror", document)  # starts the table again
    assert [quick.answer(make_mocked_request("GET", p)) is not None
            for p in ("/a", "/b", "/c")] == [False, False, True]


async def test_a_version_list_replaced_tells_its_listeners_and_one_reread_does_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What drops kept answers when a list changes in this process (a refresh, a forced
    one for a version the list lacks): a new copy held, not the same copy read again."""
    metrics = Metrics(upstream_hosts=[])
    lists = RefreshingDocuments[list[str]]("versions", MemoryIndex(), metrics, ttl=600,
                                           encode=list, decode=list)
    told: list[int] = []
    lists.on_change(lambda: told.append(1))
    answers = iter([["1.0.0"], ["1.0.0", "1.1.0"]])

    async def fetch() -> list[str]:
        return next(answers)

    first = await lists.get("k", fetch)
    assert await lists.get("k", fetch) is first  # held: nothing changed
    changes_when_first_held = len(told)
    monkeypatch.setattr("proxy.store.freshness.UNKNOWN_ENTRY_REFRESH_SECONDS", 0.0)
    second = await lists.get("k", fetch, knows=lambda copy: "1.1.0" in copy)
    assert second == ["1.0.0", "1.1.0"]
    assert len(told) == changes_when_first_held + 1


async def test_a_module_list_read_anew_drops_the_kept_list_at_once(
        client: TestClient, registry: FakeRegistry, monkeypatch: pytest.MonkeyPatch) -> None:
    """A module version the kept list lacks, asked for, reads the list anew: the next
    `versions` answer shows it at once."""
    monkeypatch.setattr("proxy.store.freshness.UNKNOWN_ENTRY_REFRESH_SECONDS", 0.0)
    net = "/modules/registry.terraform.io/acme/net/aws"
    before = await (await client.get(f"{net}/versions")).json()
    location = registry.modules[("acme", "net", "aws", "1.2.0")].location
    registry.add_module("acme", "net", "aws", "1.3.0", location)
    try:
        assert (await client.get(f"{net}/1.3.0/download")).status == 200
        after = await (await client.get(f"{net}/versions")).json()
    finally:
        del registry.modules[("acme", "net", "aws", "1.3.0")]
    assert "1.3.0" not in str(before)
    assert {"version": "1.3.0"} in after["modules"][0]["versions"]
