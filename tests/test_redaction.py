"""Secrets in URLs, headers and tool output are masked wherever text leaves the proxy."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import proxy
from proxy.core.errors import ProxyError
from proxy.core.redaction import SecretMaskingFilter, excerpt, install_log_masking, mask_secrets
from proxy.modules.sources import parse_source

# Secrets are drawn as MARK_IN + random + MARK_OUT; nothing else in the generated text is
# spelled like them, so either mark in an output means (part of) a secret got through.
MARK_IN, MARK_OUT = "Qz7", "7zQ"
_UNRESERVED = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~"
_PCT = st.sampled_from(["%40", "%3A", "%2F", "%25", "%3d"])


def _secret(alphabet: str) -> st.SearchStrategy[str]:
    piece = st.one_of(st.text(alphabet=alphabet, min_size=1, max_size=4), _PCT)
    return st.lists(piece, max_size=8).map(lambda p: MARK_IN + "".join(p) + MARK_OUT)


# userinfo: unreserved, percent-encoded, sub-delims and (in the password) ":".
USERINFO_SECRETS = _secret(_UNRESERVED + "!$&'()*+,;=:")
# query values as signing services write them: base64, percent-encoding, ":" and "@".
QUERY_SECRETS = _secret(_UNRESERVED + "+/=:@!$()*,;")
HEADER_SECRETS = _secret(_UNRESERVED + "+/")
LOWER = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789", min_size=1, max_size=12)
HOSTS = st.one_of(LOWER.map(lambda s: f"{s}.example"), st.just("127.0.0.1:8443"),
                  st.just("[::1]:443"), st.just("gitlab.example"))
PATHS = st.lists(LOWER, max_size=4).map(lambda p: "".join("/" + s for s in p))
SECRET_PARAMS = st.sampled_from([
    "token", "access_token", "private_token", "sig", "signature", "X-Amz-Signature",
    "X-Amz-Credential", "X-Amz-Security-Token", "X-Goog-Signature", "X-Goog-Credential",
    "key", "api_key", "secret", "client_secret", "password", "passwd", "auth", "auth_token",
    "sshkey", "jwt", "session_id"])
CASES = st.sampled_from([str.lower, str.upper, str.title, lambda s: s])
SURROUNDINGS = st.sampled_from([
    "{}", "fatal: unable to access '{}/': The requested URL returned error: 403",
    "fatal: clone of '{}' into submodule path '/tmp/x/sub' failed",
    'cannot fetch "{}"', "git clone of {} failed: fatal: not found", "({})", "<{}>",
    "{} timed out", "location={}&next=1"])


def assert_hidden(text: str) -> None:
    assert MARK_IN not in text and MARK_OUT not in text, text


@st.composite
def urls_with_secrets(draw: st.DrawFn) -> str:
    """A URL (go-getter forms included) that carries one secret in userinfo or query."""
    host, path = draw(HOSTS), draw(PATHS)
    forced = draw(st.sampled_from(["", "git::", "s3::", "hg::"]))
    scheme = draw(st.sampled_from(["https", "http", "git+https"]))
    subdir = draw(st.sampled_from(["", "//modules/vpc", "//*/inner"]))
    where = draw(st.sampled_from(["password", "user", "query"]))
    if where == "password":
        userinfo = f"{draw(LOWER)}:{draw(USERINFO_SECRETS)}@"
    elif where == "user":
        userinfo = draw(USERINFO_SECRETS).replace(":", "%3A") + "@"
    else:
        userinfo = ""
    query = ["ref=v1.2.0"] if draw(st.booleans()) else []
    if where == "query":
        name = draw(CASES)(draw(SECRET_PARAMS))
        query.insert(draw(st.integers(0, len(query))), f"{name}={draw(QUERY_SECRETS)}")
    tail = "?" + "&".join(query) if query else ""
    return f"{forced}{scheme}://{userinfo}{host}{path}{subdir}{tail}"


@given(urls_with_secrets(), SURROUNDINGS)
def test_masked_text_never_holds_the_secret(url: str, surrounding: str) -> None:
    masked = mask_secrets(surrounding.format(url))
    assert_hidden(masked)
    assert mask_secrets(masked) == masked  # idempotent: masking twice changes nothing
    if "ref=v1.2.0" in url:
        assert "ref=v1.2.0" in masked  # harmless parameters stay readable


@given(urls_with_secrets(), st.integers(1, 400), st.booleans())
def test_excerpts_are_masked_before_they_are_cut(url: str, limit: int, tail: bool) -> None:
    text = f"module source {'x' * 150} {url} and more"
    assert_hidden(excerpt(text, limit, tail=tail))


@given(HEADER_SECRETS, st.sampled_from([
    "Authorization: Bearer {}", "authorization: token {}", "Proxy-Authorization: Basic {}",
    "PRIVATE-TOKEN: {}", "X-Api-Key={}", "Authorization: {}", "curl -H 'Authorization: {}'",
    "sent Bearer {}"]))
def test_credential_headers_are_masked(secret: str, template: str) -> None:
    if template == "sent Bearer {}":
        secret += "9"  # a bare "Bearer" is masked only before something token-shaped
    assert_hidden(mask_secrets(template.format(secret)))


@given(urls_with_secrets())
def test_module_source_errors_never_quote_the_secret(url: str) -> None:
    for location in (url, f"{url}&ref=-bad", url.replace("://", "://" + "u" * 190, 1)):
        try:
            parse_source(location)
        except ProxyError as exc:
            assert_hidden(exc.message)
            assert_hidden(str(exc))


@pytest.mark.parametrize(("given_text", "masked"), [
    ("git::https://user:glpat-abc123@gitlab.example/g/net.git?ref=v1",
     "git::https://***@gitlab.example/g/net.git?ref=v1"),
    ("https://oauth2:tok@gitlab.example/g/net.git//modules/vpc?ref=v1.2.0",
     "https://***@gitlab.example/g/net.git//modules/vpc?ref=v1.2.0"),
    ("https://x-access-token:ghs_abc@github.com/o/r.git", "https://***@github.com/o/r.git"),
    ("https://b.s3.amazonaws.com/m.zip?X-Amz-Algorithm=AWS4-HMAC-SHA256"
     "&X-Amz-Credential=AKIA%2F20240101&X-Amz-Signature=abcdef&X-Amz-Security-Token=IQo",
     "https://b.s3.amazonaws.com/m.zip?X-Amz-Algorithm=AWS4-HMAC-SHA256"
     "&X-Amz-Credential=***&X-Amz-Signature=***&X-Amz-Security-Token=***"),
    ("/a.zip?expires=1&sig=abcdef", "/a.zip?expires=1&sig=***"),
    ("remote: invalid token glpat-xyz_789", "remote: invalid token ***"),
    ("a bearer token is required", "a bearer token is required"),
    ("https://registry.example/v1/modules/acme/net/aws/1.2.0/download",
     "https://registry.example/v1/modules/acme/net/aws/1.2.0/download"),
    ("mail a@b.example about https://host.example/x", "mail a@b.example about "
     "https://host.example/x"),
])
def test_secrets_are_masked_and_other_text_kept(given_text: str, masked: str) -> None:
    assert mask_secrets(given_text) == masked


def _raise_with(message: str) -> None:
    raise RuntimeError(message)


def test_log_filter_masks_arguments_and_tracebacks() -> None:
    stream = io.StringIO()
    logger = logging.getLogger("tests.redaction.filter")
    logger.propagate = False
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    try:
        install_log_masking(logger)
        install_log_masking(logger)  # idempotent
        assert sum(isinstance(f, SecretMaskingFilter) for f in handler.filters) == 1
        logger.warning("cloning %s", "https://user:SECRET1@git.example/x.git")
        try:
            _raise_with("git clone of https://u:SECRET2@h/x.git?private_token=SECRET3")
        except RuntimeError:
            logger.exception("failed")
        logger.warning("stack", stack_info=True)
        logger.warning("broken %s %s", "https://u:SECRET4@h/")  # must not raise here
    finally:
        logger.removeHandler(handler)
    text = stream.getvalue()
    assert "SECRET" not in text
    assert "https://***@git.example/x.git" in text and "private_token=***" in text
    assert "RuntimeError" in text and "Stack (most recent call last)" in text
    assert "broken %s %s" in text


def test_command_line_logging_masks_every_record() -> None:
    """What the serve/warm commands set up: aiohttp's and anyone's records are masked."""
    code = (
        "import logging\n"
        "from proxy.cli import configure_logging\n"
        "configure_logging('INFO', '%(name)s %(message)s')\n"
        "logging.getLogger('aiohttp.server').error('bad %s', 'https://u:SECRET1@h/?sig=S2')\n"
        "try:\n"
        "    raise ValueError('https://h/x?X-Amz-Signature=SECRET3')\n"
        "except ValueError:\n"
        "    logging.getLogger('proxy.x').exception('unexpected')\n")
    # The proxy package under test, not whichever one is installed.
    env = {**os.environ, "PYTHONPATH": str(Path(proxy.__file__).resolve().parents[1])}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "aiohttp.server bad https://***@h/?sig=***" in result.stderr
    assert "ValueError: https://h/x?X-Amz-Signature=***" in result.stderr
    assert "SECRET" not in result.stderr
