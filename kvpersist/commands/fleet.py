"""``kvp-admin fleet``: the hosts sharing this host's shared tier, from their fleet records
(parse and format only)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import click

from kvpersist.commands.common import TIMEOUT, echo_json, exit_with, json_option, table
from kvpersist.config.values import format_size


def _when(t: float | None, now: float) -> str:
    """``2026-05-01 10:04Z (3 h)`` or '-'."""
    from kvpersist.l2.fleet.records import format_age

    if t is None:
        return "-"
    stamp = datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M") + "Z"
    return f"{stamp} ({format_age(max(0.0, now - t))})"


def _health(h: dict[str, Any] | None) -> str:
    from kvpersist.l2.fleet.records import format_age

    if h is None:
        return "-"
    canary = ", CANARY FAILED" if h.get("canary") == "failed" else ""
    return f"{h['status']}{canary} ({format_age(h['age_s'])} ago)"


def _nvme(n: dict[str, Any] | None) -> str:
    from kvpersist.l2.fleet.records import format_age

    if n is None:
        return "-"
    return (f"{n['files']:,} files, {format_size(n['bytes'])} "
            f"({format_age(n['age_s'])} ago)")


def _key(h: dict[str, Any]) -> str:
    if h["serde"] is None:
        return "-"
    return h["serde_key_fingerprint"] or f"(serde {h['serde']})"


AGREEMENT = {"agree": "keys agree", "disagree": "KEYS DISAGREE", "none": "no live host",
             "unknown": "unknown (index not readable)"}


def format_status(doc: dict[str, Any]) -> str:
    """One table per namespace, then its problems."""
    now = doc["checked_at"]
    tier = doc["tier"]
    out = [f"shared tier {tier['endpoint']} "
           f"({'cluster' if tier['cluster'] else 'standalone'})"]
    for ns in doc["namespaces"]:
        here = (f"configured here: {', '.join(ns['configured'])}" if ns["configured"]
                else "not configured here")
        out += ["", f"{ns['namespace']} ({here}): {ns['live']} live host(s), "
                    f"{AGREEMENT[ns['agreement']]}"]
        rows = [[h["host_id"], h["deployment"] or "-", _when(h["since"], now),
                 _health(h["health"]), _nvme(h["nvme"]), _key(h), h["state"]]
                for h in ns["hosts"]]
        if rows:
            out.append(table(rows, ["HOST", "DEPLOYMENT", "SINCE", "LAST HEALTH", "NVME AT LAUNCH",
                                    "KEY", "STATE"]))
        if ns["agreement"] == "disagree":
            groups = "; ".join(f"{g['serde_key_fingerprint'] or '(serde ' + g['serde'] + ')'}"
                               f": {', '.join(g['hosts'])}" for g in ns["fingerprints"])
            out.append(f"problem: the live hosts hold different serde keys ({groups}): "
                       "chunks each stores miss on the others")
        out += [f"warning: {p}" for p in ns["problems"]]
    if not doc["namespaces"]:
        out.append("no namespace (give --config or --namespace)")
    out.append("")
    out.append("state: live = refreshed within its TTL; stale = past updated_at + ttl_s; "
               "gone = named by the index, no record left")
    return "\n".join(out)


@click.group("fleet")
def fleet() -> None:
    """The hosts sharing the shared tier, from their fleet records."""


@fleet.command("status")
@click.option("--config", "configs", multiple=True, metavar="CONFIG",
              help="Deployment config whose namespace and shared tier to read (repeatable). "
                   "Default: every config under configs/ with a shared tier.")
@click.option("--namespace", "namespaces", multiple=True, metavar="NS",
              help="Also this namespace (repeatable): one no config here uses.")
@click.option("--timeout", type=TIMEOUT, default=3.0, show_default=True,
              help="Timeout of each call to the store, seconds.")
@json_option
def status(configs: tuple[str, ...], namespaces: tuple[str, ...], timeout: float,
           as_json: bool) -> None:
    """Per namespace, the hosts serving it, their serde-key agreement, health and NVMe use.

    Read from the fleet records on the shared tier (through each namespace's index, never a
    scan of the store). Exit 0 the live hosts of every namespace agree, 1 some hold
    different serde keys, 2 a usage or configuration error or the store unreachable."""
    from kvpersist.actions.fleet import fleet_status  # lazy: `fleet --help` stays light

    out = fleet_status(configs, namespaces, timeout=timeout)
    if as_json:
        echo_json(out.to_dict())
    else:
        click.echo(format_status(out.to_dict()))
    exit_with(out.exit_code)
