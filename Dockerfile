# syntax=docker/dockerfile:1
# Build stage: wheels for the proxy and every dependency.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# Runtime stage: no compilers, no build files, a non-root user, the cache and the state (the
# generated CA clients trust, the URL-signing key) on volumes.
FROM python:3.11-slim
# git clones module sources that registries point at (git::https://...).
RUN apt-get update \
    && apt-get install -y --no-install-recommends git ca-certificates \
    && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 --user-group --home-dir /var/lib/tf-registry-proxy \
        --create-home tfproxy \
    && mkdir -p /var/cache/tf-registry-proxy \
    && chown tfproxy:tfproxy /var/cache/tf-registry-proxy
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index /wheels/*.whl && rm -rf /wheels
COPY config.example.toml /etc/tf-registry-proxy/config.example.toml
# The image's defaults live in a config file, not in environment overrides, so that a config
# mounted over /etc/tf-registry-proxy/config.toml is obeyed as written.
RUN printf '[server]\nlisten = "[::]:8443"\nstate_dir = "/var/lib/tf-registry-proxy"\n\n[cache]\ndir = "/var/cache/tf-registry-proxy"\n' \
        > /etc/tf-registry-proxy/config.toml
ENV TF_REGISTRY_PROXY_CONFIG=/etc/tf-registry-proxy/config.toml \
    PYTHONUNBUFFERED=1
USER tfproxy
VOLUME ["/var/cache/tf-registry-proxy", "/var/lib/tf-registry-proxy"]
EXPOSE 8443
# Liveness: /healthz on the port the config names (over loopback).
HEALTHCHECK --interval=30s --timeout=10s --start-period=20s --retries=3 \
    CMD ["tf-registry-proxy", "healthcheck"]
ENTRYPOINT ["tf-registry-proxy"]
CMD ["serve"]
