"""The Terraform CLI configuration (HCL) that points clients at this proxy."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from proxy.config import Config

MIRROR_PATH = "mirror/"
MODULES_PATH = "modules/"
PROVIDERS_PATH = "providers/"


def render_client_config(config: Config, ca_file: Path | None, mode: str = "mirror") -> str:
    """A ready-to-use CLI config. "mirror": every provider installs through the proxy's
    network mirror, and a `host` block per upstream host sends registry modules through the
    proxy too. "registry": `host` blocks only, for providers and modules, so that clients
    verify signatures themselves and lock files match a direct install."""
    base = config.server.base_url
    lines = [
        f"# Terraform / OpenTofu CLI configuration for tf-registry-proxy at {base}",
        "# Save it as ~/.terraformrc (OpenTofu: ~/.tofurc) or point TF_CLI_CONFIG_FILE at it.",
    ]
    if ca_file is not None:
        lines += [
            "# The proxy's certificate comes from its own CA (created by the first `serve`);",
            "# make clients trust it, e.g. append it to a copy of the system bundle:",
            f"#   cat /etc/ssl/certs/ca-certificates.crt {ca_file} > ~/tfproxy-ca.pem",
            "#   export SSL_CERT_FILE=~/tfproxy-ca.pem",
        ]
    if config.server.public_url is None and config.server.host in ("0.0.0.0", "::", ""):
        lines += [
            "# WARNING: the proxy listens on every interface but server.public_url is not set,",
            "# so this file names it 'localhost': set public_url for other machines.",
        ]
    if mode == "mirror":
        lines += [
            "",
            "provider_installation {",
            "  network_mirror {",
            f'    url = "{base}{MIRROR_PATH}"',
            "  }",
            "}",
        ]
    if config.auth.enabled:
        # Through a `host` block, clients send the token they hold for the original name,
        # so the proxy's token goes under every name that leads to it.
        lines += ["", "# The proxy requires a token: put one of its auth.tokens in each block",
                  "# (or set the TF_TOKEN_ variables for these host names)."]
        for host in [urlsplit(base).netloc, *sorted(config.upstream.all_hosts)]:
            lines += [f'credentials "{host}" {{', '  token = "REPLACE-WITH-YOUR-TOKEN"', "}"]
    for host in sorted(config.upstream.all_hosts):
        services = [f'    "modules.v1" = "{base}{MODULES_PATH}{host}/"']
        what = "Registry modules"
        if mode == "registry":
            services.insert(0, f'    "providers.v1" = "{base}{PROVIDERS_PATH}{host}/"')
            what = "Providers and registry modules"
        lines += [
            "",
            f"# {what} from {host} install through the proxy, from its cache.",
            f'host "{host}" {{',
            "  services = {",
            *services,
            "  }",
            "}",
        ]
    return "\n".join(lines) + "\n"
