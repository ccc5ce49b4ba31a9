"""Optional client authentication: bearer tokens for metadata, signed URLs for archives."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from proxy.app import create_app
from proxy.config import ConfigError, load_config
from proxy.tls.state import StatePaths
from proxy.web.auth import load_signing_key
from proxy.web.url_signing import UrlSigner
from tests.support.fake_registry import FakeRegistry
from tests.support.mirror_paths import BASE, ZIP

TOKEN = "client-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_signed_urls_hold_only_for_their_path_key_and_lifetime() -> None:
    signer = UrlSigner(b"k" * 32, ttl=60)
    query = parse_qs(signer.query("/a/b.zip", now=1000))
    expires, sig = query["expires"][0], query["sig"][0]
    assert expires == "1060"
    assert signer.valid("/a/b.zip", expires, sig, now=1059)
    assert not signer.valid("/a/b.zip", expires, sig, now=1061)           # expired
    assert not signer.valid("/a/c.zip", expires, sig, now=1000)           # other path
    assert not signer.valid("/a/b.zip", "1070", sig, now=1000)            # extended expiry
    assert not signer.valid("/a/b.zip", expires, "0" * 64, now=1000)      # forged
    assert not signer.valid("/a/b.zip", None, None)
    assert not signer.valid("/a/b.zip", "\u00b9", sig, now=1000)  # "¹": str.isdigit's, not int's
    assert not signer.valid("/a/b.zip", "\u0661\u0660\u0666\u0660", sig, now=1000)  # 1060, Arabic
    assert not UrlSigner(b"x" * 32, 60).valid("/a/b.zip", expires, sig, now=1000)


def test_tokens_load_from_a_file_and_short_ones_are_refused(tmp_path: Path) -> None:
    tokens_file = tmp_path / "tokens"
    tokens_file.write_text(f"# CI runners\n{TOKEN}\n\nsecond-token-abcdefghij\n")
    path = tmp_path / "c.toml"
    path.write_text(f'[auth]\ntokens_file = "{tokens_file}"\nsigned_url_ttl = 600\n')
    auth = load_config(path, environ={}).auth
    assert auth.enabled and len(auth.tokens) == 2 and auth.signed_url_ttl == 600
    assert TOKEN not in repr(auth)
    path.write_text('[auth]\ntokens = ["short"]\n')
    with pytest.raises(ConfigError, match="at least 16"):
        load_config(path, environ={})


@pytest.fixture
async def client(aiohttp_client, write_config: Callable[..., Path]) -> TestClient:  # type: ignore[no-untyped-def]
    config = load_config(write_config(extra=f'[auth]\ntokens = ["{TOKEN}"]\n'), environ={})
    return await aiohttp_client(create_app(config))  # type: ignore[no-any-return]


async def test_metadata_needs_a_token(client: TestClient, registry: FakeRegistry) -> None:
    for path in (f"{BASE}/index.json", f"{BASE}/3.2.1.json",
                 "/modules/registry.terraform.io/acme/tarball/aws/versions",
                 "/modules/registry.terraform.io/acme/tarball/aws/1.0.0/download"):
        response = await client.get(path)
        assert response.status == 401, path
        assert response.headers["WWW-Authenticate"].startswith("Bearer")
        assert "bearer token" in (await response.json())["errors"][0]
        wrong = await client.get(path, headers={"Authorization": "Bearer nope-nope-nope-nope"})
        assert wrong.status == 401
    assert registry.requests == []  # refused before any upstream work
    for path in ("/healthz", "/readyz", "/.well-known/terraform.json", "/metrics"):
        assert (await client.get(path)).status == 200, path


async def test_archives_need_a_valid_signature(client: TestClient) -> None:
    document = await (await client.get(f"{BASE}/3.2.1.json", headers=AUTH)).json()
    url = document["archives"]["linux_amd64"]["url"]
    assert url.startswith(ZIP + "?") and "sig=" in url
    signed = f"{BASE}/{url}"
    response = await client.get(signed)  # no token: the signature is the credential
    assert response.status == 200
    assert await response.read()
    assert (await client.get(f"{BASE}/{ZIP}")).status == 401
    assert (await client.get(signed.replace("sig=", "sig=0"))).status == 401
    superscript = f"{BASE}/{ZIP}?expires=%C2%B9&sig=" + "0" * 64  # "¹": was a 500
    assert (await client.get(superscript)).status == 401
    other = signed.replace("linux_amd64", "darwin_arm64")
    assert (await client.get(other)).status == 401   # a signature is for one path only
    assert (await client.get(f"{BASE}/{ZIP}", headers=AUTH)).status == 200


async def test_module_location_is_signed(client: TestClient) -> None:
    module = "/modules/registry.terraform.io/acme/tarball/aws/1.0.0"
    body = await (await client.get(f"{module}/download", headers=AUTH)).json()
    location = urlsplit(body["location"])
    assert "sig=" in location.query and location.path.endswith(".tar.gz")
    assert (await client.get(f"{location.path}?{location.query}")).status == 200
    assert (await client.get(location.path)).status == 401


def load_all_at_once(path: Path, loaders: int) -> list[bytes]:
    """load_signing_key(path) from several threads released together."""
    start = threading.Barrier(loaders)

    def load(_: int) -> bytes:
        start.wait()
        return load_signing_key(path)

    with ThreadPoolExecutor(max_workers=loaders) as pool:
        return list(pool.map(load, range(loaders)))


def test_concurrent_first_starts_share_one_signing_key(tmp_path: Path) -> None:
    """Workers starting together on a fresh state directory: no crash, one key for all."""
    for attempt in range(10):
        path = tmp_path / f"state-{attempt}" / "url-signing.key"
        keys = load_all_at_once(path, 16)
        assert len(set(keys)) == 1 and len(keys[0]) == 32
        assert path.read_bytes() == keys[0]
        assert path.stat().st_mode & 0o077 == 0
        assert sorted(p.name for p in path.parent.iterdir()) == ["url-signing.key"]


def test_a_truncated_signing_key_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "url-signing.key"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match="holds 0 bytes"):
        load_signing_key(path)


async def test_an_unusable_signing_key_stops_the_start_with_nothing_left_open(
        write_config: Callable[..., Path]) -> None:
    """The key is checked before the cache or the upstream session is opened, and whatever a
    failed start opened is closed again."""
    config = load_config(write_config(extra=f'[auth]\ntokens = ["{TOKEN}"]\n'), environ={})
    key = StatePaths(config.server.state_dir).signing_key
    key.parent.mkdir(parents=True)
    key.write_bytes(b"torn")
    runner = web.AppRunner(create_app(config))
    with pytest.raises(ValueError, match=re.escape(str(key))):
        await runner.setup()
    await runner.app.cleanup()
    assert list((config.cache.dir / "tmp").glob("p*")) == []  # no store left open
    assert key.read_bytes() == b"torn"
