"""``kvp-admin prune``: explicit, dry-run-by-default cleanup of the L2 cache (parse and format).

Nothing is deleted without ``--apply``; the dry run prints exactly what ``--apply`` would delete.
"""

from __future__ import annotations

import time
from typing import Any

import click

from kvpersist.commands.common import echo_json, json_option
from kvpersist.commands.report import end_progress, inventory_options, progress_printer
from kvpersist.config.values import format_size, parse_duration
from kvpersist.errors import EXIT_PROBLEM, UsageError
from kvpersist.l2.budget import plan_for_deployment
from kvpersist.l2.prune import PruneResult, prune_lock, prune_stream
from kvpersist.l2.retention import RetentionPlan, plan_explicit, plan_retention, select_named
from kvpersist.l2.scan import Inventory, ScanResult, host_ram_bytes, resolve_inventory, scan_root


def _select(res: ScanResult, inv: Inventory, *, namespaces: tuple[str, ...], stale: bool,
            unpinned: bool, temp_older_than: float | None, to_budget: bool,
            force: bool) -> tuple[RetentionPlan, dict[str, Any] | None]:
    now = time.time_ns()
    if not to_budget:
        return plan_explicit(res.prefixes, res.temp, active=inv.active, now_ns=now,
                             namespaces=namespaces, stale=stale, unpinned=unpinned,
                             temp_older_than_s=temp_older_than, force=force), None
    assert res.fs is not None
    need = 0
    budget_doc = None
    for dep in inv.deployments:
        others = tuple(d for d in inv.deployments if d is not dep)
        bp = plan_for_deployment(dep, fs_total_bytes=res.fs.total_bytes,
                                 fs_avail_bytes=res.fs.avail_bytes, on_disk=res.prefix_bytes(),
                                 temp_bytes=res.temp.bytes, host_ram_bytes=host_ram_bytes(),
                                 others=others)
        want = bp.over_low_watermark_bytes
        if force:
            want = max(want, bp.prune_suggested_bytes)
        if want >= need:
            need, budget_doc = want, {
                "config": dep.name, "limit_bytes": bp.limit_bytes,
                "low_watermark_bytes": bp.low_watermark_bytes, "on_disk_bytes": bp.on_disk_bytes,
                "need_bytes": want,
            }
    plan = plan_retention(res.prefixes, res.temp, active=inv.active, need_bytes=need,
                          now_ns=now, allow_active=force,
                          **({} if temp_older_than is None
                             else {"temp_min_age_s": temp_older_than}))
    return plan, budget_doc


def format_result(res: PruneResult, plan: RetentionPlan) -> str:
    verb = "would delete" if res.dry_run else "deleted"
    lines = list(res.deleted_paths or [])
    for s in res.per_selection:
        what = s["prefix"] or "temp files"
        cut = ""
        if s["before_ns"] is not None:
            cut = " last used before " + time.strftime(
                "%Y-%m-%d %H:%M", time.gmtime(s["before_ns"] / 1e9)) + " UTC"
        lines.append(f"{verb} {s['deleted_files']:,} files, {format_size(s['deleted_bytes'])}: "
                     f"{what}{cut} ({s['reason']})")
    if not lines:
        lines.append("nothing selected")
    lines.append(f"total: {verb} {res.deleted_files:,} files, {format_size(res.deleted_bytes)}")
    skipped = res.skipped_changed + res.skipped_vanished + res.skipped_used
    if skipped:
        lines.append(f"skipped {skipped:,} files: {res.skipped_changed} changed since planned, "
                     f"{res.skipped_vanished} already gone, {res.skipped_used} used since planned")
    for ns in res.manifests_removed:
        lines.append(f"removed the manifest of {ns} (no files left)")
    for n in plan.notes:
        lines.append(f"note: {n}")
    for e in res.errors[:20]:
        lines.append(f"error: {e}")
    if res.dry_run:
        lines.append("dry run: nothing was deleted; add --apply to delete exactly these files")
    return "\n".join(lines)


@click.command("prune")
@inventory_options
@click.option("--namespace", "namespaces", multiple=True, metavar="NS",
              help="Delete all files of this namespace (or other file-name prefix); repeatable.")
@click.option("--stale", is_flag=True,
              help="Delete pinned namespaces no configured deployment on this root uses.")
@click.option("--unpinned", is_flag=True,
              help="Delete unpinned (kvp-unpinned-*) namespaces no active deployment uses.")
@click.option("--temp-older-than", metavar="DURATION", default=None,
              help="Delete temp files (interrupted writes) untouched for DURATION (e.g. 1h).")
@click.option("--to-budget", is_flag=True,
              help="Free space down to the budget's low watermark: temp, unpinned, then stale "
                   "namespaces least recently used first (and the active one with --force).")
@click.option("--force", is_flag=True, help="Allow deleting files of an active namespace.")
@click.option("--apply", is_flag=True, help="Really delete (default: dry run).")
@click.option("--list", "list_paths", is_flag=True,
              help="List every file (in the JSON output: a 'files' array).")
@json_option
def prune(root: str | None, configs: tuple[str, ...], namespaces: tuple[str, ...], stale: bool,
          unpinned: bool, temp_older_than: str | None, to_budget: bool, force: bool,
          apply: bool, list_paths: bool, as_json: bool) -> None:
    """Delete L2 cache files explicitly: dry run unless --apply.

    Only files whose names parse as LMCache chunk or temp files of a selected namespace are
    touched; foreign files, symlinks and manifests of namespaces with files left are never
    deleted. A file that changed after it was planned is skipped. Exit 1 if a file could not
    be deleted.
    """
    if not (namespaces or stale or unpinned or temp_older_than is not None or to_budget):
        raise UsageError("nothing selected: give --namespace, --stale, --unpinned, "
                         "--temp-older-than or --to-budget")
    if to_budget and (namespaces or stale or unpinned):
        raise UsageError("--to-budget chooses what to delete itself; do not combine it with "
                         "--namespace, --stale or --unpinned")
    older: float | None = None
    if temp_older_than is not None:
        try:
            older = parse_duration(temp_older_than)
        except ValueError as exc:
            raise UsageError(f"--temp-older-than: {exc}") from None
    for ns in namespaces:
        if not ns or "/" in ns or ns.startswith("."):
            raise UsageError(f"--namespace {ns!r}: not a file-name prefix")
    inv = resolve_inventory(root, configs)
    if (stale or to_budget) and not configs and not inv.deployments:
        raise UsageError(
            "no deployment config uses this root, so every namespace would look stale; name "
            "the active deployment(s) with --config CONFIG (or name namespaces with --namespace)"
        )
    if (stale or to_budget) and not configs and inv.notes:
        raise UsageError(
            "some configs under configs/ did not load, so the active namespaces are not "
            "certain; name them with --config CONFIG (" + "; ".join(inv.notes) + ")"
        )
    if to_budget and not inv.deployments:
        raise UsageError("--to-budget needs a deployment config on this root (--config)")

    def run() -> tuple[PruneResult, RetentionPlan, dict[str, Any] | None]:
        budget_doc = None
        if stale or unpinned or to_budget:
            # choosing needs the per-namespace picture (and, for --to-budget, last use)
            cb = progress_printer("scanned entries")
            try:
                res = scan_root(inv.root, progress=cb, hist=to_budget)
            finally:
                end_progress(cb)
            plan, budget_doc = _select(res, inv, namespaces=namespaces, stale=stale,
                                       unpinned=unpinned, temp_older_than=older,
                                       to_budget=to_budget, force=force)
        else:
            plan = select_named(active=inv.active, now_ns=time.time_ns(),
                                namespaces=namespaces, temp_older_than_s=older, force=force)
        cb = progress_printer("files deleted" if apply else "files selected")
        try:
            result = prune_stream(inv.root, plan.selections, active=inv.active,
                                  dry_run=not apply, list_paths=list_paths, progress=cb,
                                  lock=False)
        finally:
            end_progress(cb)
        return result, plan, budget_doc

    if apply:
        with prune_lock(inv.root):
            result, plan, budget_doc = run()
    else:
        result, plan, budget_doc = run()
    if as_json:
        echo_json({**result.to_dict(), "active": sorted(inv.active), "budget": budget_doc,
                   "retention": plan.to_dict()})
    else:
        click.echo(format_result(result, plan))
    if result.errors:
        click.get_current_context().exit(EXIT_PROBLEM)
