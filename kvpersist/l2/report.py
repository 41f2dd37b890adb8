"""``kvp-admin report``'s document of a cache root: the scan joined with the manifests, the
pins and the configured deployments (:func:`build_report`, pure), and :func:`report_on`, which
scans the open root handle once (an l2 operation: the use case opens the root).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from kvpersist.config.values import parse_size_or_percent
from kvpersist.l2.ages import age_distribution, past_max_age, root_max_age, salt_rows
from kvpersist.l2.budget import l2_limit
from kvpersist.l2.inventory import (
    Inventory,
    RootDir,
    snapshot,
)
from kvpersist.l2.layout import KvRank, is_namespace
from kvpersist.l2.manifests import Manifest
from kvpersist.l2.pins.usage import PinnedUsage, PinSet
from kvpersist.l2.retention import category
from kvpersist.l2.scan import ProgressFn, ScanResult
from kvpersist.l2.usage import PrefixUsage, Usage

REPORT_SCHEMA = "kvpersist.report/1"
MANIFEST_FIELDS = ("model_id", "model_revision", "tensor_parallel_size", "kv_cache_dtype",
                   "max_model_len", "block_size")


def iso(ns: int) -> str | None:
    """ISO-8601 UTC time of a nanosecond timestamp (None for 0)."""
    if not ns:
        return None
    return datetime.fromtimestamp(ns / 1e9, tz=UTC).isoformat(timespec="seconds")


def budget_figures(inv: Inventory,
                   res: ScanResult) -> tuple[int | None, int | None, int | None]:
    """(budget, limit, reserve) in bytes of the first deployment on this root whose sizes
    parse (None without one). The limit keeps the reserve free, exactly as
    ``kvp-admin budget``'s does."""
    assert res.fs is not None
    for d in inv.deployments:
        s = d.settings
        try:
            parse_size_or_percent(s.l2_budget)
            parse_size_or_percent(s.l2_reserve)
        except ValueError:
            continue
        budget, reserve, limit = l2_limit(fs_total_bytes=res.fs.total_bytes,
                                    fs_avail_bytes=res.fs.avail_bytes,
                                    l2_now_bytes=res.chunk_bytes + res.temp.bytes,
                                    l2_budget=s.l2_budget, l2_reserve=s.l2_reserve)
        return budget, limit, reserve
    return None, None, None


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
                 budget: int | None, limit: int | None = None,
                 reserve: int | None = None,
                 pins: dict[str, tuple[PinSet, PinnedUsage]] | None = None,
                 max_age_s: float | None = None) -> dict[str, Any]:
    """The report document (schema ``kvpersist.report/1``) from a scan (pure).

    ``share_of_budget`` is each namespace's share of the limit (the budget less what the
    reserve takes), the figure ``kvp-admin budget`` plans with. ``pins``: each namespace's
    warm-set pins and what they hold on disk (``warm_pins`` of its row). Each row's
    ``ages`` is its age distribution by write time (a scan with ``ages``; kvpersist.l2.ages)
    and, with ``max_age_s`` (the root's KVP_L2_MAX_AGE), what lies past it in a namespace
    (``past_max_age``: what ``prune --max-age`` deletes, and the pins it keeps); ``salts``
    its files per ``cache_salt``."""
    pins = pins or {}
    now = res.started_ns
    past_files = past_bytes = 0
    assert res.fs is not None
    limit = budget if limit is None else limit
    rows = []
    prefixes = dict(res.prefixes)
    for act in [*inv.active, *pins]:  # listed even before it has files
        prefixes.setdefault(act, PrefixUsage(prefix=act))
    for prefix, u in sorted(prefixes.items(), key=lambda pu: (-pu[1].bytes, pu[0])):
        if not u.files and prefix not in inv.active and prefix not in pins:
            continue
        ns = prefix if is_namespace(prefix) else None
        man = manifests.get(prefix)
        past = None
        if max_age_s and ns:
            pin = pins.get(prefix)
            past = past_max_age(u.write_hist, now, max_age_s,
                                pin[1].write_hist if pin else None,
                                held=bool(pin and pin[0].held))
            past_files += past.files
            past_bytes += past.bytes
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
            "share_of_budget": round(u.bytes / limit, 6) if limit else None,
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
            "salt_usage": salt_rows(u.files, u.bytes, u.salt_usage, u.salt_overflow),
            "ages": age_distribution(u.write_hist, now) if u.write_hist or not u.files
            else None,
            "past_max_age": None if past is None else past.to_dict(),
            "sharded_files": u.sharded_files,
            "warm_pins": None if prefix not in pins else {
                **pins[prefix][1].to_dict(), "listed": len(pins[prefix][0].files),
                "warm_file_sha256": pins[prefix][0].warm_file_sha256,
                # the manifest cannot be read: every file of the namespace is held
                "unreadable": pins[prefix][0].unreadable or None},
            "manifest": None if man is None else {
                **{k: man.field(k) for k in MANIFEST_FIELDS},
                "config": man.deployment.get("config"),
                "served_model_name": man.deployment.get("served_model_name"),
            },
        })
    with_files = {r["prefix"] for r in rows if r["files"]}
    return {
        "schema": REPORT_SCHEMA,
        # names as the OS gave them (lossless: docs/inventory.md, "Names in --json"); the
        # table escapes them
        "root": res.root,
        "scanned_at": iso(res.started_ns),
        "duration_s": round(res.duration_s, 3),
        "filesystem": {
            "total_bytes": res.fs.total_bytes,
            "free_bytes": res.fs.free_bytes,
            "avail_bytes": res.fs.avail_bytes,
            # the filesystem's own state; "read_only_here": only this process's view of it
            # is read-only (a sandbox: the health unit's ProtectSystem=strict)
            "read_only": res.fs.filesystem_read_only,
            "read_only_here": res.fs.sandboxed,
        },
        "budget_bytes": budget,
        "limit_bytes": limit,
        "reserve_bytes": reserve,
        "active": sorted(inv.active),
        "total_bytes": res.total_bytes,
        "chunk_files": res.chunk_files,
        "chunk_bytes": res.chunk_bytes,
        # the root's maximum age (the shortest KVP_L2_MAX_AGE of its deployments) and what
        # of its namespaces lies past it (prune --max-age deletes it; warm-set pins kept)
        "max_age_s": max_age_s or None,
        "past_max_age": None if not max_age_s else {"files": past_files, "bytes": past_bytes},
        "namespaces": rows,
        "temp": _usage(res.temp),
        "foreign": {**_usage(res.foreign, samples=True), "dirs": res.foreign_dirs},
        # not LMCache's, but named like its temp files: its clean-up deletes them at a stop
        "lmcache_deletes_at_stop": _usage(res.lmcache_cleans, samples=True),
        "symlinks": _usage(res.symlinks, samples=True),
        "metadata": {"files": res.metadata.files, "bytes": res.metadata.bytes},
        "directories": {"count": res.directories.files, "bytes": res.directories.bytes},
        # moved there by `verify --apply` (part of the metadata above)
        "quarantine": {"files": res.quarantine.files, "bytes": res.quarantine.bytes},
        "entries": res.entries,
        "manifests_without_files": sorted(set(manifests) - with_files),
        "errors": list(res.errors),
        "notes": list(inv.notes),
    }


class Report:
    """The result of :func:`report`: the document, and the scan it comes from."""

    def __init__(self, doc: dict[str, Any], scan: ScanResult) -> None:
        self.doc = doc
        self.scan = scan

    def to_dict(self) -> dict[str, Any]:
        return self.doc


def report_on(root: RootDir, inv: Inventory, *, progress: ProgressFn | None = None) -> Report:
    """:func:`report` of the open ``root`` (``inv``'s, opened by the caller). The problems met
    reading manifests and pins are added to ``inv.notes``."""
    snap = snapshot(root, inv.deployments, ages=True, pin_hist=True, progress=progress)
    inv.notes.extend(p for p in snap.manifest_problems if p not in inv.notes)
    inv.notes.extend(snap.pin_problems)
    pins = {ns: (p, snap.pinned[ns]) for ns, p in snap.pins.items()}
    budget, limit, reserve = budget_figures(inv, snap.scan)
    max_age = root_max_age(d.settings.l2_max_age_s for d in inv.deployments)
    return Report(build_report(snap.scan, inv, dict(snap.manifests), budget, limit, reserve,
                               pins, max_age), snap.scan)
