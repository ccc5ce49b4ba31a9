"""Several proxy processes (replicas) on one S3 bucket: each its own port and empty cache.dir,
the same bucket and prefix, credentials from the environment as the AWS chain reads them."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from tests.support.proxy_process import ProxyProcess, free_port
from tests.support.seaweedfs import S3Server


def s3_table(server: S3Server, bucket: str) -> str:
    """The [cache.s3] table of a replica's config file."""
    return (f'\n[cache.s3]\nbucket = "{bucket}"\nendpoint_url = "{server.endpoint_url}"\n'
            f'region = "{server.region}"\n')


def s3_env(server: S3Server, lease_seconds: float | None = None) -> dict[str, str]:
    """The server's keys as the AWS chain's first link, nothing else of the chain consulted;
    and the fill lease duration, if given."""
    env = {"AWS_ACCESS_KEY_ID": server.access_key, "AWS_SECRET_ACCESS_KEY": server.secret_key,
           "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
           "AWS_EC2_METADATA_DISABLED": "true"}
    if lease_seconds is not None:
        env["TF_REGISTRY_PROXY_CACHE_LEASE_SECONDS"] = str(lease_seconds)
    return env


@contextmanager
def s3_replicas(work: Path, count: int, write: Callable[[Path, int], str],
                env: dict[str, str]) -> Iterator[list[ProxyProcess]]:
    """count proxy processes started at once, each from the config text write(cache_dir,
    port) in a file of its own; stopped on exit."""
    processes = []
    for n in range(count):
        port, cache = free_port(), work / f"replica-{n}"
        config = work / f"replica-{n}.toml"
        config.write_text(write(cache, port))
        processes.append(ProxyProcess(config, cache, port, work / f"replica-{n}.log", env=env))
    with ExitStack() as stack:
        for process in processes:
            stack.callback(process.stop)
        processes[0].start()  # the first writes the shared state (the TLS CA) alone
        with ThreadPoolExecutor(count) as pool:
            list(pool.map(ProxyProcess.start, processes[1:]))
        yield processes


def lease_holder(server: S3Server, bucket: str, prefix: str = "tfproxy/") -> str | None:
    """The holder named by the one fill lease document in the bucket, or None."""
    client: Any = server.client()
    found = client.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}index/leases/")
    keys = [item["Key"] for item in found.get("Contents", [])]
    if not keys:
        return None
    body = client.get_object(Bucket=bucket, Key=keys[0])["Body"].read()
    return str(json.loads(body)["holder"])


def fetch(proxy: ProxyProcess, path: str, timeout: float = 60) -> tuple[int, bytes]:
    """GET path: the status and body (errors too, not raised)."""
    context = ssl.create_default_context(cafile=str(proxy.ca_file))
    try:
        with urllib.request.urlopen(proxy.url + path.lstrip("/"), context=context,
                                    timeout=timeout) as response:
            return int(response.status), bytes(response.read())
    except urllib.error.HTTPError as exc:
        return int(exc.code), bytes(exc.read())
