"""The servers the bench compares: the proxy (`python -m proxy serve`, as users run it), nginx
serving the same bytes as static files, and the bare-aiohttp floors (bench/floor.py for JSON,
bench/filefloor.py for files). All of them listen on 127.0.0.1 over TLS with the same
certificate, issued by the proxy's own CA."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.measure import fetch
from bench.upstream import HOST, Upstream
from proxy.config import ServerConfig
from proxy.tls.certificates import ServingCertificate, ensure_certificate
from tests.support.fake_registry import FakeRegistry
from tests.support.proxy_process import ProxyProcess, free_port

FLOOR_SCRIPT = Path(__file__).resolve().parent / "floor.py"
FILE_FLOOR_SCRIPT = FLOOR_SCRIPT.with_name("filefloor.py")
CHECKOUT = FLOOR_SCRIPT.parent.parent
TOOLS = (("nginx", "nginx-light"), ("wrk", "wrk"), ("curl", "curl"))


def ensure_tools() -> None:
    """nginx, wrk and curl from Debian's packages, installed when missing."""
    missing = [package for tool, package in TOOLS if which(tool) is None]
    if missing:
        print(f"installing {' '.join(missing)} ...", flush=True)
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True,
                       stdout=subprocess.DEVNULL, env={**os.environ,
                                                       "DEBIAN_FRONTEND": "noninteractive"})


def which(tool: str) -> str | None:
    """A tool's path; nginx lives in /usr/sbin, often not on PATH."""
    found = shutil.which(tool)
    if found is None and Path(f"/usr/sbin/{tool}").exists():
        found = f"/usr/sbin/{tool}"
    return found


def serving_certificate(state_dir: Path) -> ServingCertificate:
    """The proxy's generated CA and server certificate (created now, as its first start
    would), which nginx and the floor serve with too: every client trusts one CA."""
    return ensure_certificate(ServerConfig(host="127.0.0.1", state_dir=state_dir))


@dataclass(frozen=True)
class Server:
    """A server under test: its base URL, the CA its certificate chains to, its main process
    (CPU and memory are read from it and its children)."""

    name: str
    base: str
    ca: Path
    pid: int

    def url(self, path: str) -> str:
        return self.base + path

    def get(self, path: str) -> bytes:
        """GET path; anything but 200 raises."""
        return fetch(self.ca, self.url(path))


def proxy_config(port: int, state_dir: Path, cache: Path, registry: FakeRegistry,
                 ca_file: Path, workers: int | str = 1, access_log: str | None = None) -> str:
    """A proxy's configuration file: the fake registry as registry.terraform.io; the
    shipped defaults otherwise (the access log on, unless access_log says otherwise)."""
    return f"""
[server]
listen = "127.0.0.1:{port}"
{"" if access_log is None else f'access_log = "{access_log}"'}
state_dir = "{state_dir}"
workers = "{workers}"
[cache]
dir = "{cache}"
[upstream]
ca_bundle = "{ca_file}"
[upstream.hosts."{HOST}".services]
"providers.v1" = "{registry.providers_url}"
"modules.v1" = "{registry.url}/v1/modules/"
"""


@contextmanager
def proxy(work: Path, upstream: Upstream, state_dir: Path, cache: Path,
          workers: int | str, access_log: str | None = None) -> Iterator[Server]:
    """A proxy process on cache with `workers` processes (a number or "auto"), its access
    log as shipped (plain, to its stderr: a file here) unless access_log says otherwise."""
    port = free_port()
    config = work / f"proxy-{port}.toml"
    config.write_text(proxy_config(port, state_dir, cache, upstream.registry, upstream.ca_file,
                                   workers, access_log))
    # ProxyProcess pins one worker through the environment (as tests want): say ours there.
    # The proxy measured is this checkout's, whatever the current directory: `python -m`
    # would put the current directory first on sys.path (another checkout's proxy, when
    # the bench of one runs from the other's directory) unless told not to.
    path = os.pathsep.join(filter(None, (str(CHECKOUT), os.environ.get("PYTHONPATH"))))
    process = ProxyProcess(config, cache, port, work / f"proxy-{port}.log",
                           env={"TF_REGISTRY_PROXY_SERVER_WORKERS": str(workers),
                                "PYTHONPATH": path, "PYTHONSAFEPATH": "1"})
    with process:
        assert process.process is not None
        yield Server(f"proxy ({workers} workers"
                     f"{'' if access_log is None else f', access log {access_log}'})",
                     f"https://127.0.0.1:{port}",
                     process.ca_file, process.process.pid)


@contextmanager
def nginx(work: Path, root: Path, certificate: ServingCertificate, ca: Path,
          workers: int) -> Iterator[Server]:
    """nginx serving root as static files, with `workers` worker processes."""
    port = free_port()
    conf = work / f"nginx-{port}.conf"
    temp = work / "nginx-temp"
    temp.mkdir(exist_ok=True)
    # Connections are kept for as many requests as wrk sends, as the proxy keeps them: the
    # figure is serving requests, not TLS handshakes.
    conf.write_text(f"""
worker_processes {workers};
pid {work}/nginx-{port}.pid;
error_log {work}/nginx-{port}.err warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  sendfile on;
  tcp_nopush on;
  keepalive_requests 1000000;
  default_type application/octet-stream;
  types {{ application/json json; application/zip zip; application/gzip gz; }}
  client_body_temp_path {temp}/body;
  proxy_temp_path {temp}/proxy;
  fastcgi_temp_path {temp}/fastcgi;
  uwsgi_temp_path {temp}/uwsgi;
  scgi_temp_path {temp}/scgi;
  server {{
    listen 127.0.0.1:{port} ssl;
    ssl_certificate {certificate.cert};
    ssl_certificate_key {certificate.key};
    root {root};
    location ~ /versions$ {{
      default_type application/json;
    }}
    location ~ /download$ {{
      add_header X-Terraform-Get "https://127.0.0.1:{port}/modules/net.tar.gz";
      return 204;
    }}
  }}
}}
""")
    binary = which("nginx")
    assert binary is not None
    process = subprocess.Popen([binary, "-c", str(conf), "-g", "daemon off;"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        server = Server(f"nginx ({workers} workers)", f"https://127.0.0.1:{port}", ca,
                        process.pid)
        _wait_listening(server, process, work / f"nginx-{port}.err")
        yield server
    finally:
        _stop(process)


@contextmanager
def floor(work: Path, root: Path, certificate: ServingCertificate, ca: Path,
          processes: int = 1) -> Iterator[Server]:
    """The bare-aiohttp floor: `processes` processes answering every JSON file under root
    from memory."""
    with _floor_script(work, f"bare aiohttp floor ({processes} process"
                       f"{'es' if processes > 1 else ''})", FLOOR_SCRIPT,
                       [root, processes], certificate, ca) as server:
        yield server


@contextmanager
def file_floor(work: Path, root: Path, certificate: ServingCertificate, ca: Path,
               processes: int) -> Iterator[Server]:
    """The bare-aiohttp file floor: `processes` processes serving every zip under root from
    disk."""
    with _floor_script(work, f"bare aiohttp file floor ({processes} processes)",
                       FILE_FLOOR_SCRIPT, [root, processes], certificate, ca) as server:
        yield server


@contextmanager
def _floor_script(work: Path, name: str, script: Path, arguments: list[Path | int],
                  certificate: ServingCertificate, ca: Path) -> Iterator[Server]:
    """`python script PORT CERT KEY *arguments`, until the block ends."""
    port = free_port()
    log = work / f"{script.stem}-{port}.log"
    with open(log, "wb") as output:
        process = subprocess.Popen(
            [sys.executable, str(script), str(port), str(certificate.cert),
             str(certificate.key), *map(str, arguments)], stdout=output,
            stderr=subprocess.STDOUT)
    try:
        server = Server(name, f"https://127.0.0.1:{port}", ca, process.pid)
        _wait_listening(server, process, log)
        yield server
    finally:
        _stop(process)


def _wait_listening(server: Server, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{server.name} exited: {log.read_text(errors='replace')}")
        result = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                                 "--cacert", str(server.ca), server.url("/")],
                                capture_output=True, text=True)
        if result.stdout not in ("", "000"):
            return
        time.sleep(0.1)
    raise RuntimeError(f"{server.name} did not start: {log.read_text(errors='replace')}")


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


class StaticTree:
    """What nginx and the floor serve: the proxy's answers (documents, zips) as files under
    the same paths, and a static module registry for the `terraform init` figure."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)

    def write(self, path: str, data: bytes) -> None:
        target = self.root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)

    def copy_from(self, server: Server, path: str) -> bytes:
        """The server's answer for path, written at path; returns it."""
        data = server.get(path)
        self.write(path, data)
        return data
