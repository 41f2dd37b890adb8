"""``kvp-admin report``: what is on the NVMe, per namespace (parse and format only)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Any

import click

from kvpersist.commands.common import (
    echo_json,
    end_progress,
    inventory_options,
    json_option,
    progress_printer,
    table,
)
from kvpersist.config.values import format_size
from kvpersist.l2.layout import display_name
from kvpersist.l2.shared.wire import skipped_lines


def _pins(p: dict[str, Any] | None) -> str:
    """``files (size)`` of a namespace's warm-set pins, with the missing ones; '-' if none;
    ``all (held)`` when the pin manifest is unreadable (the note names it)."""
    if not p:
        return "-"
    if p.get("unreadable"):
        return "all (held)"
    missing = f", {p['missing']:,} missing" if p["missing"] else ""
    return f"{p['files']:,} ({format_size(p['bytes'])}{missing})"


def _age(seconds: float) -> str:
    """``40d``, ``5h``, ``12m``: an age in its largest whole unit, rounded down."""
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n:
            return f"{int(seconds // n)}{unit}"
    return f"{int(seconds)}s"


def _oldest(r: dict[str, Any], scanned_at: str | None) -> str:
    """The age of a row's oldest file (by write time) at the scan, or '-'."""
    if not r["oldest_mtime"] or not scanned_at:
        return "-"
    delta = datetime.fromisoformat(scanned_at) - datetime.fromisoformat(r["oldest_mtime"])
    return _age(max(0.0, delta.total_seconds()))


def _past(r: dict[str, Any]) -> str:
    """``files (size)`` past the maximum age that prune deletes, with the pins it keeps."""
    p = r.get("past_max_age")
    if not p:
        return "-"
    kept = f", {p['pinned_files']:,} pinned" if p["pinned_files"] else ""
    return f"{p['files']:,} ({format_size(p['bytes'])}{kept})"


def age_lines(doc: dict[str, Any]) -> list[str]:
    """One line per namespace with files: how many were written within each age bucket."""
    out = []
    for r in doc["namespaces"]:
        if not r["files"] or not r.get("ages"):
            continue
        parts = [f"<={b['label']} {b['files']:,}" if b["max_age_s"] is not None
                 else f"older {b['files']:,}" for b in r["ages"] if b["files"]]
        out.append(f"  {r['namespace'] or r['prefix']}: " + ", ".join(parts))
    return ["written (files by age):", *out] if out else []


def salt_lines(doc: dict[str, Any]) -> list[str]:
    """Files per cache_salt, for the namespaces that hold salted files."""
    out = []
    for r in doc["namespaces"]:
        if not r.get("salted_files"):
            continue
        parts = [f"{'(unsalted)' if x['salt'] is None else display_name(x['salt'])} "
                 f"{x['files']:,} "
                 f"({format_size(x['bytes'])})" for x in r.get("salt_usage") or []]
        out.append(f"  {r['namespace'] or r['prefix']}: " + ", ".join(parts))
    return ["files per cache_salt:", *out] if out else []


def format_report(doc: dict[str, Any]) -> str:
    """The human table: largest first, human sizes, share of budget, status marks."""
    budget = doc["limit_bytes"]
    max_age = doc.get("max_age_s")
    rows = []
    for r in doc["namespaces"]:
        man = r["manifest"] or {}
        model = man.get("model_id") or "-"
        rev = man.get("model_revision")
        if rev:
            model = f"{model}@{str(rev)[:8]}"
        rows.append([
            r["namespace"] or f"{r['prefix']} (not a namespace)",
            r["status"] + ("*" if r["active"] else "")
            + (" CANARY FAILED" if (r.get("canary") or {}).get("state") == "failed" else ""),
            model,
            ",".join(str(t) for t in r["tp_sizes"]) or "-",
            man.get("kv_cache_dtype") or "-",
            f"{r['files']:,}",
            format_size(r["bytes"]),
            _pins(r.get("warm_pins")),
            f"{100 * r['share_of_budget']:.1f}%" if r["share_of_budget"] is not None else "-",
            (r["last_use"] or "-")[:16].replace("T", " "),
            _oldest(r, doc.get("scanned_at")),
            *([_past(r)] if max_age else []),
        ])
    out = [f"L2 cache root {display_name(doc['root'])}"]
    if rows:
        out.append(table(rows, ["NAMESPACE", "STATUS", "MODEL", "TP", "DTYPE", "FILES",
                                "SIZE", "WARM PINS", "BUDGET", "LAST USE", "OLDEST",
                                *(["PAST MAX AGE"] if max_age else [])]))
    else:
        out.append("no chunk files")
    t, f, s = doc["temp"], doc["foreign"], doc["symlinks"]
    out.append("")
    out.append(f"chunks    {doc['chunk_files']:,} files, {format_size(doc['chunk_bytes'])}")
    out.append(f"temp      {t['files']:,} files, {format_size(t['bytes'])}"
               + (f" (oldest {t['oldest_mtime']})" if t["files"] else ""))
    out.append(f"foreign   {f['files']:,} files, {f['dirs']:,} dirs, "
               f"{format_size(f['bytes'])} (never touched)")
    if s["files"]:
        out.append(f"symlinks  {s['files']:,} (never followed)")
    doomed = doc["lmcache_deletes_at_stop"]
    if doomed["files"]:
        out.append(f"warning: {doomed['files']:,} file(s) that are not LMCache's have '.tmp.' in "
                   "their names (" + ", ".join(display_name(p) for p in doomed["samples"][:3])
                   + "): LMCache deletes "
                   "every such file under its cache root when it stops cleanly; move them out")
    fs = doc["filesystem"]
    out.append(f"total     {format_size(doc['total_bytes'])} under the root "
               f"(du --apparent-size), filesystem {format_size(fs['total_bytes'])} with "
               f"{format_size(fs['avail_bytes'])} available"
               + (", mounted read-only: LMCache's writes fail" if fs.get("read_only") else ""))
    if max_age:
        past = doc["past_max_age"]
        out.append(f"max age   {_age(max_age)} (KVP_L2_MAX_AGE): {past['files']:,} files, "
                   f"{format_size(past['bytes'])} written before it; kvp-admin prune "
                   "--max-age --apply deletes them (warm-set pins kept)")
    if budget:
        out.append(f"budget    {format_size(doc['budget_bytes'])}, limit {format_size(budget)} "
                   f"after the reserve ({100 * doc['chunk_bytes'] / budget:.1f}% used by "
                   "chunks)")
    if doc["manifests_without_files"]:
        out.append("manifests without files: " + ", ".join(doc["manifests_without_files"]))
    out += age_lines(doc)
    out += salt_lines(doc)
    if any(r.get("warm_pins") for r in doc["namespaces"]):
        out.append("warm pins: the warm set's files (kvp-admin warmup); prune --to-budget and "
                   "--stale never delete them")
    if any((r.get("warm_pins") or {}).get("unreadable") for r in doc["namespaces"]):
        out.append("all (held): the pin manifest cannot be read (see the notes); every file "
                   "of the namespace is kept by prune until it is fixed or removed")
    if not doc["active"]:
        out.append("no active deployment on this root (give --config to mark one)")
    else:
        out.append("* = used by a configured deployment")
    for e in doc["errors"]:
        out.append(f"warning: {e}")
    for n in doc["notes"]:
        out.append(f"note: {n}")
    return "\n".join(out)


def format_hosts(hosts: list[dict[str, Any]]) -> str:
    """``host-a-1a2b3c4d (12 s), ...``: the hosts whose fleet records name a namespace."""
    from kvpersist.l2.fleet.records import format_age

    return ", ".join(f"{h['host_id']} ({format_age(h['age_s'])})" for h in hosts) or "-"


def format_shared(doc: dict[str, Any]) -> str:
    """The shared tier's table: namespaces by size, then the store's budget."""
    rows = [[r["namespace"], "active" if r["active"] else "-", f"{r['keys']:,}",
             format_size(r["bytes"]), format_hosts(r["hosts"])] for r in doc["namespaces"]]
    tier, store = doc["tier"], doc["store"]
    out = [f"shared tier {tier['endpoint']} ({'cluster' if tier['cluster'] else 'standalone'}"
           f", adapter {tier['adapter']})"]
    out.append(table(rows, ["NAMESPACE", "STATUS", "KEYS", "SIZE", "HOSTS"]) if rows
               else "no chunk keys")
    out.append(f"chunks    {doc['chunk_keys']:,} keys, {format_size(doc['chunk_bytes'])}; "
               f"{doc['fleet_keys']:,} fleet keys ({doc['fleet_records']:,} host records); "
               f"{doc['other_keys']:,} other keys (never touched)")
    out += [f"warning: {line}" for line in skipped_lines(doc.get("skipped_keys") or {})]
    out += [f"warning: fleet record skipped: {p}" for p in doc["fleet_record_problems"]]
    limit = format_size(store["maxmemory_bytes"]) if store["maxmemory_bytes"] else "unlimited"
    out.append(f"store     {format_size(store['used_memory_bytes'])} used of {limit} on "
               f"{store['nodes']} node(s), maxmemory-policy "
               f"{', '.join(store['eviction_policies'])}")
    out += [f"problem: {p}" for p in store["problems"]]
    out += [f"warning: {w}" for w in store["warnings"]]
    return "\n".join(out)


TIER_CHOICE = click.Choice(["local", "shared", "all"])


@click.command("report")
@inventory_options
@click.option("--tier", type=TIER_CHOICE, default="local", show_default=True,
              help="The local NVMe, the shared tier (per-namespace keys and bytes, by SCAN on "
                   "every node), or both.")
@json_option
def report(root: str | None, configs: tuple[str, ...], tier: str, as_json: bool) -> None:
    """What the L2 cache holds per namespace, on disk and on the shared tier.

    On disk it is measured from the filesystem; on the shared tier counted by server-side
    iteration (SCAN on every node)."""
    from kvpersist.actions.tiers import report_tiers  # lazy: `report --help` stays light

    bars: list[Callable[..., None] | None] = []

    def progress(what: str) -> Callable[..., None] | None:
        bars.append(progress_printer(what))
        return bars[-1]

    try:
        out = report_tiers(tier, root, configs, progress=progress)
    finally:
        for cb in bars:
            end_progress(cb)
    if as_json:
        echo_json(out.to_dict())
        return
    parts = ([format_report(out.local.to_dict())] if out.local is not None else []) + \
        ([format_shared(out.shared)] if out.shared else [])
    click.echo("\n\n".join(parts))
