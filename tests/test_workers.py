"""Several worker processes on one port, sharing the cache: one upstream fetch per package,
clean shutdown."""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import multiprocessing
import os
import signal
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.cli.workers import RestartBudget, start_worker, take_own_signals
from tests.support.fake_registry import DEFAULT_PLATFORMS, FakeRegistry
from tests.support.metrics import sample
from tests.support.mirror_paths import archive_path
from tests.support.proxy_process import ProxyProcess, free_port, worker_pids


def test_workers_share_one_port_and_one_cache(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    port = free_port()
    cache = tmp_path / "cache"
    config = write_config(cache_dir=cache, port=port)
    proxy = ProxyProcess(config, cache, port, tmp_path / "proxy.log",
                         env={"TF_REGISTRY_PROXY_SERVER_WORKERS": "3"})
    with proxy:
        assert proxy.process is not None
        children = subprocess.run(["pgrep", "-P", str(proxy.process.pid)],
                                  capture_output=True, text=True).stdout.split()
        assert len(children) >= 3
        release = registry.releases[("hashicorp", "null", "3.2.1")]
        registry.faults.add("slowzip")  # keep fills open while the others arrive
        with concurrent.futures.ThreadPoolExecutor(max_workers=24) as pool:
            platforms = DEFAULT_PLATFORMS * 8
            jobs = [pool.submit(proxy.get, archive_path(platform)) for platform in platforms]
            results = [job.result(timeout=60) for job in jobs]
        for platform, body in zip(platforms, results, strict=True):
            assert body == release.zips[platform]
        # 24 requests spread over 3 processes: still one upstream download per package.
        assert sorted(registry.archive_requests()) == sorted(
            f"/files/hashicorp/null/3.2.1/{release.filename(p)}" for p in DEFAULT_PLATFORMS)
        proxy.stop()
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{pid}").exists() for pid in children):
            assert time.monotonic() < deadline, "workers outlived the parent"
            time.sleep(0.1)


def _two_workers(tmp_path: Path, write_config: Callable[..., Path]) -> ProxyProcess:
    """A proxy of two worker processes on tmp_path/cache (not started)."""
    port = free_port()
    cache = tmp_path / "cache"
    return ProxyProcess(write_config(cache_dir=cache, port=port), cache, port,
                        tmp_path / "proxy.log", env={"TF_REGISTRY_PROXY_SERVER_WORKERS": "2"})


def _serving(pids: list[int], client_port: int) -> int:
    """Which of pids holds the server side of the client's connection from client_port."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].rpartition(":")[2], 16) == client_port:
            inodes.add(f"socket:[{fields[9]}]")
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                if os.readlink(fd) in inodes:
                    return pid
            except OSError:
                continue
    raise AssertionError("no worker holds the connection")


def test_a_killed_worker_is_replaced_and_the_other_workers_clients_never_notice(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    """An OOM kill of one worker: the parent starts another (as gunicorn and nginx do), logs
    and counts it; the service goes on, and a client of the other worker sees nothing."""
    cache = tmp_path / "cache"
    proxy = _two_workers(tmp_path, write_config)
    with proxy:
        assert proxy.process is not None
        workers = worker_pids(proxy.process.pid)
        assert len(workers) == 2
        client = http.client.HTTPSConnection("127.0.0.1", proxy.port, timeout=10, context=(
            ssl.create_default_context(cafile=str(proxy.ca_file))))
        client.request("GET", "/healthz")
        assert client.getresponse().read() == b'{"status":"ok"}'
        [killed] = [pid for pid in workers
                    if pid != _serving(workers, client.sock.getsockname()[1])]
        deadline = time.monotonic() + 15
        while not list((cache / "tmp").glob(f"p{killed}-*")):  # the worker is set up
            assert time.monotonic() < deadline, "the worker made no temp directory"
            time.sleep(0.05)
        os.kill(killed, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while len(set(worker_pids(proxy.process.pid)) - {killed}) < 2:
            assert proxy.process.poll() is None, "the service stopped"
            assert time.monotonic() < deadline, "no worker took the killed one's place"
            client.request("GET", "/healthz")  # the other worker's client: never a failure
            answer = client.getresponse()
            assert (answer.status, answer.read()) == (200, b'{"status":"ok"}')
            time.sleep(0.05)
        proxy._log_start = 0
        deadline = time.monotonic() + 20
        while proxy.log.read_text().count("listening on ") < 3:  # the new one serves
            assert time.monotonic() < deadline, "the new worker does not listen"
            time.sleep(0.05)
        metrics = proxy.get("/metrics").decode()
        assert sample(metrics, "tfproxy_worker_restarts_total") == 1
        client.request("GET", "/healthz")
        assert client.getresponse().read() == b'{"status":"ok"}'
        client.close()
    log = proxy.log.read_text()
    assert "was killed by SIGKILL; starting a new one (1 restarts so far)" in log
    assert proxy.process.returncode == 0  # it stopped when told to, not before
    # The killed worker could not remove its temp directory: the parent did.
    assert not list((cache / "tmp").glob(f"p{killed}-*"))


def _connections_to(pid: int, remote_port: int) -> int:
    """How many established TCP connections pid holds to remote_port (on loopback)."""
    inodes = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[2].rpartition(":")[2], 16) == remote_port and fields[3] == "01":
            inodes.add(f"socket:[{fields[9]}]")
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            count += os.readlink(fd) in inodes
        except OSError:
            continue
    return count


def test_a_zip_a_document_announced_finds_a_connection_to_upstream_in_every_worker(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    """VERSION.json names packages the cache lacks: the client asks for one next, on a new
    connection any worker may accept. The worker that answered tells the other, which opens
    a connection to the download's host ahead of it; the zip's fill goes out on that one."""
    proxy = _two_workers(tmp_path, write_config)
    port = proxy.port
    with proxy:
        assert proxy.process is not None
        context = ssl.create_default_context(cafile=str(proxy.ca_file))
        workers = worker_pids(proxy.process.pid)
        assert len(workers) == 2
        client = http.client.HTTPSConnection("127.0.0.1", port, timeout=10, context=context)
        client.request("GET", "/mirror/registry.terraform.io/hashicorp/null/3.2.1.json")
        assert client.getresponse().read()
        [other] = [pid for pid in workers
                   if pid != _serving(workers, client.sock.getsockname()[1])]
        client.close()
        deadline = time.monotonic() + 10
        while _connections_to(other, registry.port) < 1:
            assert time.monotonic() < deadline, "the other worker opened no connection"
            time.sleep(0.05)
        assert _connections_to(other, registry.port) == 1
        for _attempt in range(50):  # the zip on a new connection, as Terraform asks for it
            client = http.client.HTTPSConnection("127.0.0.1", port, timeout=10,
                                                 context=context)
            client.connect()
            if _serving(workers, client.sock.getsockname()[1]) == other:
                break
            client.close()
        else:
            raise AssertionError("no connection reached the other worker")
        client.request("GET", archive_path("linux_amd64"))
        answer = client.getresponse()
        release = registry.releases[("hashicorp", "null", "3.2.1")]
        assert (answer.status, answer.read()) == (200, release.zips["linux_amd64"])
        client.close()
        assert _connections_to(other, registry.port) == 1  # the zip went out on it
        metrics = proxy.get("/metrics").decode()
        assert sample(metrics, "tfproxy_upstream_connections_warmed_total",
                      outcome="opened") == 1


def test_a_second_proxy_on_a_port_in_use_is_refused_and_the_first_serves_alone(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    """SO_REUSEPORT lets a proxy's own workers share its port, and must not let another
    proxy (an offline one, another cache) join them and answer half of their clients."""
    port = free_port()
    workers = {"TF_REGISTRY_PROXY_SERVER_WORKERS": "2"}
    first_config = write_config(cache_dir=tmp_path / "first", port=port).rename(
        tmp_path / "first.toml")
    first = ProxyProcess(first_config, tmp_path / "first", port, tmp_path / "first.log",
                         env=workers)
    second_config = write_config(cache_dir=tmp_path / "second", port=port)
    second_config = second_config.rename(tmp_path / "second.toml")
    second = ProxyProcess(second_config, tmp_path / "second", port, tmp_path / "second.log",
                          env={**workers, "TF_REGISTRY_PROXY_UPSTREAM_MODE": "offline"})
    with first:
        with pytest.raises(RuntimeError, match="proxy exited"):
            second.start()
        assert second.process is not None and second.process.wait(timeout=10) == 2
        log = second.log.read_text()
        assert f"cannot listen on 127.0.0.1:{port}: already in use" in log
        assert "stopping the others" not in log and "listening on" not in log
        modes = [json.loads(first.get("/status.json"))["mode"] for _ in range(8)]
        assert modes == ["online"] * 8


def test_a_crash_loop_stops_restarting() -> None:
    budget = RestartBudget(most=5, window=60.0)
    assert all(budget.allow(float(second)) for second in range(5))
    assert not budget.allow(10.0)  # a sixth within the minute: a crash loop
    assert budget.allow(61.0)  # the first one left the window


def test_workers_on_a_fresh_state_dir_accept_each_others_signed_urls(
        tmp_path: Path, write_config: Callable[..., Path], registry: FakeRegistry) -> None:
    """One URL-signing key for every worker: an archive URL signed by one is valid at all."""
    port, cache, token = free_port(), tmp_path / "cache", "worker-client-token-0123456789"
    config = write_config(cache_dir=cache, port=port, extra=f'[auth]\ntokens = ["{token}"]\n')
    proxy = ProxyProcess(config, cache, port, tmp_path / "proxy.log",
                         env={"TF_REGISTRY_PROXY_SERVER_WORKERS": "2"})
    with proxy:
        context = ssl.create_default_context(cafile=str(proxy.ca_file))
        base = f"{proxy.url}mirror/registry.terraform.io/hashicorp/null/"
        request = urllib.request.Request(f"{base}3.2.1.json",
                                         headers={"Authorization": f"Bearer {token}"})
        with urllib.request.urlopen(request, context=context, timeout=30) as answer:
            signed = json.load(answer)["archives"]["linux_amd64"]["url"]
        assert "sig=" in signed
        # Each request on a new connection: the kernel spreads them over both workers.
        for _ in range(12):
            with urllib.request.urlopen(base + signed, context=context, timeout=30) as answer:
                assert answer.status == 200
    served = {line.split()[3] for line in proxy.log.read_text().splitlines()
              if ".zip?expires=" in line and '" 200 ' in line}
    assert served == {"w0", "w1"}  # both workers accepted the one signature


def _hang_up_on_myself_then_take_over() -> None:
    os.kill(os.getpid(), signal.SIGHUP)  # a SIGHUP forwarded while this worker starts
    time.sleep(0.1)
    take_own_signals()
    time.sleep(0.1)


def test_a_signal_during_a_workers_start_never_runs_the_supervisors_handler() -> None:
    """A forked worker has the supervisor's handlers until it replaces them (a replacement
    is forked while they are installed): a SIGHUP in that window waits until the worker
    handles it itself, instead of running the supervisor's (which looks at processes that
    are not the worker's children)."""
    supervisors = signal.signal(signal.SIGHUP, lambda *_: os._exit(3))
    try:
        worker = multiprocessing.get_context("fork").Process(
            target=_hang_up_on_myself_then_take_over)
        start_worker(worker)
        worker.join(10)
    finally:
        signal.signal(signal.SIGHUP, supervisors)
    assert worker.exitcode == 0
