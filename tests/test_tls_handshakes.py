"""Failed TLS handshakes (a client that does not trust the proxy's CA, plain HTTP on the
HTTPS port) are logged with the client's address and reason, rate-limited, and counted."""

from __future__ import annotations

import logging
import re
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.core.metrics import Metrics
from proxy.web.tls_server import HandshakeFailures
from tests.support.fake_registry import FakeRegistry
from tests.support.metrics import sample
from tests.support.proxy_process import ProxyProcess, free_port

HANDSHAKE_FAILURES = "tfproxy_tls_handshake_failures_total"


def test_untrusting_clients_are_logged_and_counted(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    port, cache = free_port(), tmp_path / "cache"
    with ProxyProcess(write_config(cache_dir=cache, port=port), cache, port,
                      tmp_path / "proxy.log") as proxy:
        untrusting = ssl.create_default_context()  # the system's CAs, not the proxy's
        for _ in range(5):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, \
                    pytest.raises(ssl.SSLCertVerificationError):
                untrusting.wrap_socket(raw, server_hostname="localhost")
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            raw.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")  # not TLS
            raw.recv(100)
        deadline = time.monotonic() + 10
        while sample(text := proxy.get("/metrics").decode(), HANDSHAKE_FAILURES,
                     reason="plain_http") != 1.0 \
                or sample(text, HANDSHAKE_FAILURES, reason="untrusted_certificate") != 5.0:
            assert time.monotonic() < deadline, text
            time.sleep(0.1)
        ca_file = proxy.ca_file
    lines = [line for line in proxy.log.read_text().splitlines() if "TLS handshake" in line]
    # Six failures within seconds: one line (the rest are counted, not logged).
    assert len(lines) == 1, lines
    assert re.search(r" WARNING proxy\.web\.tls_server: TLS handshake with 127\.0\.0\.1:\d+ "
                     r"failed: "
                     r"the client does not trust this proxy's certificate \(tlsv1 alert "
                     rf"unknown ca\); clients must trust the CA {re.escape(str(ca_file))} ",
                     lines[0]), lines[0]
    assert "Traceback" not in proxy.log.read_text()


def alert(reason: str) -> ssl.SSLError:
    error = ssl.SSLError(1, f"[SSL: {reason}] handshake failed")
    error.reason = reason
    return error


def test_handshake_failures_are_rate_limited(caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    now = [100.0]
    failures = HandshakeFailures(metrics.tls_handshake_failures, "trust the CA /x/ca.pem",
                                 interval=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="proxy.web.tls_server"):
        failures.record(("10.0.0.7", 50000), alert("TLSV1_ALERT_UNKNOWN_CA"))
        for _ in range(3):
            now[0] += 3
            failures.record(("10.0.0.8", 50001), alert("HTTP_REQUEST"))
        now[0] += 2  # 11 s after the first line
        failures.record(("::1", 50002, 0, 0), alert("NO_SHARED_CIPHER"))
    messages = [record.getMessage() for record in caplog.records]
    assert messages == [
        "TLS handshake with 10.0.0.7:50000 failed: the client does not trust this proxy's "
        "certificate (tlsv1 alert unknown ca); trust the CA /x/ca.pem",
        "TLS handshake with [::1]:50002 failed: the client and the proxy share no TLS "
        "version or cipher (the proxy needs TLS 1.2 or later) (no shared cipher) (3 more "
        "failed handshakes not logged since the last line)",
    ]
    text = metrics.render().decode()
    assert sample(text, HANDSHAKE_FAILURES, reason="untrusted_certificate") == 1.0
    assert sample(text, HANDSHAKE_FAILURES, reason="plain_http") == 3.0
    assert sample(text, HANDSHAKE_FAILURES, reason="protocol_mismatch") == 1.0
