"""Real `git clone` of a module source over https, submodules included.

Only the https transport is allowed (for submodules too), user and system git configuration
are ignored, prompts are off, and the whole operation has a deadline.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from pathlib import Path

from proxy.errors import UpstreamError, UpstreamTimeout
from proxy.redaction import excerpt, mask_secrets

_PASSED_ENV = ("PATH", "HTTPS_PROXY", "https_proxy", "NO_PROXY", "no_proxy", "ALL_PROXY",
               "all_proxy")
_MAX_ERROR = 600


def git_environment(home: Path, ca_file: Path | None) -> dict[str, str]:
    """A closed environment for git: nothing from the user's or the system's config."""
    env = {key: os.environ[key] for key in _PASSED_ENV if key in os.environ}
    settings = [("protocol.allow", "never"), ("protocol.https.allow", "always"),
                ("credential.helper", ""), ("core.askPass", ""), ("advice.detachedHead",
                                                                   "false")]
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
                ca_file: Path | None) -> None:
    """Clone url into destination, check out ref, fetch submodules recursively."""
    env = git_environment(destination.parent, ca_file)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + time_limit
    await _git(["clone", "--quiet", "--no-checkout", "--", url, str(destination)], env,
               deadline, url)
    await _git(["-C", str(destination), "checkout", "--quiet", ref or "HEAD", "--"], env,
               deadline, url)
    await _git(["-C", str(destination), "submodule", "--quiet", "update", "--init",
                "--recursive"], env, deadline, url)


async def _git(args: list[str], env: dict[str, str], deadline: float, url: str) -> None:
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
        # git's output may quote the URL (a submodule's too) with its credentials: mask
        # before cutting, or a cut could hide what marks the secret.
        message = excerpt(err.decode("utf-8", "replace").strip(), _MAX_ERROR, tail=True)
        raise UpstreamError(f"git {args[0] if args[0] != '-C' else args[2]} of {shown} "
                            f"failed: {message}")


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
