"""bench/RESULTS.md: the machine, whether it was idle, the figures as a table, and the
hand-written sections the bench keeps when it rewrites the file (why a target is missed, the
replicas on S3)."""

from __future__ import annotations

import os
import platform
import re
import socket
import ssl
import subprocess
import time
from importlib import metadata
from pathlib import Path

from bench.figures import Figure, number, spread
from bench.servers import which

TITLE = "# Benchmark results"
MISSED = "Where targets are missed, and why"
REPLICAS = "Replicas on S3"
IDLE_LOAD = 0.5  # a 1-minute load average above it: other work ran, figures are unreliable
# Sections of the file the full bench does not write, in their order; any other `## ` section
# not written by the bench is kept too, after them.
KEPT = (MISSED, REPLICAS)


def _output(command: list[str]) -> list[str]:
    """What a command printed (stdout, then stderr), line by line; nothing if it failed."""
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return (result.stdout + result.stderr).strip().splitlines()


def _first_line(command: list[str]) -> str:
    return (_output(command) or [f"{command[0]}: not found"])[0]


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def machine(workers: int) -> list[str]:
    """The machine and the software measured, one fact a line."""
    cpuinfo = Path("/proc/cpuinfo").read_text()
    cpu = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE)
    memory = re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text())
    # "nginx version: nginx/X", "built with OpenSSL Y (running with OpenSSL Z)"
    nginx = _output([which("nginx") or "nginx", "-V"])[:2] or ["nginx: not found"]
    return [
        f"host {socket.gethostname()}: {cpu.group(1) if cpu else platform.processor()}, "
        f"{os.cpu_count()} CPUs ({workers} usable by this process), "
        f"{int(memory.group(1)) / 2**20 if memory else 0:.0f} GiB RAM",
        f"kernel {platform.release()} ({platform.machine()})",
        f"Python {platform.python_version()}, {ssl.OPENSSL_VERSION}, aiohttp "
        f"{_version('aiohttp')}, event loop uvloop {_version('uvloop')} (server.event_loop "
        "default)",
        ", ".join(nginx),
        # "wrk debian/4.1.0 [epoll] Copyright ...", "curl 7.88.1 (x86_64-pc-linux-gnu) ..."
        f"{_first_line(['wrk', '-v']).split(' Copyright')[0]}, "
        f"{' '.join(_first_line(['curl', '--version']).split()[:2])}",
    ]


def idle_line(load: tuple[float, float, float]) -> str:
    """The load average before the run, and a warning when the machine was not idle."""
    text = (f"load average before the run: {load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f} "
            "(1, 5, 15 min)")
    if load[0] > IDLE_LOAD:
        return (f"**not idle**: {text}, above {IDLE_LOAD}. Other work was running: these "
                "figures are not to be relied on.")
    return f"idle: {text}."


def table(figures: list[Figure]) -> list[str]:
    """The figures as a Markdown table."""
    lines = ["| figure | proxy | reference | ratio: median (min - max) | target | met? |",
             "| --- | --- | --- | --- | --- | --- |"]
    for figure in figures:
        reference = (f"{spread(figure.reference, figure.unit)} ({figure.reference_name})"
                     if figure.reference else "")
        met = {True: "yes", False: "**no**", None: ""}[figure.met()]
        lines.append(f"| {figure.name} | {spread(figure.proxy, figure.unit)} | {reference} | "
                     f"{spread(figure.ratios)} | {figure.target_text()} | {met} |")
    return lines


def generated(figures: list[Figure], notes: list[str], head: list[str]) -> str:
    """The part of the file the bench writes: head (what was run, on what), the table, notes."""
    missed = [figure for figure in figures if figure.met() is False]
    lines = [TITLE, "", *head, "", "## Figures", "", *table(figures)]
    extra = notes + [note for figure in figures for note in figure.notes]
    if extra:
        lines += ["", *[f"- {note}" for note in extra]]
    if missed:
        lines += ["", f"{len(missed)} target(s) missed: each needs a measured reason under "
                      f'"{MISSED}" below.']
    return "\n".join(lines).rstrip() + "\n"


def sections(text: str) -> list[tuple[str, str]]:
    """The file cut at its `## ` headings: (heading, its whole text); the part before the
    first heading has heading ""."""
    parts = re.split(r"(?m)^(?=## )", text)
    result = []
    for part in parts:
        match = re.match(r"## (.+)\n", part)
        result.append((match.group(1).strip() if match else "", part))
    return result


def _placeholders(section: str, figures: list[Figure]) -> str:
    """The hand-written reasons, with a line to fill in for each missed target that has no
    reason yet (a reason names its figure in bold)."""
    added = [f"- **{figure.name}** (measured {_judged_text(figure)}, target "
             f"{figure.target_text()}): reason not yet measured."
             for figure in figures
             if figure.met() is False and f"**{figure.name}**" not in section]
    if not added:
        return section
    last = section.rstrip().splitlines()[-1]
    gap = "\n" if last.startswith(("- ", "  ")) else "\n\n"  # a list goes on; else a new one
    return section.rstrip() + gap + "\n".join(added) + "\n"


def _judged_text(figure: Figure) -> str:
    """The judged value with its unit: "0.47 x nginx", "8.3 ms"."""
    value = number(figure.judged() or 0)
    if figure.target is not None and figure.target.on == "ratio":
        return f"{value} x {figure.reference_name}"
    return f"{value} {figure.unit}".rstrip()


def merge(old: str, new: str, figures: list[Figure]) -> str:
    """The new generated part, then the old file's kept sections (the reasons, with lines to
    fill for newly missed targets; the replicas; any other hand-written section)."""
    own = {heading for heading, _ in sections(new)}
    kept = {heading: body for heading, body in sections(old) if heading and heading not in own}
    missed_text = kept.pop(MISSED, f"## {MISSED}\n\nWhat was measured to explain each target "
                                   "missed (hand-written; the bench keeps this section).\n")
    ordered = [_placeholders(missed_text, figures)]
    ordered += [kept.pop(REPLICAS)] if REPLICAS in kept else []
    ordered += list(kept.values())
    return new.rstrip() + "\n\n" + "\n".join(part.strip() + "\n" for part in ordered)


def replace_section(old: str, heading: str, section: str) -> str:
    """old with its `## heading` section replaced by section (or section added at the end)."""
    parts = sections(old)
    if not any(name == heading for name, _ in parts):
        return (old.rstrip() + "\n\n" + section.strip() + "\n") if old.strip() else section
    return "".join(section.strip() + "\n\n" if name == heading else body
                   for name, body in parts).rstrip() + "\n"


def stamp() -> str:
    """Now, to the minute, with the time zone."""
    return time.strftime("%Y-%m-%d %H:%M %Z")
