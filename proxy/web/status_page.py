"""The status page at `/` (the status document, proxy.protocols.status) and the inventory at
`/status/cache` (what the cache holds, proxy.protocols.inventory) as HTML, rendered here,
with inline CSS only (no script, no external asset: they work offline; the inventory's search
is a plain GET form). Every value that goes into the markup is escaped."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from html import escape
from typing import Any
from urllib.parse import urlencode

# Reloads itself: an operator can leave it open.
REFRESH_SECONDS = 15
# Nothing but the inline styles may load or run, whatever a value holds.
CONTENT_SECURITY_POLICY = ("default-src 'none'; style-src 'unsafe-inline'; "
                           "base-uri 'none'; form-action 'self'; frame-ancestors 'none'")

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
form{margin:0 0 10px}input[type=search]{width:24em;padding:4px 6px}
nav a{margin-right:12px}
"""


def _head(title: str, refresh: bool) -> str:
    return "".join((
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="refresh" content="{REFRESH_SECONDS}">' if refresh else "",
        f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>"))


def render_status_page(document: dict[str, Any]) -> str:
    """The page for a status document (see StatusReport.document)."""
    mode = str(document["mode"])
    cache = document["cache"]
    lookups = document["lookups"]
    pulls = document["pulls"]
    clients = document.get("clients")
    return "".join((
        _head("tf-registry-proxy status", refresh=True),
        "<header><h1>tf-registry-proxy ", _e(document["version"]),
        f' <span class="mode {"offline" if mode == "offline" else "online"}" id="mode">',
        _e(mode), "</span></h1>",
        "<p>", _e(document["processes"]), " worker process(es) of this instance, counting "
        "since ", _e(document["counting_since"]), "; generated ", _e(document["generated_at"]),
        ". With several replicas, each shows its own view. "
        '<a style="color:#fff" href="status.json">status.json</a> · '
        '<a style="color:#fff" href="status/cache" id="inventory-link">what is cached</a>'
        "</p></header><main>",
        _cards(cache, pulls, lookups, document["fills_in_flight"]),
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
        _recent_pulls(document["recent_pulls"], clients is not None),
        "" if document.get("identities") is None else _section(
            "Pulls per identity", "identities", ("Identity (token or OIDC)", "Pulls"),
            ((i["name"], i["pulls"]) for i in document["identities"]),
            "No authenticated pull yet."),
        _policy(document.get("policy"), document.get("policy_refusals", [])),
        "" if clients is None else _section(
            "Pulls per client (recent)", "clients", ("Client", "Pulls", "Last pull"),
            ((c["client"], c["pulls"], c["last_pull"]) for c in clients),
            "No pull recorded yet."),
        "</main></body></html>",
    ))


def _e(value: object) -> str:
    """value as text in HTML (quotes too: values also go into attributes)."""
    return escape("—" if value is None else str(value), quote=True)


def _recent_pulls(pulls: list[dict[str, Any]], named: bool) -> str:
    """Each file a client got (a HEAD and its GET once), newest first; who, when named."""
    columns = ("Time", "Kind", "Artifact", "Cache", *(("Client",) if named else ()))
    rows = ((p["time"], p["kind"], p["artifact"], p["cache"],
             *((p.get("client"),) if named else ())) for p in pulls)
    note = "" if named else ('<p class="muted">Who pulled what is shown while the audit '
                             "log (server.audit_log) is on.</p>")
    return _section("Recent pulls", "recent-pulls", columns, rows,
                    "No package, module or CLI archive served yet.", note)


def _policy(policy: dict[str, Any] | None, refusals: list[dict[str, Any]]) -> str:
    """The version policy in force (its cooldown, its deny rules) and what it refused."""
    if policy is None:
        return ""
    cooldowns = ", ".join(f"{r['match']}: {r['min_release_age']}" for r in policy["rules"])
    note = (f'<p id="policy-cooldown">Cooldown: {_e(policy["min_release_age"])} by default'
            f'{"; " + _e(cooldowns) if cooldowns else ""}. {len(policy["allow"])} allow '
            "exception(s).</p>") if policy["active"] or policy["allow"] else \
        '<p id="policy-cooldown">No version policy: every version is served.</p>'
    return "".join((
        _section("Version policy: deny rules", "policy-deny", ("Match", "Versions", "Reason"),
                 ((d["match"], d["versions"] or "every version", d["reason"])
                  for d in policy["deny"]), "No deny rule.", note),
        _section("Recently refused by the version policy", "policy-refusals",
                 ("Time", "Artifact", "Why", "Rule", "Reason"),
                 ((r["time"], r["artifact"], r["kind"], r["rule"], r["reason"])
                  for r in refusals), "Nothing refused since the workers started."),
    ))


def render_inventory_page(inventory: dict[str, Any]) -> str:
    """The page of the cache's contents for an inventory page (Inventory.page)."""
    totals = inventory["totals"]
    query, number, pages = inventory["query"], inventory["page"], inventory["pages"]
    summary = ", ".join(f"{totals[kind]['versions']} {label} ({_size(totals[kind]['bytes'])})"
                        for kind, label in (("provider", "provider versions"),
                                            ("module", "module versions"),
                                            ("cli", "CLI releases")))
    rows = ((e["kind"], e["address"], e["version"], ", ".join(e["platforms"]) or "—",
             _size(e["bytes"]), e["last_used"],
             "" if e["recorded"] else "no record: fetched again when asked for")
            for e in inventory["entries"])

    def link(to: int, text: str) -> str:
        target = urlencode({"q": query, "page": to} if query else {"page": to})
        return f'<a href="?{_e(target)}" id="{_e(text.lower())}">{_e(text)}</a>'

    return "".join((
        _head("tf-registry-proxy cache", refresh=False),
        "<header><h1>What the cache holds</h1><p>", _e(summary),
        ' · <a style="color:#fff" href="../">status</a> · '
        '<a style="color:#fff" href="cache.json">cache.json</a></p></header><main>',
        '<form method="get" action=""><input type="search" name="q" id="q" value="',
        _e(query), '" placeholder="address, version or platform, e.g. hashicorp/aws">',
        ' <button type="submit">Search</button></form>',
        _section(f"{inventory['matching']} matching, page {number} of {pages}", "held",
                 ("Kind", "Address", "Version", "Platforms", "Size", "Last use", ""), rows,
                 "Nothing held matches." if query else "The cache holds nothing yet."),
        "<nav>", link(number - 1, "Previous") if number > 1 else "",
        link(number + 1, "Next") if number < pages else "", "</nav>",
        "</main></body></html>",
    ))


def _cards(cache: dict[str, Any], pulls: dict[str, Any], lookups: dict[str, Any],
           fills: int) -> str:
    limit = cache["max_bytes"]
    used = f"{_size(cache['bytes'])} of {_size(limit)}" if limit else \
        f"{_size(cache['bytes'])} (no limit)"
    percent = min(100.0, 100 * float(cache["used_fraction"] or 0))
    rate = pulls["hit_rate"]
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
        _e("—" if rate is None else f"{100 * rate:.1f}%"), "</b>", _e(pulls["hits"]),
        " of ", _e(pulls["total"]), " files from the cache (", _e(lookups["total"]),
        " lookups in all)</div>",
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
