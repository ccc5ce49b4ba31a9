"""CNCF Distribution (Debian's docker-registry) as a pull-through cache of another registry:
the shape an organization's own registry takes in front of the proxy."""

from __future__ import annotations

import ssl
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

import trustme

from tests.support.proxy_process import free_port
from tests.support.tools import unpacked_tool


class PullThroughRegistry:
    """`docker-registry serve` over HTTPS (a certificate from ca) with `proxy.remoteurl`
    set to remote, which it trusts through ca_file (Go reads SSL_CERT_FILE)."""

    def __init__(self, work: Path, ca: trustme.CA, remote: str, remote_ca_file: Path,
                 username: str = "", password: str = "") -> None:
        self.binary = unpacked_tool("docker-registry", "docker-registry")
        self.port = free_port()
        self.url = f"https://127.0.0.1:{self.port}"
        work.mkdir(parents=True, exist_ok=True)
        certificate = ca.issue_cert("127.0.0.1")
        certificate.cert_chain_pems[0].write_to_path(str(work / "cert.pem"))
        certificate.private_key_pem.write_to_path(str(work / "key.pem"))
        credentials = f"\n  username: {username}\n  password: {password}" if password else ""
        self.config = work / "config.yml"
        self.config.write_text(f"""version: 0.1
log:
  level: info
storage:
  filesystem:
    rootdirectory: {work / 'storage'}
  delete:
    enabled: true
http:
  addr: 127.0.0.1:{self.port}
  tls:
    certificate: {work / 'cert.pem'}
    key: {work / 'key.pem'}
proxy:
  remoteurl: {remote}{credentials}
""")
        self.ca_file = work / "ca.pem"
        ca.cert_pem.write_to_path(str(self.ca_file))
        self._remote_ca_file = remote_ca_file
        self.log = work / "registry.log"
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> PullThroughRegistry:
        with open(self.log, "ab") as log:
            self._process = subprocess.Popen(
                [self.binary, "serve", str(self.config)], stdout=log, stderr=subprocess.STDOUT,
                env={"PATH": "/usr/bin:/bin", "SSL_CERT_FILE": str(self._remote_ca_file)})
        context = ssl.create_default_context(cafile=str(self.ca_file))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(f"registry exited: {self.log.read_text()[-3000:]}")
            try:
                urllib.request.urlopen(f"{self.url}/v2/", context=context, timeout=2).close()
                return self
            except urllib.error.HTTPError:
                return self  # it answers (a 401 would do)
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"registry did not start: {self.log.read_text()[-3000:]}")

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
