"""`healthcheck`: exit 0 if the proxy on this machine answers /healthz (container probes)."""

from __future__ import annotations

import ssl
import sys
import urllib.request

from proxy.config import Config


def healthcheck(config: Config) -> int:
    """GET /healthz on this machine's listening port: 0 when it answers 200, else 1."""
    host = config.server.host
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    # A liveness probe on this machine only: the certificate may be an operator's whose CA
    # this process does not know, so this one request does not verify it.
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    # Straight to this machine: an egress proxy from HTTPS_PROXY could not reach it.
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                         urllib.request.HTTPSHandler(context=context))
    url = f"https://{host}:{config.server.port}/healthz"
    try:
        with opener.open(url, timeout=5) as response:
            return 0 if response.status == 200 else 1
    except OSError as exc:  # name what was tried: the port may be another config's
        print(f"tf-registry-proxy: unhealthy: {url}: {exc}", file=sys.stderr)
        return 1
