"""OIDC identities for CI runners and pods (`[[auth.oidc]]`): real JWTs signed with keys the
tests make (RSA and EC), the keys served as a JWKS file and over a local HTTPS URL. Valid
tokens pass for what their rule allows and get 403 outside it; tokens that do not verify get
401; none of those refusals asks anything of upstream."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from aiohttp.test_utils import TestClient

from proxy.config import ConfigError, load_config
from proxy.web.oidc import OidcVerifier, TokenRefused
from tests.conftest import AppClient
from tests.support.fake_registry import FakeRegistry
from tests.support.jwts import (
    AUDIENCE,
    ISSUER,
    SigningKey,
    claims,
    hs256_with,
    jwks,
    unsigned,
)
from tests.support.metrics import sample
from tests.support.proxy_process import ProxyProcess, free_port
from tests.support.terraform import terraform_env, terraform_init

NULL = "/mirror/registry.terraform.io/hashicorp/null"
RANDOM = "/mirror/registry.terraform.io/hashicorp/random"
MODULES = "/modules/registry.terraform.io/acme/tarball/aws/versions"
GITLAB = "https://gitlab.example.com"
TOKEN = "a-static-ci-token-0123456789"


def oidc_config(jwks_file: Path, registry: FakeRegistry, ttl: int = 3600) -> str:
    return f"""
[auth]
signed_url_ttl = {ttl}
tokens = [{{ name = "ci", token = "{TOKEN}", allow = ["registry.terraform.io/hashicorp/null"] }}]

[[auth.oidc]]
name = "github"
issuer = "{ISSUER}"
audience = "{AUDIENCE}"
jwks_file = "{jwks_file}"
leeway = 60

[[auth.oidc.rules]]
claims = {{ repository_owner = "acme", ref = "refs/heads/main" }}
allow = ["registry.terraform.io/hashicorp/null", "registry.terraform.io/acme/*"]

[[auth.oidc.rules]]
claims = {{ repository_owner = "acme" }}
allow = []

[[auth.oidc]]
name = "gitlab"
issuer = "{GITLAB}"
audience = ["{AUDIENCE}", "another"]
jwks_url = "{registry.url}/oidc/jwks"

[[auth.oidc.rules]]
claims = {{ namespace_path = "acme*" }}
allow = ["registry.terraform.io/hashicorp/*", "releases/terraform"]
"""


@pytest.fixture
def rsa_key() -> SigningKey:
    return SigningKey("RS256")


@pytest.fixture
def ec_key() -> SigningKey:
    return SigningKey("ES256")


@pytest.fixture
def keys_file(tmp_path: Path, rsa_key: SigningKey) -> Path:
    path = tmp_path / "github.jwks"
    path.write_text(json.dumps(jwks(rsa_key)))
    return path


@pytest.fixture
async def client(make: AppClient, keys_file: Path, registry: FakeRegistry, ec_key: SigningKey,
                 tmp_path: Path) -> TestClient:  # type: ignore[type-arg]
    registry.jwks = jwks(ec_key)
    audit = tmp_path / "audit.log"
    return await make(extra=oidc_config(keys_file, registry), server_audit_log=str(audit))


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def basic(password: str) -> dict[str, str]:
    encoded = base64.b64encode(f"runner:{password}".encode()).decode()
    return {"Authorization": f"Basic {encoded}"}


async def status_of(client: TestClient, path: str, token: str) -> tuple[int, Any]:  # type: ignore[type-arg]
    response = await client.get(path, headers=bearer(token))
    body = await response.read()
    return response.status, json.loads(body) if body.startswith(b"{") else body


async def test_valid_tokens_pass_for_what_their_rule_allows_and_get_403_outside(
        client: TestClient, registry: FakeRegistry, rsa_key: SigningKey,  # type: ignore[type-arg]
        ec_key: SigningKey) -> None:
    main = rsa_key.sign(claims())
    assert (await status_of(client, f"{NULL}/index.json", main))[0] == 200
    assert (await status_of(client, MODULES, main))[0] == 200
    registry.requests.clear()
    status, body = await status_of(client, f"{RANDOM}/index.json", main)
    assert status == 403
    assert "auth.oidc 'github' rule 1" in body["errors"][0]
    assert "registry.terraform.io/hashicorp/random" in body["errors"][0]
    assert registry.requests == []  # refused before anything was looked up
    # Another branch: rule 2, which allows nothing.
    feature = rsa_key.sign(claims(ref="refs/heads/feature"))
    status, body = await status_of(client, f"{NULL}/index.json", feature)
    assert status == 403 and "auth.oidc 'github' rule 2" in body["errors"][0]
    # Another owner: no rule at all.
    other = rsa_key.sign(claims(repository_owner="evil", sub="repo:evil/x:ref:refs/heads/main"))
    status, body = await status_of(client, f"{NULL}/index.json", other)
    assert status == 403 and "matches no rule" in body["errors"][0]
    # GitLab's tokens, EC-signed, keys over HTTPS.
    gitlab = ec_key.sign(claims(iss=GITLAB, sub="project_path:acme/infra",
                                namespace_path="acme-platform"))
    assert (await status_of(client, f"{RANDOM}/index.json", gitlab))[0] == 200
    assert ("GET", "/oidc/jwks") in registry.requests
    # A static token with an allow list.
    assert (await status_of(client, f"{NULL}/index.json", TOKEN))[0] == 200
    status, body = await status_of(client, f"{RANDOM}/index.json", TOKEN)
    assert status == 403 and "auth.tokens 'ci'" in body["errors"][0]
    metrics = await (await client.get("/metrics")).text()
    assert sample(metrics, "tfproxy_auth_total", method="oidc", result="ok") >= 3
    assert sample(metrics, "tfproxy_auth_total", method="oidc", result="forbidden") == 3
    assert sample(metrics, "tfproxy_auth_total", method="token", result="forbidden") == 1


def _tampered(token: str) -> str:
    head, payload, signature = token.split(".")
    claims_ = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    claims_["repository_owner"] = "acme"
    claims_["sub"] = "repo:acme/other:ref:refs/heads/main"
    forged = base64.urlsafe_b64encode(json.dumps(claims_).encode()).decode().rstrip("=")
    return f"{head}.{forged}.{signature}"


REFUSED: dict[str, Callable[[SigningKey], str]] = {
    "expired": lambda key: key.sign(claims(iat=int(time.time()) - 7200, lifetime=-3600)),
    "not yet valid": lambda key: key.sign(claims(nbf=int(time.time()) + 3600)),
    "issued in the future": lambda key: key.sign(claims(iat=int(time.time()) + 3600)),
    "another audience": lambda key: key.sign(claims(aud="someone-else")),
    "another issuer": lambda key: key.sign(claims(iss="https://issuer.example")),
    "alg none": lambda key: unsigned(claims()),
    "HS256 with the public key": lambda key: hs256_with(key.public_pem(), claims(), key.kid),
    "unknown kid": lambda key: SigningKey("RS256").sign(claims()),
    "tampered payload": lambda key: _tampered(key.sign(claims(repository_owner="evil"))),
    "no exp": lambda key: key.sign({k: v for k, v in claims().items() if k != "exp"}),
}


@pytest.mark.parametrize("case", REFUSED)
async def test_tokens_that_do_not_verify_get_401_and_no_upstream_request(
        client: TestClient, registry: FakeRegistry, rsa_key: SigningKey,  # type: ignore[type-arg]
        case: str) -> None:
    registry.requests.clear()
    token = REFUSED[case](rsa_key)
    for path in (f"{NULL}/index.json", f"{NULL}/3.2.1.json", MODULES):
        status, body = await status_of(client, path, token)
        assert status == 401, (case, path, body)
    assert [p for _m, p in registry.requests if p != "/oidc/jwks"] == []
    metrics = await (await client.get("/metrics")).text()
    result = "expired" if case == "expired" else "invalid"
    assert sample(metrics, "tfproxy_auth_total", method="oidc", result=result) >= 3


async def test_a_token_over_16_kib_is_refused_unread(rsa_key: SigningKey, keys_file: Path,
                                                    registry: FakeRegistry) -> None:
    """(Over HTTP, aiohttp's 8 KiB header limit refuses it first: a 400 from the parser.)"""
    config = load_config(write_text(keys_file.parent / "p.toml",
                                    oidc_config(keys_file, registry)), environ={})
    verifier = OidcVerifier(config.auth.oidc)
    with pytest.raises(TokenRefused, match="longer than 16 KiB"):
        await verifier.identify(rsa_key.sign(claims(padding="x" * 17000)))
    assert (await verifier.identify(rsa_key.sign(claims()))).name.startswith("github:")


def write_text(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


async def test_an_unknown_key_reads_the_url_keys_once_more_then_at_most_once_a_minute(
        client: TestClient, registry: FakeRegistry, ec_key: SigningKey) -> None:  # type: ignore[type-arg]
    def gitlab(key: SigningKey) -> str:
        return key.sign(claims(iss=GITLAB, namespace_path="acme"))

    def fetches() -> int:
        return registry.paths().count("/oidc/jwks")

    assert (await status_of(client, f"{NULL}/index.json", gitlab(ec_key)))[0] == 200
    assert fetches() == 1
    rotated = SigningKey("ES256")
    registry.jwks = jwks(ec_key, rotated)  # the issuer publishes a new key
    assert (await status_of(client, f"{NULL}/index.json", gitlab(rotated)))[0] == 200
    assert fetches() == 2  # one refresh for the unknown key
    for _ in range(3):  # random key IDs: no more fetches within the minute
        assert (await status_of(client, f"{NULL}/index.json",
                                gitlab(SigningKey("ES256"))))[0] == 401
    assert fetches() == 2


async def test_keys_that_cannot_be_read_cost_one_read_a_minute_and_old_keys_keep_working(
        client: TestClient, registry: FakeRegistry, ec_key: SigningKey) -> None:  # type: ignore[type-arg]
    def gitlab(key: SigningKey) -> str:  # type: ignore[type-arg]
        return key.sign(claims(iss=GITLAB, namespace_path="acme"))

    def fetches() -> int:
        return registry.paths().count("/oidc/jwks")

    published = registry.jwks
    registry.jwks = {"keys": "not a key set"}  # the issuer's URL answers garbage
    before = fetches()
    for _ in range(3):
        assert (await status_of(client, f"{NULL}/index.json", gitlab(ec_key)))[0] == 401
    assert fetches() == before + 1
    registry.jwks = published


async def test_a_failed_read_of_the_keys_keeps_the_keys_read_before(
        client: TestClient, registry: FakeRegistry, ec_key: SigningKey) -> None:  # type: ignore[type-arg]
    def gitlab(key: SigningKey) -> str:  # type: ignore[type-arg]
        return key.sign(claims(iss=GITLAB, namespace_path="acme"))

    assert (await status_of(client, f"{NULL}/index.json", gitlab(ec_key)))[0] == 200
    published = registry.jwks
    registry.jwks = {"keys": "not a key set"}
    # An unknown key ID makes it read the keys again: that read fails...
    assert (await status_of(client, f"{NULL}/index.json", gitlab(SigningKey("ES256"))))[0] \
        == 401
    # ...and the keys it had still verify.
    assert (await status_of(client, f"{NULL}/index.json", gitlab(ec_key)))[0] == 200
    registry.jwks = published


async def test_a_key_rotated_in_the_jwks_file_is_picked_up_without_a_restart(
        client: TestClient, keys_file: Path, rsa_key: SigningKey) -> None:  # type: ignore[type-arg]
    assert (await status_of(client, f"{NULL}/index.json", rsa_key.sign(claims())))[0] == 200
    rotated = SigningKey("RS256")
    keys_file.write_text(json.dumps(jwks(rotated)))  # the old key withdrawn
    assert (await status_of(client, f"{NULL}/index.json", rotated.sign(claims())))[0] == 200
    fresh_old = rsa_key.sign(claims(sub="repo:acme/infra:ref:refs/heads/main:2"))
    assert (await status_of(client, f"{NULL}/index.json", fresh_old))[0] == 401


async def test_signed_urls_name_the_identity_and_do_not_outlive_its_token_by_more_than_the_ttl(
        make: AppClient, keys_file: Path, registry: FakeRegistry,
        rsa_key: SigningKey) -> None:
    client = await make(extra=oidc_config(keys_file, registry, ttl=600))
    # Expired 30 s ago, within the leeway: still accepted.
    exp = int(time.time()) - 30
    token = rsa_key.sign(claims(iat=exp - 300, lifetime=0) | {"exp": exp})
    status, document = await status_of(client, f"{NULL}/3.2.1.json", token)
    assert status == 200
    url = document["archives"]["linux_amd64"]["url"]
    query = parse_qs(urlsplit(url).query)
    assert query["by"] == ["github:repo:acme/infra:ref:refs/heads/main"]
    assert int(query["expires"][0]) <= exp + 600 < time.time() + 600
    archive = await client.get(f"{NULL}/{url}")
    assert archive.status == 200  # no credentials: the URL is the proof


async def test_the_oci_token_flow_takes_a_jwt_and_its_token_keeps_the_rule(
        client: TestClient, rsa_key: SigningKey) -> None:  # type: ignore[type-arg]
    exp = int(time.time()) + 120
    jwt_ = rsa_key.sign(claims() | {"exp": exp})
    issued = await client.get("/v2/token", headers=basic(jwt_))
    assert issued.status == 200
    answer = await issued.json()
    assert answer["expires_in"] <= exp - time.time() + 1  # never past the JWT's own exp
    oci = bearer(answer["token"])
    repo = "/v2/providers/registry.terraform.io/hashicorp"
    assert (await client.get(f"{repo}/null/tags/list", headers=oci)).status == 200
    refused = await client.get(f"{repo}/random/tags/list", headers=oci)
    assert refused.status == 403
    assert (await refused.json())["errors"][0]["code"] == "DENIED"


async def test_the_status_page_takes_a_jwt_as_the_basic_password_and_counts_per_identity(
        client: TestClient, rsa_key: SigningKey) -> None:  # type: ignore[type-arg]
    token = rsa_key.sign(claims())
    zip_name = "terraform-provider-null_3.2.1_linux_amd64.zip"
    document = await (await client.get(f"{NULL}/3.2.1.json", headers=bearer(token))).json()
    archive = await client.get(f"{NULL}/{document['archives']['linux_amd64']['url']}")
    assert archive.status == 200 and zip_name in archive.url.path
    await archive.read()
    page = await client.get("/status.json", headers=basic(token))
    assert page.status == 200
    identities = (await page.json())["identities"]
    assert identities == [{"name": "github:repo:acme/infra:ref:refs/heads/main", "pulls": 1}]


async def test_the_audit_log_names_the_issuer_subject_and_matched_claims_never_the_token(
        client: TestClient, rsa_key: SigningKey, tmp_path: Path) -> None:  # type: ignore[type-arg]
    token = rsa_key.sign(claims())
    assert (await status_of(client, f"{RANDOM}/index.json", token))[0] == 403
    lines = [json.loads(line) for line in (tmp_path / "audit.log").read_text().splitlines()]
    [refused] = [line for line in lines if line["event"] == "refused"]
    assert refused["token"] == "github:repo:acme/infra:ref:refs/heads/main"
    assert refused["identity"] == {
        "method": "oidc", "provider": "auth.oidc 'github' rule 1", "issuer": ISSUER,
        "subject": "repo:acme/infra:ref:refs/heads/main",
        "claims": {"repository_owner": "acme", "ref": "refs/heads/main"}}
    assert token not in (tmp_path / "audit.log").read_text()


NULL_AND_MODULE = """
terraform {
  required_providers {
    null = { source = "hashicorp/null", version = "3.2.1" }
  }
}
module "net" {
  source  = "acme/tarball/aws"
  version = "1.0.0"
}
"""


@pytest.mark.e2e
def test_terraform_init_with_a_jwt_in_tf_token_installs_and_fails_cleanly_once_expired(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry,
        keys_file: Path, rsa_key: SigningKey) -> None:
    """As a CI job does it: its OIDC token in TF_TOKEN_<host>, no credentials helper."""
    port, cache, audit = free_port(), tmp_path / "cache", tmp_path / "audit.log"
    config = write_config(extra=oidc_config(keys_file, registry), cache_dir=cache, port=port)
    with ProxyProcess(config, cache, port, tmp_path / "proxy.log",
                      env={"TF_REGISTRY_PROXY_SERVER_AUDIT_LOG": str(audit)}) as proxy:
        printed = proxy.cli("client-config", "--mode", "registry")
        assert printed.returncode == 0, printed.stderr
        cli_config = tmp_path / "client.tfrc"
        cli_config.write_text(printed.stdout)
        results = {}
        for case, token in (("valid", rsa_key.sign(claims())),
                            ("expired", rsa_key.sign(claims(iat=int(time.time()) - 7200,
                                                            lifetime=-3600)))):
            workdir = tmp_path / case
            workdir.mkdir()
            (workdir / "main.tf").write_text(NULL_AND_MODULE)
            env = {**terraform_env(tmp_path / f"home-{case}", cli_config, proxy.ca_file),
                   "TF_TOKEN_registry_terraform_io": token}
            results[case] = terraform_init(workdir, env)
    valid, expired = results["valid"], results["expired"]
    assert valid.retcode == 0, valid.output
    assert "Installed hashicorp/null v3.2.1" in valid.stdout
    assert (tmp_path / "valid" / ".terraform" / "modules" / "net").is_dir()
    assert expired.retcode != 0
    assert "401" in expired.output or "unauthorized" in expired.output.lower(), expired.output
    served = [json.loads(line) for line in audit.read_text().splitlines()
              if '"served"' in line or '"fetched"' in line]
    assert served and all(line["token"] == "github:repo:acme/infra:ref:refs/heads/main"
                          for line in served if line["event"] == "served")
    assert any(line.get("identity", {}).get("subject") == "repo:acme/infra:ref:refs/heads/main"
               for line in served)


@pytest.mark.parametrize(("providers", "problem"), [
    ('[[auth.oidc]]\nname = "ci"\nissuer = "https://ci.example"\naudience = "proxy"\n'
     '[[auth.oidc.rules]]\nallow = ["*/*/*"]\n',
     "auth.oidc 'ci': give exactly one of jwks_file"),
    ('[[auth.oidc]]\nname = "ci"\nissuer = "https://ci.example"\naudience = "proxy"\n'
     'jwks_url = "http://ci.example/keys"\n[[auth.oidc.rules]]\nallow = ["*/*/*"]\n',
     "auth.oidc 'ci': jwks_url: expected an https URL"),
    ('[[auth.oidc]]\nname = "ci"\nissuer = "https://ci.example"\naudience = "proxy"\n'
     'jwks_url = "https://ci.example/keys"\n',
     "auth.oidc 'ci': expected at least one [[auth.oidc.rules]] table"),
    ('[[auth.oidc]]\nname = "ci"\nissuer = "https://ci.example"\naudience = "proxy"\n'
     'jwks_url = "https://ci.example/keys"\n[[auth.oidc.rules]]\nclaims = { sub = 1 }\n'
     'allow = ["*/*/*"]\n',
     "auth.oidc 'ci' rule 1: claims: expected a table of claim"),
    ('[[auth.oidc]]\nname = "ci"\nissuer = "https://ci.example"\naudience = "proxy"\n'
     'jwks_url = "https://ci.example/keys"\n[[auth.oidc.rules]]\nallow = ["*/*/*"]\n'
     'alow = ["x"]\n',
     "auth.oidc 'ci' rule 1.alow: unknown key (did you mean auth.oidc 'ci' rule 1.allow?)"),
    ('[[auth.oidc]]\nname = "ci"\nissuer = "https://ci.example"\naudience = "proxy"\n'
     'jwks_url = "https://ci.example/keys"\n[[auth.oidc.rules]]\nallow = ["*/*/*"]\n'
     '[[auth.oidc]]\nname = "ci"\nissuer = "https://ci.example"\naudience = "proxy"\n'
     'jwks_url = "https://ci.example/keys"\n[[auth.oidc.rules]]\nallow = ["*/*/*"]\n',
     "auth.oidc: the name 'ci' is given to more than one provider"),
])
def test_each_mistake_in_an_oidc_table_is_named(tmp_path: Path, providers: str,
                                                 problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write_text(tmp_path / "p.toml", providers), environ={})
    assert any(found.startswith(problem) for found in caught.value.problems), \
        caught.value.problems
