"""``kvp-admin prune``: explicit, dry-run-by-default cleanup of the L2 cache (parse and format).

Nothing is deleted without ``--apply``; the dry run prints exactly what ``--apply`` would delete.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from kvpersist.commands.common import (
    echo_json,
    end_progress,
    exit_with,
    inventory_options,
    json_option,
)
from kvpersist.commands.common import progress_printer as _printer
from kvpersist.config.values import format_size, parse_duration, parse_max_age
from kvpersist.errors import UsageError
from kvpersist.l2.layout import display_name
from kvpersist.l2.shared.wire import skipped_lines

if TYPE_CHECKING:
    from kvpersist.l2.prune import PruneResult
    from kvpersist.l2.retention import RetentionPlan


def format_result(res: PruneResult, plan: RetentionPlan) -> str:
    verb = "would delete" if res.dry_run else "deleted"
    lines = [display_name(p) for p in res.deleted_paths or []]
    for s in res.per_selection:
        what = s["prefix"] or "temp files"
        cut = ""
        if s["before_ns"] is not None:
            cut = (" written before " if s.get("by") == "written" else " last used before ") + \
                time.strftime(
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
    if res.kept_pinned:
        lines.append(f"kept {res.kept_pinned:,} warm-set pinned files (kvp-admin warmup): only "
                     "--namespace deletes them")
    if res.deleted_pinned:
        lines.append(f"{'would delete' if res.dry_run else 'deleted'} "
                     f"{res.deleted_pinned:,} warm-set pinned files too (the namespace was "
                     "named); the next kvp-admin warmup reads them from disk again only once "
                     "vLLM has recomputed them")
    for ns in res.manifests_removed:
        lines.append(f"removed the manifest of {ns} (no files left)")
    for ns in res.pins_removed:
        lines.append(f"removed the warm-set pins of {ns} (no files left)")
    for ns in res.frame_records_removed:
        lines.append(f"removed the frame record of {ns} (no files left)")
    for n in plan.notes:
        lines.append(f"note: {n}")
    for e in res.errors[:20]:
        lines.append(f"error: {e}")
    for w in res.warnings:
        lines.append(f"warning: {w}")
    if res.dry_run:
        lines.append("dry run: nothing was deleted; add --apply to delete exactly these files")
    return "\n".join(lines)


def format_shared(doc: dict[str, Any]) -> str:
    verb = "would delete" if doc["dry_run"] else "deleted"
    lines = [f"shared tier {doc['tier']['endpoint']}: {verb} {r['deleted_keys']:,} keys, "
             f"{format_size(r['deleted_bytes'])}: {r['namespace']} ({r['batches']} batches)"
             for r in doc["namespaces"]]
    lines += [f"warning: {line}" for r in doc["namespaces"]
              for line in skipped_lines(r.get("skipped_keys") or {})]
    if doc["dry_run"]:
        lines.append("dry run: nothing was deleted on the shared tier; add --apply")
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
@click.option("--older-than", metavar="AGE", default=None,
              help="Delete every namespace's chunk files written more than AGE ago (30d, 12h, "
                   "90m; by mtime, never atime; warm-set pins kept).")
@click.option("--max-age", is_flag=True,
              help="--older-than the root's KVP_L2_MAX_AGE (the shortest its deployments "
                   "set).")
@click.option("--to-budget", is_flag=True,
              help="Free space down to the budget's low watermark: temp, unpinned, then stale "
                   "namespaces least recently used first (and the active one with --force).")
@click.option("--tier", type=click.Choice(["local", "shared", "all"]), default="local",
              show_default=True,
              help="Where to delete: the local NVMe, the shared tier (--namespace only; keys "
                   "deleted in SCAN-page batches under a lock held in the store), or both.")
@click.option("--force", is_flag=True, help="Allow deleting files of an active namespace.")
@click.option("--apply", is_flag=True, help="Really delete (default: dry run).")
@click.option("--list", "list_paths", is_flag=True,
              help="List every file (in the JSON output: a 'files' array).")
@json_option
def prune(root: str | None, configs: tuple[str, ...], namespaces: tuple[str, ...], stale: bool,
          unpinned: bool, temp_older_than: str | None, older_than: str | None, max_age: bool,
          to_budget: bool, tier: str, force: bool, apply: bool, list_paths: bool,
          as_json: bool) -> None:
    """Delete L2 cache files explicitly: dry run unless --apply.

    Only files whose names parse as LMCache chunk or temp files of a selected namespace are
    touched; foreign files, symlinks and manifests of namespaces with files left are never
    deleted. Warm-set pins (kvp-admin warmup) are deleted only by --namespace. A file that
    changed after it was planned is skipped. Exit 1 if a file could not be deleted.
    """
    from kvpersist.actions.prune import PruneRequest  # lazy: `prune --help` stays light
    from kvpersist.actions.tiers import prune_tiers

    older: float | None = None
    if temp_older_than is not None:
        try:
            older = parse_duration(temp_older_than)
        except ValueError as exc:
            raise UsageError(f"--temp-older-than: {exc}") from None
    aged: float | None = None
    if older_than is not None:
        aged, problem = parse_max_age(older_than)
        if problem or not aged:
            raise UsageError(f"--older-than: {problem or 'give an age, e.g. 30d'}")
    req = PruneRequest(namespaces=namespaces, stale=stale, unpinned=unpinned,
                       temp_older_than_s=older, to_budget=to_budget, force=force,
                       older_than_s=aged, max_age=max_age)
    bars: list[Callable[..., None] | None] = []

    def progress(what: str) -> Callable[..., None] | None:
        bars.append(_printer(what))
        return bars[-1]

    try:
        out = prune_tiers(tier, root, configs, req, apply=apply, list_paths=list_paths,
                          progress=progress)
    finally:
        for cb in bars:
            end_progress(cb)
    if as_json:
        echo_json(out.to_dict())
    else:
        if out.local is not None:
            click.echo(format_result(out.local.result, out.local.plan))
        if out.shared:
            click.echo(format_shared(out.shared))
    exit_with(out.exit_code)
