"""Real `git clone` of a module source over https, submodules included.

Only the https transport is allowed (for submodules too), user and system git configuration
are ignored, prompts are off, and the whole operation has a deadline. git connects only
through the egress gate, which checks every host it goes to: the source, each redirect and
each submodule (see proxy.upstream.egress_gate).
"""

from __future__ import annotations

import asyncio
import os
import ssl
from pathlib import Path

from proxy.errors import UpstreamError, UpstreamTimeout
from proxy.redaction import excerpt, mask_secrets
from proxy.upstream.egress_gate import EgressGate

# Not the proxy variables: git's only way out is the gate, which honors them itself.
_PASSED_ENV = ("PATH",)
_MAX_ERROR = 600


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
    """Clone url into destination, check out ref, fetch submodules recursively."""
    async with gate.session() as session:
        env = git_environment(destination.parent, ca_file, session.proxy_url)
        deadline = asyncio.get_running_loop().time() + time_limit
        for args in (["clone", "--quiet", "--no-checkout", "--", url, str(destination)],
                     ["-C", str(destination), "checkout", "--quiet", ref or "HEAD", "--"],
                     ["-C", str(destination), "submodule", "--quiet", "update", "--init",
                      "--recursive"]):
            await _git(args, env, deadline, url, session.refusals)


async def _git(args: list[str], env: dict[str, str], deadline: float, url: str,
               refusals: list[str]) -> None:
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
        # A hop the gate refused says more than git's "CONNECT tunnel failed". git's output
        # may quote the URL (a submodule's too) with its credentials: mask before cutting, or
        # a cut could hide what marks the secret.
        refused = refusals[refused_before:]
        message = mask_secrets(refused[-1]) if refused else \
            excerpt(err.decode("utf-8", "replace").strip(), _MAX_ERROR, tail=True)
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
