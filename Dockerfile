# syntax=docker/dockerfile:1
# Build stage: wheels for the proxy and every dependency.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

# Runtime stage: no compilers, no build files, a non-root user, the cache on a volume.
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
ENV TF_REGISTRY_PROXY_SERVER_LISTEN=0.0.0.0:8443 \
    TF_REGISTRY_PROXY_CACHE_DIR=/var/cache/tf-registry-proxy \
    PYTHONUNBUFFERED=1
USER tfproxy
VOLUME ["/var/cache/tf-registry-proxy"]
EXPOSE 8443
# Liveness over loopback only: the certificate may be the operator's own, whose CA this image
# does not know, so this one local probe skips verification (upstream TLS is always verified).
HEALTHCHECK --interval=30s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import ssl, urllib.request; urllib.request.urlopen('https://127.0.0.1:8443/healthz', context=ssl._create_unverified_context(), timeout=4)"]
ENTRYPOINT ["tf-registry-proxy"]
CMD ["serve"]
