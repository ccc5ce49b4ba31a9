"""`policy check`: which versions the `[policy]` of the configuration hides, why, and from
when they will be served, for what the cache holds or the addresses given (judged as the
server judges them: proxy.protocols.policy_report). Run it before a SIGHUP puts a changed
policy in force. Exit status: 0; 2 for bad input or an unusable cache."""

from __future__ import annotations

import argparse
import json
import sys

from proxy.cli.cache_store import opened_store, run_on_store
from proxy.config import Config
from proxy.config.policy import iso
from proxy.core.access import allows
from proxy.core.activity import Activity
from proxy.core.metrics import Metrics
from proxy.protocols.policy_report import Checked, PolicyReport
from proxy.protocols.version_policy import VersionPolicy, describe
from proxy.store.contents import DEFAULT_HOST
from proxy.verification.release_times import ReleaseTimes


def add_policy_options(command: argparse.ArgumentParser) -> None:
    """`policy`'s arguments."""
    command.add_argument("action", choices=("check",),
                         help="check: list the versions the policy hides, why, and from when")
    command.add_argument("addresses", nargs="*", metavar="ADDRESS",
                         help="only these: HOST/NAMESPACE/NAME (globs allowed; NAMESPACE/NAME "
                              "means registry.terraform.io), a module's full address, or "
                              "releases/terraform, releases/opentofu (default: everything "
                              "the cache holds a version list of)")
    command.add_argument("--json", action="store_true", help="one JSON document")


def policy_command(config: Config, args: argparse.Namespace) -> int:
    """Run `policy check`."""
    selected = [_full(address) for address in args.addresses]
    return run_on_store(_check(config, selected, args.json), config, "policy check")


async def _check(config: Config, selected: list[str], as_json: bool) -> int:
    async with opened_store(config) as storage:
        policy = VersionPolicy(config.policy, ReleaseTimes(storage.index), Metrics(),
                               Activity())
        try:
            found = await PolicyReport(storage.index, policy).check(selected)
        finally:
            await policy.close()
    if as_json:
        json.dump({"policy": policy.rules_document(),
                   "addresses": [_document(checked) for checked in found]},
                  sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"version policy: {describe(config.policy)}"
          f"{'' if config.source is None else f' (from {config.source})'}")
    for checked in found:
        print(_text(checked))
    for address in selected:
        if not any(_selects(address, checked) for checked in found):
            print(f"{address}: the cache holds no version list of it (one is kept once a "
                  "client or `warm` asks for it)")
    if not found and not selected:
        print("the cache holds no version list yet: nothing to check")
    return 0


def _text(checked: Checked) -> str:
    head = f"{checked.address} ({checked.kind})"
    if not checked.hidden:
        return f"{head}: every version served ({len(checked.versions)})"
    lines = [f"{head}: {len(checked.hidden)} of {len(checked.versions)} versions hidden"]
    for version, verdict in checked.hidden:
        when = "never, while the rule stands" if verdict.kind == "deny" else \
            "not known until its release time is" if verdict.available_at is None else \
            iso(verdict.available_at)
        lines.append(f"  {version}  {verdict.kind} ({verdict.rule}): {verdict.reason}; "
                     f"served from: {when}")
    return "\n".join(lines)


def _document(checked: Checked) -> dict[str, object]:
    return {"kind": checked.kind, "address": checked.address, "versions": list(checked.versions),
            "hidden": [{"version": version, "why": verdict.kind, "rule": verdict.rule,
                        "reason": verdict.reason,
                        "served_from": None if verdict.available_at is None
                        else iso(verdict.available_at)}
                       for version, verdict in checked.hidden]}


def _full(address: str) -> str:
    """NAMESPACE/NAME as registry.terraform.io/NAMESPACE/NAME."""
    return f"{DEFAULT_HOST}/{address}" if address.count("/") == 1 and \
        not address.startswith("releases/") else address


def _selects(address: str, checked: Checked) -> bool:
    return allows((address,), checked.target) or allows((address,), checked.address)

