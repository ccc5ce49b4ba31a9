"""The project's container image, built and run without a Docker daemon (shared/
CONTAINER-NOTES.md): a Debian bookworm base made with mmdebstrap (no registry image can be
pulled here) and imported into buildah, the real Dockerfile built on it with `buildah build
--isolation chroot`, and commands run in the result with `buildah run` (which shares the
host's network, so a server in it listens on the host's loopback)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
# Paths the runtime provides itself (not the image's file system): left out of comparisons.
_RUNTIME = ("proc", "sys", "dev", "run")


def buildah(*args: str, timeout: float = 600, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
    """buildah ARGS (its output as text); raises with what it printed when it fails."""
    done = subprocess.run(["buildah", *args], capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise RuntimeError(f"buildah {' '.join(args[:3])} failed ({done.returncode}): "
                           f"{done.stderr[-3000:]}")
    return done


def debian_base(work: Path) -> str:
    """A bookworm minbase image, as slim as Debian's own slim images (no manuals, documents
    or translations), made with mmdebstrap from the host's Debian mirror; its name."""
    tar = work / "base.tar"
    subprocess.run(
        ["mmdebstrap", "--variant=minbase", "--include=ca-certificates", "--quiet",
         *(f"--dpkgopt=path-exclude=/usr/share/{part}/*"
           for part in ("doc", "man", "info", "locale")),
         "--dpkgopt=path-include=/usr/share/locale/locale.alias",
         '--customize-hook=rm -rf "$1"/var/cache/apt/*.bin "$1"/var/lib/apt/lists/*',
         "bookworm", str(tar)],
        check=True, capture_output=True, timeout=600)
    name = f"localhost/tf-registry-proxy-test-base:{uuid.uuid4().hex[:12]}"
    container = buildah("from", "scratch").stdout.strip()
    try:
        buildah("add", container, str(tar), "/")
        buildah("commit", "--quiet", container, name)
    finally:
        buildah("rm", container, check=False)
        tar.unlink(missing_ok=True)
    return name


def pip_mounts() -> list[str]:
    """`--volume` options that give pip inside a build what it has here: every pip
    configuration file, the paths they name (CA bundle, constraints, local indexes and
    wheel directories) and the system's CA certificates, read-only, each at its own path."""
    found = subprocess.run(["python3", "-m", "pip", "config", "debug"], capture_output=True,
                           text=True, timeout=60).stdout
    paths = {Path("/etc/ssl/certs")}
    for line in found.splitlines():
        text = line.strip()
        if text.endswith("exists: True"):
            paths.add(Path(text.split(",")[0]))
            continue
        value = text.split("=", 1)[-1] if "=" in text else text.partition(": ")[2]
        for word in value.strip("'\"").split():
            candidate = Path(word.removeprefix("file://"))
            if word.startswith("file://"):  # an index's pages link to files beside it
                candidate = candidate.parent
            if candidate.is_absolute() and candidate.exists():
                paths.add(candidate)
    # One mount per path, none inside a directory mounted already.
    kept = [path for path in paths
            if not any(other != path and other.is_dir() and path.is_relative_to(other)
                       for other in paths)]
    return [option for path in sorted(kept) for option in ("--volume", f"{path}:{path}:ro")]


def build_image(base: str) -> str:
    """The project's Dockerfile built on base (BASE_IMAGE); the image's name."""
    name = f"localhost/tf-registry-proxy-test:{uuid.uuid4().hex[:12]}"
    buildah("build", "--isolation", "chroot", "--format", "docker", "--layers=false",
            "--build-arg", f"BASE_IMAGE={base}", *pip_mounts(), "--file",
            str(ROOT / "Dockerfile"), "--tag", name, str(ROOT), timeout=1200)
    return name


def inspect(image: str) -> dict[str, Any]:
    """The image's configuration as a runtime reads it (Docker format: healthcheck too)."""
    found: dict[str, Any] = json.loads(buildah("inspect", "--type", "image", image).stdout)
    return found


def volume_dir(container: str, path: str) -> Path:
    """Where `buildah run` keeps the container's volume declared at path (the image's
    VOLUME; kept across the runs of one working container, as a runtime keeps a volume)."""
    container_id = buildah("inspect", "--type", "container", "--format",
                           "{{.ContainerID}}", container).stdout.strip()
    graph_root = buildah("info", "--format", "{{.store.GraphRoot}}").stdout.strip()
    return (Path(graph_root) / "overlay-containers" / container_id / "userdata" /
            "buildah-volumes" / hashlib.sha256(path.encode()).hexdigest())


@contextmanager
def working_container(image: str) -> Iterator[str]:
    """A working container of image (removed afterwards)."""
    container = buildah("from", "--quiet", image).stdout.strip()
    try:
        yield container
    finally:
        buildah("rm", container, check=False)


def run_in(container: str, *command: str, env: dict[str, str] | None = None) -> list[str]:
    """The `buildah run` command line that runs command in the container as the image says
    (its user and volumes; the entrypoint is not applied: name the program), with env."""
    options = [f"--env={key}={value}" for key, value in (env or {}).items()]
    return ["buildah", "run", "--isolation", "chroot", *options, container, "--", *command]


@contextmanager
def mounted(container: str) -> Iterator[Path]:
    """The container's root file system, mounted on the host."""
    root = Path(buildah("mount", container).stdout.strip())
    try:
        yield root
    finally:
        buildah("umount", container, check=False)


def snapshot(root: Path, volumes: list[str]) -> dict[str, tuple[int, int, int]]:
    """Size, modification time and mode of everything under root outside the volumes and
    what the runtime provides."""
    skipped = [part.strip("/") for part in (*volumes, *_RUNTIME)]
    found: dict[str, tuple[int, int, int]] = {}
    for directory, subdirectories, files in os.walk(root):
        relative = os.path.relpath(directory, root)
        if relative != "." and any(relative == skip or relative.startswith(skip + "/")
                                   for skip in skipped):
            subdirectories[:] = []
            continue
        for name in files + subdirectories:
            path = os.path.join(directory, name)
            key = os.path.relpath(path, root)
            if key in skipped:
                continue
            try:
                info = os.lstat(path)
            except OSError:
                continue
            found[key] = (info.st_size, info.st_mtime_ns, info.st_mode)
    return found


def remove_images(*names: str) -> None:
    """Remove what the tests built, so that repeated runs do not fill the disk."""
    for name in names:
        buildah("rmi", "--force", name, check=False)
