"""A stand-in for DNS in the egress policy: names resolve as a test says, every other name
fails as an unknown name does, and no query leaves the machine."""

from __future__ import annotations

import ipaddress
import socket

import pytest

from proxy.upstream import egress

LOCAL_NAMES = {"localhost": ["127.0.0.1"]}


def fake_dns(monkeypatch: pytest.MonkeyPatch, names: dict[str, list[str]] | None = None
             ) -> None:
    """Answer the policy's local lookups from names (plus localhost)."""
    table = {**LOCAL_NAMES, **(names or {})}

    async def lookup(host: str, port: int) -> list[egress.IPAddress]:
        host.encode("idna")  # as getaddrinfo does first: UnicodeError for an invalid name
        addresses = table.get(host.lower().rstrip("."))
        if addresses is None:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [ipaddress.ip_address(a) for a in addresses]

    monkeypatch.setattr(egress, "lookup", lookup)
