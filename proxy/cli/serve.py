"""`serve`: check what the proxy needs to start (directories, certificate, signing key),
then serve in this process or in workers."""

from __future__ import annotations

import sqlite3

from proxy.cli.logs import configure_server_logging
from proxy.cli.messages import fail
from proxy.cli.server import port_taken, run_loop, run_server
from proxy.cli.startup import log_startup
from proxy.cli.workers import serve_workers
from proxy.config import Config
from proxy.core.audit import AuditLog
from proxy.store.disk import probe_index
from proxy.store.disk_space import describe_start_failure
from proxy.tls.certificates import TlsStateError, ensure_certificate, ssl_context
from proxy.tls.state import StatePaths, adopt_legacy_state
from proxy.web.auth import SigningKeyError, load_signing_key


def serve(config: Config) -> int:
    """Run the proxy (HTTPS) until stopped; the exit status."""
    configure_server_logging(config.server)
    server = config.server
    for key, directory in (("cache.dir", config.cache.dir), ("server.state_dir",
                                                             server.state_dir)):
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            return fail(f"{key} {directory}: {exc.strerror}")
    try:
        adopt_legacy_state(config.cache.dir, StatePaths(server.state_dir))
        certificate = ensure_certificate(server)
        context = ssl_context(certificate)
    except TlsStateError as exc:
        return fail(str(exc))
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        where = (f"server.tls_cert {server.tls_cert} / server.tls_key {server.tls_key}"
                 if server.tls_cert else f"generated certificate under {server.state_dir}/tls")
        return fail(f"cannot load the serving certificate ({where}): {exc}")
    if config.auth.enabled:
        try:  # once, here: workers would each fail on a bad key, each with its own message
            load_signing_key(StatePaths(server.state_dir).signing_key)
        except SigningKeyError as exc:
            return fail(f"cannot start: {exc}")
    if server.audit_log is not None:
        audit = AuditLog(server.audit_log)
        try:  # once, here: each worker would fail with its own message
            audit.open()
            audit.close()
        except OSError as exc:
            return fail(f"server.audit_log {server.audit_log}: cannot open it: "
                        f"{exc.strerror or exc}")
    taken = port_taken(server.host, server.port)
    if taken is not None:  # once, here: not each worker, and never sharing it with another
        return fail(taken)
    if server.workers > 1:
        if config.cache.s3 is None:
            try:  # once, here, for the same reason: e.g. a full disk
                probe_index(config.cache.dir)
            except (OSError, sqlite3.Error) as exc:
                return fail(describe_start_failure(config.cache.dir, exc))
        log_startup(config, certificate.ca)
        return serve_workers(config, certificate.ca)
    log_startup(config, certificate.ca)
    return run_loop(run_server(config, context, certificate.ca), server.event_loop)
