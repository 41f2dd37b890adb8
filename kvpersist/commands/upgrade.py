"""``kvp-admin upgrade``: plan an upgrade that changes the namespace (parse and format only)."""

from __future__ import annotations

from typing import Any

import click

from kvpersist.commands.common import echo_json, json_option, table
from kvpersist.config.values import format_size


@click.group()
def upgrade() -> None:
    """Plan a vLLM, LMCache or model upgrade: what changes and the steps, read-only."""


def _short(value: Any) -> str:
    text = ",".join(f"{k}={v}" for k, v in sorted(value.items())) if isinstance(value, dict) \
        else str(value)
    return text[:16] + "…" if len(text) == 64 and text.isalnum() else text


def _hosts(hosts: list[dict[str, Any]]) -> str:
    from kvpersist.l2.fleet.records import format_age

    return ", ".join(f"{h['host_id']} ({format_age(h['age_s'])})" for h in hosts)


def format_plan(doc: dict[str, Any]) -> str:
    """The plan as text: fields, the old namespace's data, what goes stale, the warm set,
    the steps."""
    old, new = doc["old"], doc["new"]
    out = [f"OLD {old['namespace']}  {old['config']}",
           f"NEW {new['namespace']}  {new['config']}", doc["verdict"]]
    if doc["changes"]:
        out += ["", table([(c["field"], _short(c["old"]), _short(c["new"]), c["reason"])
                           for c in doc["changes"]], ("field", "OLD", "NEW", "why it changes "
                                                      "the namespace"))]
    elif not doc["same_namespace"]:
        out.append("identity fields: identical")
    local, shared = doc["old_data"]["local"], doc["old_data"]["shared"]
    out.append("")
    label = "data of the namespace" if doc["same_namespace"] else "old namespace's data"
    if local is not None:
        pins = (f", {local['pinned_files']:,} pinned ({format_size(local['pinned_bytes'])})"
                if local["pinned_files"] else ", no pinned files")
        out.append(f"{label} on this host ({local['root']}): {local['files']:,} files, "
                   f"{format_size(local['bytes'])}{pins}")
    if shared is not None:
        out.append(f"{label} on the shared tier {shared['endpoint']}: {shared['keys']:,} "
                   f"keys, {format_size(shared['bytes'])}")
    st = doc["stale"]
    if st is not None:
        out.append(f"becomes stale: {st['namespace']} on this host {st['local_when']}")
        if st["shared_when"]:
            who = f" ({_hosts(st['serving_hosts'])})" if st["serving_hosts"] else ""
            out.append(f"  on the shared tier {st['shared_when']}{who}")
    w = doc["warm_set"]
    if w["file"]:
        size = (f"{w['tokens']:,} tokens, {w['chunks']:,} chunks of {w['chunk_size']} "
                f"({w['chunk_files']:,} chunk files at TP {w['world_size']})"
                if w["tokens"] is not None else "")
        out.append(f"NEW's warm set {w['file']}: {w['entries']:,} entries"
                   + (f", {size}" if size else ""))
    if w["note"]:
        out.append(f"  {w['note']}")
    v = doc.get("vllm")
    if v is not None:
        out += ["", f"vLLM {v['old']} -> {v['new']}"
                + ("" if v["supported"]["new"] else " (NOT a supported release)"),
                f"  NEW's release, as tested: {v['new_tested']}",
                f"  starts as: python {' '.join(v['serve']['new'])} (was: python "
                f"{' '.join(v['serve']['old'])})"]
        rf = v["rendered_flags"]
        if rf["added"] or rf["removed"]:
            out.append(f"  kvpersist renders: {' '.join(rf['added']) or '-'} added, "
                       f"{' '.join(rf['removed']) or '-'} dropped")
        for f in v["deployment_flags"]:
            out.append(f"  {f['flag']}: {f['what']}")
        if v["new_kv_flags"]:
            out.append(f"  new KV-affecting flags (at their defaults unless set): "
                       f"{', '.join(v['new_kv_flags'])}")
    out += ["", "steps:"]
    for s in doc["steps"]:
        out.append(f"{s['step']:>2}. {s['what']}" + (f"\n      {s['command']}"
                                                     if s["command"] else ""))
        if s["note"]:
            out.append(f"      # {s['note']}")
    out += [f"problem: {p}" for p in doc["problems"]]
    out += [f"note: {n}" for n in doc["notes"]]
    return "\n".join(out)


@upgrade.command("plan")
@click.argument("old", metavar="OLD")
@click.argument("new", metavar="NEW")
@json_option
def plan(old: str, new: str, as_json: bool) -> None:
    """Plan the upgrade from deployment config OLD to deployment config NEW.

    Both are configs (an identity.env, a directory holding one, or a name under configs/;
    derive NEW from a model directory first with `kvp-admin identity derive`). Shows the
    identity fields that change and why each changes the namespace, what the old namespace
    holds on this host and on the shared tier (as `kvp-admin report` counts it), what becomes
    stale, NEW's warm set, and the commands to run, in order. Reads only; exit 0 when the
    plan is made, 2 for a config that does not load. A cache root or shared tier that cannot
    be read is a problem in the plan."""
    from kvpersist.actions.upgrade import plan as make_plan

    doc = make_plan(old, new).to_dict()
    if as_json:
        echo_json(doc)
    else:
        click.echo(format_plan(doc))
