"""``kvp-admin report``: what is on the NVMe, per namespace (parse and format only)."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import click

from kvpersist.commands.common import echo_json, json_option, table
from kvpersist.config.values import format_size, parse_size_or_percent
from kvpersist.l2.layout import KvRank, is_namespace
from kvpersist.l2.retention import category
from kvpersist.l2.scan import (
    Inventory,
    Manifest,
    PrefixUsage,
    ScanResult,
    Usage,
    manifest_dirs,
    read_manifests,
    resolve_inventory,
    scan_root,
)

REPORT_SCHEMA = "kvpersist.report/1"
MANIFEST_FIELDS = ("model_id", "model_revision", "tensor_parallel_size", "kv_cache_dtype",
                   "max_model_len", "block_size")


def iso(ns: int) -> str | None:
    """ISO-8601 UTC time of a nanosecond timestamp (None for 0)."""
    if not ns:
        return None
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).isoformat(timespec="seconds")


def progress_printer(what: str, delay_s: float = 1.0) -> Callable[..., None] | None:
    """A progress callback writing to stderr, or None if stderr is not a terminal.

    Nothing is shown during the first ``delay_s`` seconds, so quick runs stay quiet.
    """
    if not sys.stderr.isatty():
        return None
    start = time.monotonic()

    def show(done: int, total: int | None = None) -> None:
        if time.monotonic() - start < delay_s:
            return
        of = f"/{total:,}" if total else ""
        click.echo(f"\r{what}: {done:,}{of}  ", err=True, nl=False)

    return show


def end_progress(cb: Callable[..., None] | None) -> None:
    if cb is not None:
        click.echo("\r" + " " * 60 + "\r", err=True, nl=False)


def budget_bytes(inv: Inventory, fs_total: int) -> int | None:
    """The L2 budget of the first deployment on this root, in bytes (None without one)."""
    for d in inv.deployments:
        try:
            size, frac = parse_size_or_percent(d.settings.l2_budget)
        except ValueError:
            continue
        return size if size is not None else int(fs_total * (frac or 0))
    return None


def _usage(u: Usage, samples: bool = False) -> dict[str, Any]:
    d: dict[str, Any] = {
        "files": u.files,
        "bytes": u.bytes,
        "allocated_bytes": u.allocated_bytes,
        "oldest_mtime": iso(u.oldest_mtime_ns),
        "newest_mtime": iso(u.newest_mtime_ns),
    }
    if samples:
        d["samples"] = list(u.samples)
    return d


def build_report(res: ScanResult, inv: Inventory, manifests: dict[str, Manifest],
                 budget: int | None) -> dict[str, Any]:
    """The report document (schema ``kvpersist.report/1``) from a scan (pure)."""
    assert res.fs is not None
    rows = []
    prefixes = dict(res.prefixes)
    for act in inv.active:  # an active namespace is listed even before it has files
        prefixes.setdefault(act, PrefixUsage(prefix=act))
    for prefix, u in sorted(prefixes.items(), key=lambda pu: (-pu[1].bytes, pu[0])):
        if not u.files and prefix not in inv.active:
            continue
        ns = prefix if is_namespace(prefix) else None
        man = manifests.get(prefix)
        ranks = sorted(u.ranks)
        decoded = [KvRank.decode(r) for r in ranks]
        rows.append({
            "namespace": ns,
            "prefix": prefix,
            "status": category(prefix, inv.active),
            "active": prefix in inv.active,
            "pinned": (not prefix.startswith("kvp-unpinned-")) if ns else None,
            "files": u.files,
            "bytes": u.bytes,
            "allocated_bytes": u.allocated_bytes,
            "share_of_budget": round(u.bytes / budget, 6) if budget else None,
            "oldest_mtime": iso(u.oldest_mtime_ns),
            "newest_mtime": iso(u.newest_mtime_ns),
            "last_access": iso(u.newest_atime_ns),
            "last_use": iso(u.last_use_ns),
            "tp_sizes": sorted({r.world_size for r in decoded}),
            "ranks": [
                {"kv_rank": f"{r:08x}", "world_size": k.world_size, "global_rank": k.global_rank,
                 "local_world_size": k.local_world_size, "local_rank": k.local_rank}
                for r, k in zip(ranks, decoded, strict=True)
            ],
            "groups": sorted(u.groups),
            "salted_files": u.salted_files,
            "salts": sorted(u.salts),
            "sharded_files": u.sharded_files,
            "manifest": None if man is None else {
                **{k: man.field(k) for k in MANIFEST_FIELDS},
                "config": man.deployment.get("config"),
                "served_model_name": man.deployment.get("served_model_name"),
            },
        })
    with_files = {r["prefix"] for r in rows if r["files"]}
    return {
        "schema": REPORT_SCHEMA,
        "root": res.root,
        "scanned_at": iso(res.started_ns),
        "duration_s": round(res.duration_s, 3),
        "filesystem": {
            "total_bytes": res.fs.total_bytes,
            "free_bytes": res.fs.free_bytes,
            "avail_bytes": res.fs.avail_bytes,
        },
        "budget_bytes": budget,
        "active": sorted(inv.active),
        "total_bytes": res.total_bytes,
        "chunk_files": res.chunk_files,
        "chunk_bytes": res.chunk_bytes,
        "namespaces": rows,
        "temp": _usage(res.temp),
        "foreign": {**_usage(res.foreign, samples=True), "dirs": res.foreign_dirs},
        "symlinks": _usage(res.symlinks, samples=True),
        "metadata": {"files": res.metadata.files, "bytes": res.metadata.bytes},
        "directories": {"count": res.directories.files, "bytes": res.directories.bytes},
        "manifests_without_files": sorted(set(manifests) - with_files),
        "errors": list(res.errors),
        "notes": list(inv.notes),
    }


def format_report(doc: dict[str, Any]) -> str:
    """The human table: largest first, human sizes, share of budget, status marks."""
    budget = doc["budget_bytes"]
    rows = []
    for r in doc["namespaces"]:
        man = r["manifest"] or {}
        model = man.get("model_id") or "-"
        rev = man.get("model_revision")
        if rev:
            model = f"{model}@{str(rev)[:8]}"
        rows.append([
            r["namespace"] or f"{r['prefix']} (not a namespace)",
            r["status"] + ("*" if r["active"] else ""),
            model,
            ",".join(str(t) for t in r["tp_sizes"]) or "-",
            man.get("kv_cache_dtype") or "-",
            f"{r['files']:,}",
            format_size(r["bytes"]),
            f"{100 * r['share_of_budget']:.1f}%" if r["share_of_budget"] is not None else "-",
            (r["last_use"] or "-")[:16].replace("T", " "),
        ])
    out = [f"L2 cache root {doc['root']}"]
    if rows:
        out.append(table(rows, ["NAMESPACE", "STATUS", "MODEL", "TP", "DTYPE", "FILES",
                                "SIZE", "BUDGET", "LAST USE"]))
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
    fs = doc["filesystem"]
    out.append(f"total     {format_size(doc['total_bytes'])} under the root "
               f"(du --apparent-size), filesystem {format_size(fs['total_bytes'])} with "
               f"{format_size(fs['avail_bytes'])} available")
    if budget:
        out.append(f"budget    {format_size(budget)} "
                   f"({100 * doc['chunk_bytes'] / budget:.1f}% used by chunks)")
    if doc["manifests_without_files"]:
        out.append("manifests without files: " + ", ".join(doc["manifests_without_files"]))
    if not doc["active"]:
        out.append("no active deployment on this root (give --config to mark one)")
    else:
        out.append("* = used by a configured deployment")
    for e in doc["errors"]:
        out.append(f"warning: {e}")
    for n in doc["notes"]:
        out.append(f"note: {n}")
    return "\n".join(out)


def inventory_options(func: Any) -> Any:
    """``--root DIR`` and ``--config CONFIG`` (repeatable)."""
    func = click.option("--config", "configs", multiple=True, metavar="CONFIG",
                        help="Deployment config whose namespace is active (repeatable). "
                             "Default: every config under configs/ on this root.")(func)
    return click.option("--root", type=click.Path(file_okay=False), default=None,
                        help="Cache root to inspect (default: the configs' KVP_CACHE_ROOT).")(func)


@click.command("report")
@inventory_options
@json_option
def report(root: str | None, configs: tuple[str, ...], as_json: bool) -> None:
    """What the L2 cache on disk holds, per namespace, measured from the filesystem."""
    inv = resolve_inventory(root, configs)
    cb = progress_printer("scanned entries")
    try:
        res = scan_root(inv.root, progress=cb, hist=False)
    except (FileNotFoundError, NotADirectoryError) as exc:
        from kvpersist.errors import UsageError

        raise UsageError(f"cannot scan {inv.root}: {exc}") from exc
    finally:
        end_progress(cb)
    manifests, bad = read_manifests(inv.root, manifest_dirs(inv.deployments))
    inv.notes.extend(bad)
    assert res.fs is not None
    doc = build_report(res, inv, manifests, budget_bytes(inv, res.fs.total_bytes))
    if as_json:
        echo_json(doc)
    else:
        click.echo(format_report(doc))
