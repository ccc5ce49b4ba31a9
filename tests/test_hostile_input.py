"""The hostile-input battery: every answer a 4xx JSON error, zero upstream traffic, nothing
written outside the cache directory."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

from aiohttp.test_utils import TestClient
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from yarl import URL

from proxy.config import Config
from proxy.web.middleware import plain_path, reject_odd_segments
from tests.support.fake_registry import FakeRegistry

GOOD = ["registry.terraform.io", "hashicorp", "null", "3.2.1.json"]
TRAVERSALS = ["..", "%2e%2e", "%2E%2E", ".%2e", "..%2f..", "..%5c..", "..\\..", ".",
              "%00", "a%0ab", "%2fetc%2fpasswd", "%252e%252e"]


def battery() -> Iterator[str]:
    for index in range(len(GOOD)):
        for bad in TRAVERSALS:
            parts = list(GOOD)
            parts[index] = bad
            yield "/mirror/" + "/".join(parts)
    for host in ("169.254.169.254", "[fd00::1]", "127.0.0.1", "0x7f.1", "localhost",
                 "example.com", "xn--rgistry-bya.terraform.io",   # punycode lookalike
                 "r\u0435gistry.terraform.io",                   # Cyrillic homoglyph
                 "registry.terraform.io.evil.example", "registry.terraform.io%00.evil",
                 "user@registry.terraform.io", "registry.terraform.io:99999", "a" * 300):
        yield f"/mirror/{host}/hashicorp/null/index.json"
        yield f"/modules/{host}/acme/net/aws/versions"
    for version in ("3.2.1-", "3.2.1/../4", "3.2.1%2f..%2f4", "9" * 200, "latest", "*",
                    "3.2.1%20", "1..2", "-1.0.0"):
        yield f"/mirror/registry.terraform.io/hashicorp/null/{version}.json"
        yield f"/modules/registry.terraform.io/acme/net/aws/{version}/download"
    # Fine for modules (go-version is lax), not for providers (strict semver).
    for version in ("3.2", "3.2.1.0", "v3.2.1", "03.2.1"):
        yield f"/mirror/registry.terraform.io/hashicorp/null/{version}.json"
    yield "/mirror/" + "a/" * 2000 + "index.json"
    yield "/mirror/registry.terraform.io/hashicorp/null/" + "x" * 3000 + ".zip"
    yield "/mirror/registry.terraform.io/hashi%20corp/null/index.json"
    yield "/mirror/registry.terraform.io/hashicorp/null/terraform-provider-null_3.2.1_../..zip"




def raw_url(client: TestClient, path: str) -> URL:
    """The path exactly as given (non-ASCII percent-encoded, as clients send it): no
    client-side normalization of dot segments."""
    encoded = "".join(c if c.isascii() else quote(c) for c in path)
    return URL(f"http://{client.host}:{client.port}{encoded}", encoded=True)


async def test_hostile_paths_are_json_4xx_without_upstream_traffic(
        client: TestClient, registry: FakeRegistry) -> None:
    statuses = {}
    for path in battery():
        response = await client.session.get(raw_url(client, path))
        body = await response.read()
        assert 400 <= response.status < 500, (path, response.status, body[:200])
        assert response.content_type == "application/json", path
        assert registry.requests == [], path
        statuses[path] = response.status
    assert len(statuses) > 90


def files_outside(cache: Path, roots: list[Path]) -> set[Path]:
    found = set()
    for root in roots:
        for directory, _dirs, files in os.walk(root):
            found.update(Path(directory) / f for f in files)
    return found


segment = st.one_of(
    st.sampled_from(["registry.terraform.io", "hashicorp", "null", "index.json", "3.2.1.json",
                     "..", "%2e%2e", "%2f", "%00", "", "modules", "mirror", "download",
                     "versions", "terraform-provider-null_3.2.1_linux_amd64.zip"]),
    st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12))


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["/mirror/", "/modules/", "/", "/.well-known/"]),
       st.lists(segment, max_size=7))
async def test_fuzzed_paths_never_5xx(client: TestClient, registry: FakeRegistry,
                                      proxy_config: Config, prefix: str,
                                      segments: list[str]) -> None:
    path = prefix + "/".join(quote(s, safe="%.") for s in segments)
    assume(not path.startswith("//"))  # a scheme-relative URL, not a path
    before = files_outside(proxy_config.cache.dir, [proxy_config.cache.dir.parent])
    response = await client.session.get(raw_url(client, path))
    assert response.status < 500, (path, await response.text())
    after = files_outside(proxy_config.cache.dir, [proxy_config.cache.dir.parent])
    assert {p for p in after - before if not p.is_relative_to(proxy_config.cache.dir)} == set()


path_segment = st.one_of(
    st.sampled_from(["", ".", "..", ".x", "x.", "...", "5.0.0.json", "%2e", "%2E%2e", "%2F",
                     "%5c", "%00", "%zz", "a\\b", "a\x00b", "\x1f", "\x7f", "\u0085", "\u00e9"]),
    st.text(alphabet=st.characters(max_codepoint=0x7f), max_size=3))
path_text = st.tuples(st.sampled_from(["/", ""]), st.lists(path_segment, max_size=6)).map(
    lambda parts: parts[0] + "/".join(parts[1]))


@settings(max_examples=500)
@given(path_text)
def test_the_quick_path_check_passes_only_paths_the_full_check_passes(path: str) -> None:
    # The usual path skips the regular expressions: it must never let through what they
    # would refuse.
    if plain_path(path):
        reject_odd_segments(path)
