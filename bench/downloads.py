"""The archive figures: warm throughput and server CPU per GB against nginx (and against the
bare-aiohttp file floor: what Python can do), a cold miss against a direct download, 100
concurrent cold GETs against nginx warm, and peak RSS."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from bench.figures import Figure, Target, number, spread
from bench.measure import (
    CpuMeter,
    CpuUse,
    Download,
    MemorySampler,
    Transfer,
    concurrent_downloads,
    download,
    download_after,
    metered,
    settle,
    throughput,
)
from bench.servers import Server
from bench.session import Session, each_in_turn, in_turn, progress
from bench.upstream import BIG, DOCUMENT_PLATFORMS, DOCUMENTS

MIB = 1 << 20
T = TypeVar("T")

HERD = 100
# Cold misses per run for the first-byte rows, each on a new proxy with an empty cache: one
# miss's first byte moves by milliseconds (which worker accepts the zip's connection, what
# the two cores are doing), and one per run left a median of three to chance.
FIRST_BYTE_MISSES = 5
RSS_CLIENTS = 20


def _mib(size: int) -> str:
    return f"{size / 2**20:.0f} MiB"


def archive(session: Session) -> tuple[list[Figure], list[str]]:
    """Warm zip throughput with 1 and 8 clients, and server CPU per GB with 8, vs nginx; both
    with the default workers. With 8 clients, the same against the file floor, and the floor
    against nginx (a note)."""
    settings = session.settings
    name = _mib(session.upstream.sizes[BIG])
    proxy = session.warm_proxy(settings.workers)
    download(proxy.ca, proxy.url(BIG.document))  # as Terraform: the document first
    download(proxy.ca, proxy.url(BIG.archive()))  # the fill: warm from now on
    session.publish(BIG)
    nginx, floor = session.nginx(), session.file_floor()
    download(floor.ca, floor.url(BIG.archive()))  # it serves: its first GET not counted
    single = Figure("archive", f"warm {name} zip, 1 client: throughput", "MB/s", "nginx")
    eight = Figure("archive", f"warm {name} zip, 8 clients: throughput", "MB/s", "nginx",
                   Target("ratio", ">=", 0.85))
    cpu = Figure("archive", f"warm {name} zip, 8 clients: server CPU per GB served", "s/GB",
                 "nginx", Target("ratio", "<=", 1.3))
    eight_floor = Figure("archive", f"warm {name} zip, 8 clients: throughput, against the "
                         "file floor", "MB/s", "file floor")
    cpu_floor = Figure("archive", f"warm {name} zip, 8 clients: server CPU per GB served, "
                       "against the file floor", "s/GB", "file floor")
    for run in range(settings.runs):
        progress(f"archive, run {run + 1}: 1 client")
        ours, theirs = in_turn(run, partial(_throughput, session, proxy, 1),
                               partial(_throughput, session, nginx, 1))
        single.add(ours[0].mb_per_second, theirs[0].mb_per_second)
        progress(f"archive, run {run + 1}: 8 clients")
        ours, theirs, bare = each_in_turn(run, [partial(_throughput, session, server, 8)
                                                for server in (proxy, nginx, floor)])
        eight.add(ours[0].mb_per_second, theirs[0].mb_per_second)
        cpu.add(_per_gb(ours), _per_gb(theirs))
        eight_floor.add(ours[0].mb_per_second, bare[0].mb_per_second)
        cpu_floor.add(_per_gb(ours), _per_gb(bare))
    note = _floor_note(floor, settings.workers, (eight_floor, eight), (cpu_floor, cpu))
    return [single, eight, cpu, eight_floor, cpu_floor], [note]


def _per_gb(measured: tuple[Transfer, float]) -> float:
    """CPU seconds per GB served."""
    transfer, seconds = measured
    return seconds / (transfer.size / 1e9)


def _floor_note(floor: Server, workers: int, throughputs: tuple[Figure, Figure],
                cpus: tuple[Figure, Figure]) -> str:
    """The file floor against nginx, measured in the same runs: how far Python itself is from
    C when serving a file over TLS. Each figure pair: (against the floor, against nginx)."""
    def versus(pair: tuple[Figure, Figure], unit: str) -> str:
        against_floor, against_nginx = pair
        floors, nginxes = against_floor.reference, against_nginx.reference
        ratios = [ours / theirs for ours, theirs in zip(floors, nginxes, strict=True)]
        return (f"{number(statistics.median(floors))} {unit}, {spread(ratios)} x nginx's "
                f"{number(statistics.median(nginxes))} {unit}")

    return (f"The {floor.name} with 8 clients: {versus(throughputs, 'MB/s')}; server CPU "
            f"{versus(cpus, 's/GB')} (nginx with {workers} workers).")


def _throughput(session: Session, server: Server, clients: int) -> tuple[Transfer, float]:
    """The transfer, and the CPU seconds the server's processes spent on it."""
    meter = CpuMeter(server.pid)
    transfer = throughput(server.ca, server.url(BIG.archive()), clients,
                          session.settings.rounds)
    return transfer, meter.seconds()


def cold(session: Session) -> tuple[list[Figure], list[str]]:
    """A cold miss of the big zip (documents already fetched, as Terraform does): first byte
    and whole download, against the same download straight from upstream; and the CPU every
    process used for each (the least wall time that CPU allows on this machine's cores)."""
    settings = session.settings
    size = session.upstream.sizes[BIG]
    name = _mib(size)
    first = Figure("cold", f"cold {name} zip: time to first byte", "ms", "direct",
                   Target("ratio", "<=", 1.5))
    whole = Figure("cold", f"cold {name} zip: whole download", "s", "direct",
                   Target("ratio", "<=", 1.5))
    floor = _floor_figure("cold", f"cold {name} zip", settings.workers, "direct")
    # Where the rest of the first byte goes: without a connection or handshake to make, the
    # proxy's own cold path against upstream's answer to the same request. (Terraform itself
    # asks for the zip on a new connection, as the first row does: its package installer
    # uses an HTTP client of its own.)
    kept = Figure("cold", f"cold {name} zip: time to first byte on the connection that "
                  "fetched its document (no handshake)", "ms", "direct, on upstream's")
    # A proxy that has served before (as one that runs for days): every worker has filled
    # packages, and holds a connection to upstream. The first row's new proxy pays, on the
    # worker that did not answer VERSION.json, its first request and its first handshake
    # with upstream before the zip's first byte.
    warmed = Figure("cold", f"cold {name} zip: time to first byte on a proxy that filled "
                    "packages before (its workers warm)", "ms", "direct")
    upstream = session.upstream
    uses: tuple[list[CpuUse], list[CpuUse]] = ([], [])
    for run in range(settings.runs):
        progress(f"cold, run {run + 1}")
        for miss in range(FIRST_BYTE_MISSES):
            (ours, our_cpu), (direct, direct_cpu) = _cold_miss(
                session, f"cold-{run}-{miss}", run + miss, warm=False)
            first.add(ours.first_byte * 1000, direct.first_byte * 1000)
            if miss == 0:  # the whole download and its CPU: one per run
                whole.add(ours.total, direct.total)
                floor.add(our_cpu.bound(settings.workers), direct_cpu.bound(settings.workers))
                uses[0].append(our_cpu)
                uses[1].append(direct_cpu)
        with session.fresh_cache(f"cold-kept-{run}") as cache, \
                session.proxy(cache, settings.workers) as proxy:
            proxy.get(BIG.index)
            settle(proxy.pid)
            ours, direct = in_turn(
                run, partial(_settled, proxy.pid, partial(
                    download_after, proxy.ca, proxy.url(BIG.document), proxy.url(BIG.archive()))),
                partial(download_after, upstream.ca_file, upstream.url(BIG.upstream_document()),
                        upstream.url(BIG.upstream_archive())))
        kept.add(ours.first_byte * 1000, direct.first_byte * 1000)
        for miss in range(FIRST_BYTE_MISSES):
            (ours, _), (direct, _) = _cold_miss(session, f"cold-warmed-{run}-{miss}",
                                                run + miss, warm=True)
            warmed.add(ours.first_byte * 1000, direct.first_byte * 1000)
    notes = [_cpu_note(f"cold {name} zip", "proxied download", uses[0], size,
                       settings.workers, "proxy"),
             _cpu_note(f"cold {name} zip", "direct download", uses[1], size,
                       settings.workers)]
    return [first, kept, warmed, whole, floor], notes


def _cold_miss(session: Session, name: str, turn: int, warm: bool
               ) -> tuple[tuple[Download, CpuUse], tuple[Download, CpuUse]]:
    """One cold miss of the big zip on a new proxy (its documents fetched first, as Terraform
    does; warm: after small packages were filled), and the same download straight from
    upstream, in turn; each with the CPU every process used for it."""
    upstream = session.upstream
    thread = upstream.registry.thread
    with session.fresh_cache(name) as cache, \
            session.proxy(cache, session.settings.workers) as proxy:
        if warm:
            _fill_small_packages(proxy)
        proxy.get(BIG.index)
        proxy.get(BIG.document)
        settle(proxy.pid)
        return in_turn(
            turn, partial(_settled, proxy.pid, partial(
                metered, partial(download, proxy.ca, proxy.url(BIG.archive())), thread,
                proxy.pid)),
            partial(metered, partial(download, upstream.ca_file,
                                     upstream.url(BIG.upstream_archive())), thread))


def _settled(pid: int, work: Callable[[], T]) -> T:
    """work(), then a wait for the proxy to finish what the miss left it (its h1 pass), so
    that a direct download measured next is not slowed down by it."""
    done = work()
    settle(pid)
    return done


def _fill_small_packages(proxy: Server) -> None:
    """Small packages' documents and zips, each on a new connection (as Terraform asks): the
    requests spread over the workers, and each that touches upstream keeps a connection."""
    for package in DOCUMENTS.values():
        proxy.get(package.index)
        proxy.get(package.document)
        for platform in DOCUMENT_PLATFORMS:
            proxy.get(package.archive(platform))


def herd(session: Session) -> tuple[list[Figure], list[str]]:
    """100 concurrent cold GETs of the big zip: upstream downloads, and seconds until the
    last client is done against the same 100 GETs served warm by nginx; and the CPU every
    process used for each (the least wall time that CPU allows on this machine's cores)."""
    settings = session.settings
    size = session.upstream.sizes[BIG]
    name = _mib(size)
    session.publish(BIG)
    nginx = session.nginx()
    what = f"{HERD} concurrent cold GETs of a {name} zip"
    fetches = Figure("herd", f"{what}: upstream downloads", "", "", Target("proxy", "==", 1))
    last = Figure("herd", f"{what}: last client done (nginx: warm)", "s", "nginx",
                  Target("ratio", "<=", 1.2))
    floor = _floor_figure("herd", what, settings.workers, "nginx")
    thread = session.upstream.registry.thread
    uses: tuple[list[CpuUse], list[CpuUse]] = ([], [])
    for run in range(settings.runs):
        progress(f"herd, run {run + 1}")
        with session.fresh_cache(f"herd-{run}") as cache, \
                session.proxy(cache, settings.workers) as proxy:
            proxy.get(BIG.document)
            before = session.upstream.downloads_of(BIG)
            (ours, our_cpu), (theirs, their_cpu) = in_turn(
                run, partial(metered, partial(concurrent_downloads, proxy.ca,
                                              proxy.url(BIG.archive()), HERD),
                             thread, proxy.pid),
                partial(metered, partial(concurrent_downloads, nginx.ca,
                                         nginx.url(BIG.archive()), HERD), thread, nginx.pid))
            fetches.add(session.upstream.downloads_of(BIG) - before)
        last.add(ours, theirs)
        floor.add(our_cpu.bound(settings.workers), their_cpu.bound(settings.workers))
        uses[0].append(our_cpu)
        uses[1].append(their_cpu)
    notes = [_cpu_note(what, "proxy (cold)", uses[0], size * HERD, settings.workers, "proxy"),
             _cpu_note(what, "nginx (warm)", uses[1], size * HERD, settings.workers, "nginx")]
    return [fetches, last, floor], notes


def _floor_figure(group: str, what: str, cores: int, reference: str) -> Figure:
    """The CPU-bound lower bound of a measurement: the CPU seconds of every process involved
    (upstream, server, clients) over the usable cores; no target, it explains the wall time."""
    return Figure(group, f"{what}: CPU-bound lower bound (CPU of all processes / {cores} "
                  "cores)", "s", reference)


def _cpu_note(what: str, side: str, uses: list[CpuUse], size: int, cores: int,
              server: str = "") -> str:
    """Where the CPU of a measurement went, per GB delivered to the clients (medians over
    runs), and the wall time that CPU needs at least on this machine."""
    def per_gb(values: list[float]) -> str:
        return f"{statistics.median(values) / (size / 1e9):.2f}"
    parts = [f"upstream {per_gb([u.upstream for u in uses])}"]
    if server:
        parts.append(f"{server} {per_gb([u.server for u in uses])}")
    parts.append(f"clients {per_gb([u.clients for u in uses])}")
    total = statistics.median(u.total for u in uses)
    wall = statistics.median(u.wall for u in uses)
    return (f"{what}, {side}: {per_gb([u.total for u in uses])} CPU-s per GB delivered "
            f"across processes ({', '.join(parts)}); {total:.2f} CPU-s in all, on {cores} "
            f"cores at least {total / cores:.2f} s (measured {wall:.2f} s)")


def memory(session: Session) -> tuple[list[Figure], list[str]]:
    """The memory of a proxy as shipped (default workers) while 20 clients download the big
    zip: cold (the first client's GET fills, the others follow the fill), then warm (a new
    process tree on the same cache). Peak PSS of the whole tree (what it really holds),
    peak RSS of the tree (shared pages counted in each process), peak RSS of one worker."""
    settings = session.settings
    name = _mib(session.upstream.sizes[BIG])
    figures: dict[str, dict[str, Figure]] = {}
    for state in ("cold", "warm"):
        what = f"{RSS_CLIENTS} clients on a {name} zip, {state}, {settings.workers} workers"
        figures[state] = {
            "pss": Figure("rss", f"peak PSS of the process tree, {what}", "MiB",
                          target=Target("proxy", "<=", 120)),
            "rss": Figure("rss", f"peak RSS of the process tree, {what}", "MiB"),
            "worker": Figure("rss", f"peak RSS of one worker, {what}", "MiB",
                             target=Target("proxy", "<=", 80)),
        }
    for run in range(settings.runs):
        with session.fresh_cache(f"memory-{run}") as cache:
            for state, row in figures.items():
                progress(f"memory, run {run + 1}: {state}")
                with session.proxy(cache, settings.workers) as proxy:
                    proxy.get(BIG.index)
                    proxy.get(BIG.document)
                    with MemorySampler(proxy.pid) as sampled:
                        concurrent_downloads(proxy.ca, proxy.url(BIG.archive()), RSS_CLIENTS)
                    row["pss"].add(sampled.tree_pss_bytes / MIB)
                    row["rss"].add(sampled.tree_rss_bytes / MIB)
                    row["worker"].add(sampled.worker_rss_bytes / MIB)
    return [figure for row in figures.values() for figure in row.values()], []
