"""Real `git clone` of a module source over https, submodules included.

Only the https transport is allowed (for submodules too), user and system git configuration
are ignored, prompts are off, and the whole operation has a deadline. git connects only
through the egress gate, which checks every host it goes to: the source, each redirect and
each submodule (see proxy.upstream.egress_gate).
"""

from __future__ import annotations

import asyncio
import errno
import os
import re
import ssl
from pathlib import Path

from proxy.core.errors import UpstreamError, UpstreamTimeout
from proxy.core.executors import quick
from proxy.core.redaction import excerpt, mask_secrets
from proxy.store.disk_space import looks_full, reported_out_of_space
from proxy.upstream.egress_gate import EgressGate

# Not the proxy variables: git's only way out is the gate, which honors them itself.
_PASSED_ENV = ("PATH",)
_MAX_ERROR = 600
# Absolute paths in git's messages: quoted (git quotes the paths it names, spaces and all),
# or a `/` that starts a word (not one inside a URL, a relative path or a replaced root), up
# to a quote or a space.
_QUOTED_PATH = re.compile(r"'/[^'\n]*'")
_LOCAL_PATH = re.compile(r"(?<![\w.:/~>-])/[^\s'\"]*")
LOCAL_PATH = "<local path>"


def git_environment(home: Path, ca_file: Path | None, gate_url: str) -> dict[str, str]:
    """A closed environment for git: nothing from the user's or the system's config (no
    `url.*.insteadOf` rewriting hosts), every connection through the gate at gate_url."""
    env = {key: os.environ[key] for key in _PASSED_ENV if key in os.environ}
    settings = [("protocol.allow", "never"), ("protocol.https.allow", "always"),
                ("credential.helper", ""), ("core.askPass", ""), ("advice.detachedHead",
                                                                   "false"),
                ("http.proxy", gate_url), ("http.proxyAuthMethod", "basic")]
    if ca_file is not None:
        settings.append(("http.sslCAInfo", str(ca_file)))
    env.update({
        "HOME": str(home),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_ALLOW_PROTOCOL": "https",
        "LC_ALL": "C",
        "GIT_CONFIG_COUNT": str(len(settings)),
    })
    for index, (key, value) in enumerate(settings):
        env[f"GIT_CONFIG_KEY_{index}"] = key
        env[f"GIT_CONFIG_VALUE_{index}"] = value
    return env


async def clone(url: str, ref: str | None, destination: Path, *, time_limit: float,
                ca_file: Path | None, gate: EgressGate) -> None:
    """Clone url into destination, check out ref, fetch submodules recursively. OSError
    (ENOSPC or EDQUOT) when git ran out of space, as a write of the proxy's own would."""
    async with gate.session() as session:
        env = git_environment(destination.parent, ca_file, session.proxy_url)
        deadline = asyncio.get_running_loop().time() + time_limit
        for args in (["clone", "--quiet", "--no-checkout", "--", url, str(destination)],
                     ["-C", str(destination), "checkout", "--quiet", ref or "HEAD", "--"],
                     ["-C", str(destination), "submodule", "--quiet", "update", "--init",
                      "--recursive"]):
            await _git(args, env, deadline, url, session.refusals, destination.parent)


async def _git(args: list[str], env: dict[str, str], deadline: float, url: str,
               refusals: list[str], work: Path) -> None:
    refused_before = len(refusals)
    shown = mask_secrets(url)  # the URL git is given may carry credentials; messages never
    remaining = deadline - asyncio.get_running_loop().time()
    if remaining <= 0:
        raise UpstreamTimeout(f"git clone of {shown} timed out")
    try:
        process = await asyncio.create_subprocess_exec(
            "git", *args, env=env, stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    except FileNotFoundError:
        raise UpstreamError("git module sources need the git binary, which is not "
                            "installed") from None
    try:
        _out, err = await asyncio.wait_for(process.communicate(), remaining)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise UpstreamTimeout(f"git clone of {shown} timed out") from None
    except asyncio.CancelledError:
        process.kill()
        await process.wait()
        raise
    if process.returncode != 0:
        step = args[0] if args[0] != "-C" else args[2]
        output = err.decode("utf-8", "replace").strip()
        # git writes only in the work directory, on the cache's disk. It does not always name
        # the cause (a checkout says "unable to write file"): a disk left all but full says it.
        lacking = reported_out_of_space(output)
        if lacking is None and await quick(looks_full, work):
            lacking = errno.ENOSPC
        if lacking is not None:
            raise OSError(lacking, f"git {step} ran out of space: {os.strerror(lacking)}")
        # A hop the gate refused says more than git's "CONNECT tunnel failed". git's output
        # may quote the URL (a submodule's too) with its credentials: mask before cutting, or
        # a cut could hide what marks the secret.
        refused = refusals[refused_before:]
        message = mask_secrets(refused[-1]) if refused else \
            excerpt(without_local_paths(output, work), _MAX_ERROR, tail=True)
        raise UpstreamError(f"git {step} of {shown} failed: {message}")


def without_local_paths(output: str, *roots: Path) -> str:
    """git's output with every absolute path (roots, such as the work directory in the
    cache's temp directory, first; then any other, such as git's own files) replaced: no
    answer or log line shows the proxy's file system."""
    for root in roots:
        output = output.replace(str(root), LOCAL_PATH)
    output = _QUOTED_PATH.sub(f"'{LOCAL_PATH}'", output)
    return _LOCAL_PATH.sub(LOCAL_PATH, output)


def combined_ca_bundle(extra: Path | None, destination: Path) -> Path | None:
    """git takes one CA file: the system store plus the configured extra CAs, or None (git's
    own default) when nothing extra is configured."""
    if extra is None:
        return None
    system = ssl.get_default_verify_paths().openssl_cafile
    parts = []
    for source in (Path(system) if system else None, extra):
        if source is not None and source.is_file():
            parts.append(source.read_bytes().rstrip(b"\n") + b"\n")
    destination.parent.mkdir(parents=True, exist_ok=True)
    destination.write_bytes(b"".join(parts))
    return destination
