"""The status page at `/`: the status document (proxy.protocols.status) as HTML, rendered
here, with inline CSS only (no script, no external asset: it works offline). Every value
that goes into the markup is escaped."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from html import escape
from typing import Any

# Reloads itself: an operator can leave it open.
REFRESH_SECONDS = 15
# Nothing but the inline styles may load or run, whatever a value holds.
CONTENT_SECURITY_POLICY = ("default-src 'none'; style-src 'unsafe-inline'; "
                           "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")

_STYLE = """
body{font:15px/1.45 system-ui,sans-serif;margin:0;background:#f4f6f8;color:#1d2733}
header{background:#1d3557;color:#fff;padding:16px 28px}
header h1{margin:0;font-size:22px}
header p{margin:4px 0 0;opacity:.85}
main{padding:12px 28px 28px}
section{background:#fff;border:1px solid #d8dee6;border-radius:6px;padding:12px 18px;
margin:14px 0}
h2{font-size:17px;margin:2px 0 10px}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:5px 8px;border-bottom:1px solid #e6eaef;vertical-align:top}
th{background:#eef2f6;font-weight:600}
.cards{display:flex;gap:14px;flex-wrap:wrap}
.card{flex:1 1 180px;background:#fff;border:1px solid #d8dee6;border-radius:6px;
padding:10px 16px}
.card b{display:block;font-size:24px}
.bar{height:10px;background:#e6eaef;border-radius:5px;margin-top:6px;overflow:hidden}
.bar i{display:block;height:100%;background:#2a9d8f}
.mode{display:inline-block;padding:2px 10px;border-radius:10px;font-weight:600}
.online{background:#2a9d8f}.offline{background:#e9c46a;color:#1d2733}
.bad{color:#b00020;font-weight:600}.ok{color:#1b7f3b}
.muted{color:#6b7785}
#integrity td:first-child,#upstreams td:nth-child(2),#upstreams td:nth-child(3){white-space:nowrap}
"""


def render_status_page(document: dict[str, Any]) -> str:
    """The page for a status document (see StatusReport.document)."""
    mode = str(document["mode"])
    cache = document["cache"]
    lookups = document["lookups"]
    return "".join((
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">',
        "<title>tf-registry-proxy status</title>",
        f"<style>{_STYLE}</style></head><body>",
        "<header><h1>tf-registry-proxy ", _e(document["version"]),
        f' <span class="mode {"offline" if mode == "offline" else "online"}" id="mode">',
        _e(mode), "</span></h1>",
        "<p>", _e(document["processes"]), " worker process(es) of this instance, counting "
        "since ", _e(document["counting_since"]), "; generated ", _e(document["generated_at"]),
        ". With several replicas, each shows its own view. "
        '<a style="color:#fff" href="status.json">status.json</a></p></header><main>',
        _cards(cache, lookups, document["fills_in_flight"]),
        _upstreams(document["upstreams"], mode),
        _section("Recent integrity failures", "integrity",
                 ("Time", "Artifact", "Kind", "Reason"),
                 ((f["time"], f["artifact"], f["kind"], f["reason"])
                  for f in document["integrity_failures"]),
                 "None since the workers started."),
        _section("Most requested providers", "top-providers", ("Provider", "Requests"),
                 ((p["name"], p["requests"]) for p in document["top_providers"]),
                 "No provider package served yet."),
        _section("Most requested modules", "top-modules", ("Module", "Requests"),
                 ((m["name"], m["requests"]) for m in document["top_modules"]),
                 "No module served yet."),
        "</main></body></html>",
    ))


def _e(value: object) -> str:
    """value as text in HTML (quotes too: values also go into attributes)."""
    return escape("—" if value is None else str(value), quote=True)


def _cards(cache: dict[str, Any], lookups: dict[str, Any], fills: int) -> str:
    limit = cache["max_bytes"]
    used = f"{_size(cache['bytes'])} of {_size(limit)}" if limit else \
        f"{_size(cache['bytes'])} (no limit)"
    percent = min(100.0, 100 * float(cache["used_fraction"] or 0))
    rate = lookups["hit_rate"]
    store = cache.get("store") or {}
    outage = "" if store.get("reachable", True) else "".join((
        '<p class="bad" id="store-down">The object store is unreachable: hot copies are '
        "served, misses are refused (503). ", _e(store.get("problem")), "</p>"))
    return "".join((
        outage,
        '<div class="cards">',
        '<div class="card" id="cache">Cache (', _e(cache["backend"]), ")<b>", _e(used),
        "</b>", _e(cache["files"]), " file" if cache["files"] == 1 else " files",
        f'<div class="bar"><i style="width:{percent:.1f}%"></i></div></div>' if limit else
        "</div>",
        '<div class="card" id="hit-rate">Hit rate<b>',
        _e("—" if rate is None else f"{100 * rate:.1f}%"), "</b>", _e(lookups["hits"]),
        " of ", _e(lookups["total"]), " lookups</div>",
        '<div class="card" id="fills">Fills in flight<b>', _e(fills), "</b>downloads from "
        "upstream under way</div></div>",
    ))


def _upstreams(hosts: list[dict[str, Any]], mode: str) -> str:
    note = ('<p class="muted">Offline: upstream is never contacted.</p>'
            if mode == "offline" else "")
    rows = ((h["host"] + ("" if h["configured"] else " (not configured)"),
             h["last_success"], _Marked(h["last_error"], bool(h["last_error"])),
             h["last_error_reason"], f"{h['requests_ok']} / {h['requests_failed']}",
             h["stale_answers"]) for h in hosts)
    return _section("Upstream hosts", "upstreams",
                    ("Host", "Last success", "Last error", "Reason", "Requests ok / failed",
                     "Stale answers served"), rows, "No upstream host configured.", note)


class _Marked:
    """A cell shown as a problem when bad."""

    def __init__(self, value: object, bad: bool) -> None:
        self.value, self.bad = value, bad


def _section(title: str, ident: str, columns: Sequence[str], rows: Iterable[Sequence[object]],
             empty: str, note: str = "") -> str:
    body = "".join("<tr>" + "".join(_cell(value) for value in row) + "</tr>" for row in rows)
    table = (f"<table><thead><tr>{''.join(f'<th>{_e(c)}</th>' for c in columns)}</tr></thead>"
             f"<tbody>{body}</tbody></table>") if body else \
        f'<p class="muted">{_e(empty)}</p>'
    return f'<section id="{_e(ident)}"><h2>{_e(title)}</h2>{note}{table}</section>'


def _cell(value: object) -> str:
    if isinstance(value, _Marked):
        return f'<td class="{"bad" if value.bad else ""}">{_e(value.value)}</td>'
    return f"<td>{_e(value)}</td>"


def _size(count: int | None) -> str:
    if count is None:
        return "—"
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{count} B"  # not reached
