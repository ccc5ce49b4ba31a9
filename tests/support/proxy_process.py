"""The proxy as a real server process (`python -m proxy serve`), as users run it."""

from __future__ import annotations

import os
import re
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType


def worker_pids(parent: int) -> list[int]:
    """A `serve` parent's worker processes (forked: its children)."""
    children = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True,
                              timeout=30).stdout.split()
    return [int(pid) for pid in children]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ProxyProcess:
    """Starts `python -m proxy serve --config FILE`, waits until /healthz answers over HTTPS."""

    def __init__(self, config: Path, cache_dir: Path, port: int, log: Path,
                 env: dict[str, str] | None = None) -> None:
        self.extra_env = env or {}
        self.config = config
        self.cache_dir = cache_dir
        self.port = port
        self.log = log
        self.process: subprocess.Popen[bytes] | None = None
        self._ca_file: Path | None = None
        self._log_start = 0

    @property
    def ca_file(self) -> Path:
        """The CA the proxy tells operators to give clients (its start-up log line)."""
        if self._ca_file is None:
            raise RuntimeError(f"the proxy named no CA to trust: {self.log.read_text()[-3000:]}")
        return self._ca_file

    def _announced_ca(self) -> Path | None:
        written = self.log.read_bytes()[self._log_start:] if self.log.exists() else b""
        found = re.findall(r"clients add the CA ([^\s\"]+) to their trust",
                           written.decode(errors="replace"))
        return Path(found[-1]) if found else None

    def _all_listening(self) -> bool:
        """Whether every worker process said it listens (else requests reach only some)."""
        written = self.log.read_bytes()[self._log_start:] if self.log.exists() else b""
        asked = self._env()["TF_REGISTRY_PROXY_SERVER_WORKERS"]
        workers = int(asked) if asked.isdigit() else 1
        return written.count(b"listening on ") >= workers

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}/"

    def cli(self, *args: str, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run another subcommand with the same config (and environment, plus env)."""
        return subprocess.run([sys.executable, "-m", "proxy", *args, "--config", str(self.config)],
                              capture_output=True, text=True, timeout=timeout,
                              env={**self._env(), **(env or {})})

    def _env(self) -> dict[str, str]:
        # PYTHONPATH passes through: the checkout under test, not another install. The
        # default state directory must not be inside the cache (HOME is the cache here).
        inherited = {k: os.environ[k] for k in ("PYTHONPATH",) if k in os.environ}
        return {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(self.cache_dir),
                "XDG_STATE_HOME": f"{self.cache_dir}-state", "PYTHONUNBUFFERED": "1",
                # One process unless the test asks for more (env): the default is one per
                # CPU, and tests read one process's metrics and logs.
                "TF_REGISTRY_PROXY_SERVER_WORKERS": "1",
                **inherited, **self.extra_env}

    def start(self) -> ProxyProcess:
        self._log_start = self.log.stat().st_size if self.log.exists() else 0
        self._ca_file = None
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "proxy", "serve", "--config", str(self.config)],
                stdout=log, stderr=subprocess.STDOUT, env=self._env())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"proxy exited: {self.log.read_text()[-3000:]}")
            ca_file = self._announced_ca()
            if ca_file is not None and self._all_listening() and self._healthy(ca_file):
                self._ca_file = ca_file
                return self
            time.sleep(0.1)
        raise RuntimeError(f"proxy did not become healthy: {self.log.read_text()[-3000:]}")

    def get(self, path: str, timeout: float = 30) -> bytes:
        """GET path over HTTPS, trusting the proxy's CA; the body (an HTTP error raises)."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        with urllib.request.urlopen(self.url + path.lstrip("/"), context=context,
                                    timeout=timeout) as response:
            return bytes(response.read())

    def _healthy(self, ca_file: Path) -> bool:
        context = ssl.create_default_context(cafile=str(ca_file))
        try:
            with urllib.request.urlopen(f"{self.url}healthz", context=context, timeout=2) as r:
                return bool(r.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> ProxyProcess:
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()
