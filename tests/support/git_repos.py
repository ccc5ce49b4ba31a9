"""Real git repositories for module sources, published as bare repositories that the fake
registry serves over HTTPS with the dumb HTTP protocol (`git update-server-info`)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

_IDENTITY = {"GIT_AUTHOR_NAME": "Test", "GIT_AUTHOR_EMAIL": "test@example.test",
             "GIT_COMMITTER_NAME": "Test", "GIT_COMMITTER_EMAIL": "test@example.test",
             "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull}


def git(*args: str, cwd: Path) -> str:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(cwd), **_IDENTITY}
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True,
                          text=True, timeout=60).stdout.strip()


def publish_repo(git_root: Path, name: str, work: Path, files: dict[str, bytes],
                 tag: str | None = None,
                 submodules: dict[str, tuple[str, str]] | None = None) -> str:
    """Commit files (and gitlinks path -> (url, commit)) in a new repository, tag it, and
    publish it as git_root/NAME.git. Returns the commit id."""
    work.mkdir(parents=True)
    git("init", "--quiet", "--initial-branch=main", cwd=work)
    for path, content in files.items():
        target = work / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
    git("add", "--all", cwd=work)
    for path, (url, commit) in (submodules or {}).items():
        git("config", "-f", ".gitmodules", f"submodule.{path}.path", path, cwd=work)
        git("config", "-f", ".gitmodules", f"submodule.{path}.url", url, cwd=work)
        git("update-index", "--add", "--cacheinfo", f"160000,{commit},{path}", cwd=work)
        git("add", ".gitmodules", cwd=work)
    git("commit", "--quiet", "-m", "release", cwd=work)
    if tag:
        git("tag", tag, cwd=work)
    bare = git_root / f"{name}.git"
    git("clone", "--quiet", "--bare", str(work), str(bare), cwd=work.parent)
    git("update-server-info", cwd=bare)
    return git("rev-parse", "HEAD", cwd=work)
