"""The JSON figures: warm index.json and VERSION.json, in both document states, by wrk, with
the shipped configuration (the access log on). The proxy at one worker and at its default
workers is measured against the bare-aiohttp floor with as many processes (what Python can
do); one worker with the access log off is a second row; nginx (what a C static server
does) is in the notes."""

from __future__ import annotations

from functools import partial

from bench.figures import Figure, Target
from bench.measure import Load, wrk
from bench.servers import Server
from bench.session import Session, in_turn, progress
from bench.upstream import DOCUMENT_PLATFORMS, DOCUMENTS

KINDS = ("VERSION.json", "index.json")


def _paths() -> dict[tuple[str, str], str]:
    """(kind, state) -> the document's mirror path."""
    return {(kind, state): package.document if kind == "VERSION.json" else package.index
            for kind in KINDS for state, package in DOCUMENTS.items()}


def _prepare(session: Session, one: Server) -> None:
    """Bring each release to its state through the proxy, as Terraform would (documents, then
    zips): every platform's zip fetched (complete), or only the first (incomplete); then copy
    the proxy's documents into the static tree for nginx and the floor."""
    for state, package in DOCUMENTS.items():
        one.get(package.index)
        one.get(package.document)
        platforms = DOCUMENT_PLATFORMS if state == "complete" else DOCUMENT_PLATFORMS[:1]
        for platform in platforms:
            one.get(package.archive(platform))
    for path in _paths().values():
        session.tree.copy_from(one, path)


def measure(session: Session) -> tuple[list[Figure], list[str]]:
    """Requests/s and p99 latency at 64 connections, per document and state."""
    settings = session.settings
    workers = settings.workers
    one = session.warm_proxy(1)
    _prepare(session, one)
    many = session.warm_proxy(workers)
    quiet = session.warm_proxy(1, access_log="off")
    floor, floors, nginx = session.floor(), session.floor(workers), session.nginx()
    paths = _paths()
    first = next(iter(paths.values()))
    for server in (one, many, quiet, floor, floors, nginx):  # first requests not counted
        for path in paths.values():
            server.get(path)
        wrk(server.url(first), 1)
    figures: dict[tuple[str, str], dict[str, Figure]] = {}
    for (kind, state) in paths:
        what = f"warm {kind}, {state}"
        figures[(kind, state)] = {
            "one": Figure("json", f"{what}, 1 worker: requests/s", "req/s", "floor",
                          Target("ratio", ">=", 0.8)),
            "one p99": Figure("json", f"{what}, 1 worker: p99 latency", "ms", "floor",
                              Target("ratio", "<=", 1.5)),
            "many": Figure("json", f"{what}, {workers} workers: requests/s", "req/s",
                           "floor", Target("ratio", ">=", 0.8)),
            "many p99": Figure("json", f"{what}, {workers} workers: p99 latency", "ms",
                               "floor", Target("ratio", "<=", 1.5)),
            "quiet": Figure("json", f"{what}, 1 worker, access log off: requests/s", "req/s",
                            "floor"),
            "nginx": Figure("json", f"{what}, nginx ({workers} workers) against the floor "
                                    f"({workers} processes): requests/s", "req/s", "floor"),
        }
    for run in range(settings.runs):
        for (kind, state), path in paths.items():
            progress(f"json, run {run + 1}: {kind} ({state})")
            row = figures[(kind, state)]
            for mine, theirs, key in ((one, floor, "one"), (many, floors, "many"),
                                      (quiet, floor, "quiet"), (nginx, floors, "nginx")):
                ours, reference = in_turn(run, partial(_load, mine, path, settings.seconds),
                                          partial(_load, theirs, path, settings.seconds))
                row[key].add(ours.requests_per_second, reference.requests_per_second)
                if f"{key} p99" in row:
                    row[f"{key} p99"].add(ours.p99_ms, reference.p99_ms)
                for server, load in ((mine, ours), (theirs, reference)):
                    if load.socket_errors:
                        row[key].notes.append(f"{server.name}: {load.socket_errors} socket "
                                              f"errors in run {run + 1}")
    flat = [figure for row in figures.values() for figure in row.values()]
    return flat, []


def _load(server: Server, path: str, seconds: float) -> Load:
    return wrk(server.url(path), seconds)
