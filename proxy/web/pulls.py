"""Pulls: each artifact file a client got (a provider package, a module archive, a CLI
release archive), counted once per client and file for the status page: Terraform asks for a
module archive with a HEAD and then a GET, which is one pull, counted with the HEAD's cache
result (the HEAD is what waited for the fill). Who pulled is named only when the operator
records that (the audit log is on)."""

from __future__ import annotations

import time
from collections import OrderedDict

from aiohttp import web
from aiohttp.typedefs import Handler

from proxy.core.activity import Activity
from proxy.core.held import keep_recent
from proxy.web.access_log import CACHE_RESULT_KEY
from proxy.web.artifacts import ARTIFACT_ROUTES, named_artifact
from proxy.web.auth import TOKEN_NAME_KEY

# A GET this soon after a HEAD of the same file by the same client is that HEAD's pull.
PAIR_SECONDS = 60.0
_HEADS_HELD = 4096
_SENT = (200, 206, 302)


class PullCounter:
    """Counts pulls into a process's Activity."""

    def __init__(self, activity: Activity, name_clients: bool) -> None:
        self._activity = activity
        self._name_clients = name_clients
        self._heads: OrderedDict[tuple[str | None, str], float] = OrderedDict()

    def record(self, request: web.Request, kind: str, name: str, version: str) -> None:
        """request was answered with the file of artifact kind/name/version."""
        key = (request.remote, request.path)
        now = time.monotonic()
        if request.method == "GET":
            head = self._heads.pop(key, None)
            if head is not None and now - head < PAIR_SECONDS:
                return  # the HEAD before it counted this pull
        else:
            keep_recent(self._heads, key, now, _HEADS_HELD)
        self._activity.pulled(kind, name, version, request.get(CACHE_RESULT_KEY, "hit"),
                              self._client(request) if self._name_clients else None,
                              request.get(TOKEN_NAME_KEY))

    @staticmethod
    def _client(request: web.Request) -> str:
        token = request.get(TOKEN_NAME_KEY)
        return f"{request.remote or 'unknown'}" + (f" (token {token})" if token else "")


PULLS_KEY = web.AppKey("pulls", PullCounter)


def counted(route: str, handler: Handler) -> Handler:
    """handler, counting the pulls its answers are (handler itself for a route that serves
    no artifact file)."""
    if route not in ARTIFACT_ROUTES:
        return handler

    async def wrapped(request: web.Request) -> web.StreamResponse:
        response = await handler(request)
        pulls = request.app.get(PULLS_KEY)
        if pulls is not None and response.status in _SENT:
            named = named_artifact(route, request.match_info)
            if named is not None and named.is_file:
                artifact = named.artifact
                address = "/".join(part for part in (
                    artifact.host, artifact.namespace, artifact.name, artifact.system) if part)
                pulls.record(request, artifact.kind, address, artifact.version or "")
        return response

    return wrapped
