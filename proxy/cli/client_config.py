"""The Terraform CLI configuration (HCL) that points clients at this proxy."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from proxy.config import Config

MIRROR_PATH = "mirror/"
MODULES_PATH = "modules/"
PROVIDERS_PATH = "providers/"
# The OCI repository of a provider: /v2/providers/HOST/NAMESPACE/TYPE on the proxy.
OCI_REPOSITORY_TEMPLATE = "providers/${hostname}/${namespace}/${type}"
# The OCI repository of a module: /v2/modules/HOST/NAMESPACE/NAME/SYSTEM on the proxy.
OCI_MODULE_SOURCE = "modules/HOST/NAMESPACE/NAME/SYSTEM?tag=VERSION"
MODES = ("mirror", "registry", "oci")


class ClientConfigError(ValueError):
    """The configuration cannot be expressed in the requested mode."""


# What each mode writes into .terraform.lock.hcl: the choice, said where it is made.
_LOCK_FILES = {
    "mirror": [
        "# Mode: mirror (network_mirror). Lock files get the h1: hash of this machine's",
        "# platform only (Terraform warns \"Incomplete lock file information\"). For a lock",
        "# file to commit, with the zh: hashes of every platform as a direct install writes",
        "# them, use `client-config --mode registry` instead.",
    ],
    "registry": [
        "# Mode: registry (providers.v1 through the proxy). Terraform checks the signatures",
        "# itself and writes the zh: hashes of every platform, as a direct install does:",
        "# lock files to commit.",
    ],
    "oci": [
        "# Mode: oci (oci_mirror). Lock files get the h1: hash of this machine's platform",
        "# only; `--mode registry` writes the zh: hashes of every platform.",
    ],
}


def render_client_config(config: Config, ca_file: Path | None, mode: str = "mirror") -> str:
    """A ready-to-use CLI config. "mirror": every provider installs through the proxy's
    network mirror, and a `host` block per upstream host sends registry modules through the
    proxy too. "registry": `host` blocks only, for providers and modules, so that clients
    verify signatures themselves and lock files match a direct install. "oci": OpenTofu's
    `oci_mirror` for providers, `host` blocks for modules."""
    base = config.server.base_url
    proxy_host = urlsplit(base).netloc
    if mode == "oci":
        lines = [
            f"# OpenTofu CLI configuration for tf-registry-proxy at {base}",
            "# Save it as ~/.tofurc or point TF_CLI_CONFIG_FILE at it (oci_mirror needs",
            "# OpenTofu 1.10 or later; Terraform does not read it).",
        ]
    else:
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
    lines += _LOCK_FILES[mode]
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
    if mode == "oci":
        lines += _oci_mirror_lines(config, proxy_host)
    if config.auth.enabled:
        # Through a `host` block, clients send the token they hold for the original name,
        # so the proxy's token goes under every name that leads to it.
        lines += ["", "# The proxy requires a token: put one of its auth.tokens in each block",
                  "# (or set the TF_TOKEN_ variables for these host names)."]
        for host in [proxy_host, *sorted(config.upstream.all_hosts)]:
            lines += [f'credentials "{host}" {{', '  token = "REPLACE-WITH-YOUR-TOKEN"', "}"]
    if mode == "oci" and config.auth.enabled:
        lines += [
            "",
            "# OCI requests authenticate separately: the proxy's token is the password (any",
            "# user name), exchanged for a Bearer token at /v2/token. `docker login` or",
            "# `oras login` to this host with the token as password works as well.",
            f'oci_credentials "{proxy_host}" {{',
            '  username = "tofu"',
            '  password = "REPLACE-WITH-YOUR-TOKEN"',
            "}",
        ]
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
    if mode == "oci":
        lines += [
            "",
            "# Registry modules can also come as OCI artifacts (an OCI-only policy, or your own",
            "# registry's pull-through cache in front of the proxy): a module block's source,",
            "# with an exact version (oci:// takes no constraint; `+` in a version is `_`):",
            f'#   source = "oci://{proxy_host}/{OCI_MODULE_SOURCE}"',
        ]
    return "\n".join(lines) + "\n"


def _oci_mirror_lines(config: Config, proxy_host: str) -> list[str]:
    """The `provider_installation` block with one `oci_mirror` for the served hosts."""
    # An OCI repository name has no ':', so a registry host with a port cannot be part of
    # one: such hosts are left out (their providers then fail to install, visibly).
    nameable = sorted(h for h in config.upstream.all_hosts if ":" not in h)
    unnameable = sorted(h for h in config.upstream.all_hosts if ":" in h)
    if not nameable:
        # An empty `include` would mean "every provider" to OpenTofu.
        raise ClientConfigError(
            "--mode oci: no upstream host can be named in an OCI repository path (a host "
            "with a port cannot); use --mode mirror or --mode registry")
    include = ", ".join(f'"{host}/*/*"' for host in nameable)
    lines = [
        "",
        "# Providers from these hosts install from the proxy's OCI endpoint",
        "# (/v2/providers/HOST/NAMESPACE/TYPE). There is deliberately no `direct` block: a",
        "# provider from any other host matches no installation method, so `tofu init` fails",
        "# (\"not found in any of the search locations\") instead of fetching it from the",
        "# internet.",
    ]
    if unnameable:
        lines += ["# Not reachable over OCI (a port cannot be part of a repository name), so",
                  f"# use --mode mirror or registry for: {', '.join(unnameable)}"]
    return [
        *lines,
        "provider_installation {",
        "  oci_mirror {",
        f'    repository_template = "{proxy_host}/{OCI_REPOSITORY_TEMPLATE}"',
        f"    include             = [{include}]",
        "  }",
        "}",
    ]
