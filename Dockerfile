# syntax=docker/dockerfile:1
# The image of tf-registry-proxy: Debian's Python 3.11, the proxy in a virtual environment,
# a non-root user, the cache and the state on volumes. BASE_IMAGE: any Debian bookworm image
# (the tests build it on a base made with mmdebstrap, as no registry is reachable there).
ARG BASE_IMAGE=debian:bookworm-slim

# Build stage: the proxy and every dependency installed into /opt/tf-registry-proxy.
FROM ${BASE_IMAGE} AS build
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
        binutils \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
# Nothing installs at run time: pip and setuptools would only weigh the image down, and so
# would the debugging symbols of the compiled extensions (uvloop, cryptography, pysequoia).
RUN python3 -m venv /opt/tf-registry-proxy \
    && /opt/tf-registry-proxy/bin/pip install --no-cache-dir . \
    && /opt/tf-registry-proxy/bin/pip uninstall --yes --quiet pip setuptools \
    && find /opt/tf-registry-proxy -name '*.so' -exec strip --strip-unneeded {} +

# Runtime stage: no build files, no pip, a non-root user.
FROM ${BASE_IMAGE}
# python3 runs the environment (its interpreter is a link to it); git clones the module
# sources registries point at (git::https://...). Their manuals, documentation and message
# translations are left out, as Debian's slim images do.
RUN printf 'path-exclude=/usr/share/doc/*\npath-exclude=/usr/share/man/*\npath-exclude=/usr/share/info/*\npath-exclude=/usr/share/locale/*\npath-include=/usr/share/locale/locale.alias\n' \
        > /etc/dpkg/dpkg.cfg.d/tf-registry-proxy-slim \
    && apt-get update \
    && apt-get install -y --no-install-recommends python3 git ca-certificates \
    && apt-get clean \
    && rm -rf /var/lib/apt/lists/* /var/cache/debconf/*-old /var/log/apt /var/log/dpkg.log
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/tf-registry-proxy \
        --create-home --shell /usr/sbin/nologin tfproxy \
    && mkdir -p /var/cache/tf-registry-proxy /etc/tf-registry-proxy \
    && chown tfproxy:tfproxy /var/cache/tf-registry-proxy
COPY --from=build /opt/tf-registry-proxy /opt/tf-registry-proxy
COPY config.example.toml /etc/tf-registry-proxy/config.example.toml
# The image's defaults live in a config file, not in environment overrides, so that a config
# mounted over /etc/tf-registry-proxy/config.toml is obeyed as written.
RUN printf '[server]\nlisten = "[::]:8443"\nstate_dir = "/var/lib/tf-registry-proxy"\n\n[cache]\ndir = "/var/cache/tf-registry-proxy"\n' \
        > /etc/tf-registry-proxy/config.toml
ENV PATH=/opt/tf-registry-proxy/bin:$PATH \
    TF_REGISTRY_PROXY_CONFIG=/etc/tf-registry-proxy/config.toml \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001:10001
# Everything the proxy writes is on these: the cache, its state (the generated CA clients
# trust, the URL-signing key) and temp files (the workers' shared metrics, git clones). The
# root file system can be read-only.
VOLUME ["/var/cache/tf-registry-proxy", "/var/lib/tf-registry-proxy", "/tmp"]
EXPOSE 8443
# Liveness: /healthz on the port the config names (over loopback).
HEALTHCHECK --interval=30s --timeout=10s --start-period=20s --retries=3 \
    CMD ["tf-registry-proxy", "healthcheck"]
ENTRYPOINT ["tf-registry-proxy"]
CMD ["serve"]
