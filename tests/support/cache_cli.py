"""A cache filled through a real proxy process from the fake registry, for the cache commands'
tests: what was fetched (with its bytes), waiting for a fill's last read, and the index read
as the commands leave it."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import diskcache

from tests.support.fake_registry import FakeRegistry
from tests.support.proxy_process import ProxyProcess
from tests.support.seaweedfs import S3Server

HOST = "registry.terraform.io"
NULL = f"{HOST}/hashicorp/null"
RANDOM = f"{HOST}/hashicorp/random"
TARBALL = f"{HOST}/acme/tarball/aws"


@dataclass(frozen=True)
class Fetched:
    """One package or module archive fetched through the proxy."""

    address: str
    version: str
    platform: str | None
    data: bytes

    @property
    def key(self) -> str:
        """Its store key."""
        if self.platform is None:
            return f"modules/{self.address}/{self.version}.tar.gz"
        type_ = self.address.rsplit("/", 1)[1]
        return (f"archives/{self.address}/{self.version}/"
                f"terraform-provider-{type_}_{self.version}_{self.platform}.zip")

    @property
    def record(self) -> str:
        """The index key of the record that vouches for it."""
        if self.platform is None:
            return f"module-archive/{self.address}/{self.version}"
        return f"package/{self.address}/{self.version}/{self.platform}"


def fetch_package(proxy: ProxyProcess, registry: FakeRegistry, address: str, version: str,
                  platform: str) -> Fetched:
    """GET one provider package through the proxy's network mirror."""
    _host, namespace, type_ = address.split("/")
    release = registry.releases[(namespace, type_, version)]
    data = proxy.get(f"/mirror/{address}/{release.filename(platform)}")
    assert data == release.zips[platform]
    return Fetched(address, version, platform, data)


def fetch_module(proxy: ProxyProcess, address: str, version: str) -> Fetched:
    """Ask for a module version's download, then GET the archive it names."""
    location = json.loads(proxy.get(f"/modules/{address}/{version}/download"))["location"]
    return Fetched(address, version, None, proxy.get(urlsplit(location).path))


def fill(proxy: ProxyProcess, registry: FakeRegistry) -> list[Fetched]:
    """Two packages of null, one of random, one module archive."""
    return [fetch_package(proxy, registry, NULL, "3.2.1", "linux_amd64"),
            fetch_package(proxy, registry, NULL, "3.2.1", "darwin_arm64"),
            fetch_package(proxy, registry, RANDOM, "3.6.0", "linux_amd64"),
            fetch_module(proxy, TARBALL, "1.0.0")]


def disk_index(cache: Path) -> diskcache.Cache:
    """The cache directory's index, as the proxy keeps it (close it after use)."""
    return diskcache.Cache(str(cache / "index"))


def wait_for_h1(cache: Path, fetched: list[Fetched]) -> None:
    """Until each package's fill recorded its h1 (its last read of the stored zip)."""
    deadline = time.monotonic() + 20
    index = disk_index(cache)
    try:
        for item in fetched:
            while item.platform is not None and not (index.get(item.record) or {}).get("h1"):
                assert time.monotonic() < deadline, f"no h1 recorded for {item.key}"
                time.sleep(0.05)
    finally:
        index.close()


def listed(result: subprocess.CompletedProcess[str]) -> set[tuple[Any, ...]]:
    """What `cache list --json` printed: (address, version, platform, size, recorded)."""
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    return {(e["address"], e["version"], e.get("platform"), e["size"], e["recorded"])
            for e in document["providers"] + document["modules"]}


def expected(fetched: list[Fetched]) -> set[tuple[Any, ...]]:
    """What `listed` should give for these."""
    return {(f.address, f.version, f.platform, len(f.data), True) for f in fetched}


def no_escapes(result: subprocess.CompletedProcess[str]) -> None:
    """Output for a pipe: no terminal control sequence, no traceback."""
    for stream in (result.stdout, result.stderr):
        assert "\x1b" not in stream and "Traceback" not in stream, stream


def s3_table(server: S3Server, bucket: str) -> str:
    """The [cache.s3] table for a bucket of the test server."""
    return (f'[cache.s3]\nbucket = "{bucket}"\nendpoint_url = "{server.endpoint_url}"\n'
            f'region = "{server.region}"\n')


def s3_environment(server: S3Server) -> dict[str, str]:
    """The server's keys for a process's environment, and no other credential source."""
    return {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key,
            "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
            "AWS_EC2_METADATA_DISABLED": "true"}


def on_terminal(config: Path, home: Path, *args: str) -> tuple[str, str]:
    """Run `python -m proxy ARGS --config FILE` with stderr on a pseudo-terminal (stdout to a
    pipe); what it printed to each."""
    leader, follower = pty.openpty()
    try:
        result = subprocess.run(
            [sys.executable, "-m", "proxy", *args, "--config", str(config)],
            stdout=subprocess.PIPE, stderr=follower, text=True, timeout=60,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(home),
                 "TERM": "xterm-256color", "COLUMNS": "120",
                 **{k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}})
    finally:
        os.close(follower)
    shown = bytearray()
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # EIO: the terminal's other end is closed and drained
            break
        if not chunk:
            break
        shown += chunk
    os.close(leader)
    return result.stdout, shown.decode(errors="replace")
