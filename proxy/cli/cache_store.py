"""The store the cache commands work on: the configured one (cache directory or bucket),
opened as the server opens it, beside any server that runs on it."""

from __future__ import annotations

import os
import sqlite3
from collections.abc import AsyncIterator, Coroutine
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

from proxy.app import open_for_commands
from proxy.cli.messages import fail
from proxy.cli.server import run_loop
from proxy.config import Config
from proxy.core.errors import ProxyError
from proxy.core.executors import serving
from proxy.store.protocol import Storage

# The exit status of a command whose store failed on the way (what was done stays done).
STOPPED = 1


class CacheUnusable(Exception):
    """The configured cache cannot be worked on (the message says why)."""


def where(config: Config) -> str:
    """The store, as the commands name it."""
    s3 = config.cache.s3
    if s3 is None:
        return f"cache directory {config.cache.dir}"
    return f"bucket {s3.bucket} (hot copies under {config.cache.dir})"


@asynccontextmanager
async def opened_store(config: Config) -> AsyncIterator[Storage]:
    """The configured store, with the thread pools its blocking calls run on. Opened as
    export opens it: not as a starting server, which sweeps, measures the whole cache and
    evicts down to the limit (a `cache list` must not delete anything)."""
    if config.cache.s3 is None:
        _check_directory(config)
    async with serving(), AsyncExitStack() as opened:
        yield await open_for_commands(config, opened)


def _check_directory(config: Config) -> None:
    # Opening the store would create a missing directory: a mistyped cache.dir would then
    # show an empty cache instead of the mistake.
    directory = config.cache.dir
    if not directory.is_dir():
        raise CacheUnusable(f"no cache directory at {directory} (cache.dir): check the "
                            "configuration (--config, TF_REGISTRY_PROXY_CACHE_DIR)")
    if not os.access(directory, os.R_OK | os.W_OK | os.X_OK):
        raise CacheUnusable(f"the cache directory {directory} is not readable and writable "
                            "by this user: run the command as the user the proxy runs as")


def run_on_store(work: Coroutine[Any, Any, int], config: Config, doing: str) -> int:
    """Run work (it returns the exit status) on the event loop the server uses; a store
    that cannot be opened or fails on the way is one line on stderr, and its exit status
    (CacheUnusable: 2, else 1)."""
    try:
        return run_loop(work, config.server.event_loop)
    except CacheUnusable as exc:
        return fail(str(exc))
    except ProxyError as exc:
        fail(f"{doing} stopped: {exc.message}")
    except (OSError, sqlite3.Error) as exc:
        fail(f"{doing} stopped: {where(config)}: {exc}")
    return STOPPED
