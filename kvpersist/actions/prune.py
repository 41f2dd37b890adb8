"""Use case: explicit, dry-run-by-default cleanup of the L2 cache (``kvp-admin prune``).

The guard rules live here, not in the command: what may be selected, when the active
namespaces are certain enough for ``--stale`` and ``--to-budget``, and how ``--to-budget``
turns every deployment's budget plan into bytes to free.

A namespace whose pin manifest cannot be read is held whole (:mod:`kvpersist.l2.pins.usage`):
``--stale``, ``--unpinned`` and ``--to-budget`` neither plan on its bytes nor delete any of
its files (the executor checks each file against it), and the result's warnings name the
manifest. Only ``--namespace`` deletes a held namespace, as it deletes pinned files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpersist.errors import UsageError
from kvpersist.l2.inventory import (
    Inventory,
    measurement_of,
    open_existing,
    plan_with,
    resolve_inventory,
    snapshot,
)
from kvpersist.l2.manifests import manifest_dirs
from kvpersist.l2.pins.store import read_pins
from kvpersist.l2.pins.usage import PinnedUsage, PinSet, Unpinned, all_names, without_pins
from kvpersist.l2.prune import PruneResult, prune_lock, prune_stream
from kvpersist.l2.retention import (
    RetentionPlan,
    UsageView,
    format_age,
    plan_explicit,
    plan_retention,
    select_named,
)
from kvpersist.l2.runs import record_run
from kvpersist.l2.scan import ScanResult

ProgressFactory = Callable[[str], Callable[..., None] | None]


@dataclass(frozen=True)
class PruneRequest:
    """What the operator asked to delete (validated by :func:`check_request`)."""

    namespaces: tuple[str, ...] = ()
    stale: bool = False
    unpinned: bool = False
    temp_older_than_s: float | None = None
    to_budget: bool = False
    force: bool = False
    #: a maximum age: every namespace's files written longer ago than this (--older-than)
    older_than_s: float | None = None
    #: the maximum age the root's deployments configure (KVP_L2_MAX_AGE; --max-age)
    max_age: bool = False

    @property
    def needs_scan(self) -> bool:
        """Choosing needs the per-namespace picture (and, for --to-budget, last use)."""
        return (self.stale or self.unpinned or self.to_budget or self.older_than_s is not None
                or self.max_age)


def check_request(req: PruneRequest) -> None:
    """Raise UsageError for a request that selects nothing or mixes exclusive selections."""
    if not (req.namespaces or req.stale or req.unpinned or req.temp_older_than_s is not None
            or req.to_budget or req.older_than_s is not None or req.max_age):
        raise UsageError("nothing selected: give --namespace, --stale, --unpinned, "
                         "--temp-older-than, --older-than, --max-age or --to-budget")
    if req.to_budget and (req.namespaces or req.stale or req.unpinned
                          or req.older_than_s is not None or req.max_age):
        raise UsageError("--to-budget chooses what to delete itself; do not combine it with "
                         "--namespace, --stale, --unpinned, --older-than or --max-age")
    if req.max_age and req.older_than_s is not None:
        raise UsageError("--max-age takes the age from KVP_L2_MAX_AGE; give it or "
                         "--older-than AGE, not both")
    for ns in req.namespaces:
        if not ns or "/" in ns or ns.startswith(".") or not ns.isprintable():
            raise UsageError(f"--namespace {ns!r}: not a file-name prefix")


def configured_max_age(inv: Inventory) -> tuple[float, list[str]]:
    """The maximum age of the root (--max-age): the shortest ``KVP_L2_MAX_AGE`` its
    deployments set, applied to every namespace on it; and notes (pure). Raises UsageError
    when none sets one."""
    ages = {d.name: d.settings.l2_max_age_s for d in inv.deployments
            if d.settings.l2_max_age_s > 0}
    if not ages:
        raise UsageError("--max-age: no deployment config on this root sets KVP_L2_MAX_AGE; "
                         "set it in identity.env (e.g. KVP_L2_MAX_AGE=30d) or give "
                         "--older-than AGE")
    age = min(ages.values())
    notes = []
    if len(set(ages.values())) > 1:
        notes.append("maximum age: the deployments on this root set different KVP_L2_MAX_AGE "
                     "values (" + ", ".join(f"{n} {format_age(a)}" for n, a in
                                            sorted(ages.items())) +
                     f"); the shortest, {format_age(age)}, applies to the whole root")
    return age, notes


def check_inventory(req: PruneRequest, inv: Inventory, configs: Sequence[str]) -> None:
    """Raise UsageError for --stale/--to-budget when the active namespaces are not certain,
    and for --unpinned/--to-budget when an unpinned deployment's active namespace is not
    (:attr:`~kvpersist.l2.inventory.Inventory.unsure`)."""
    if (req.stale or req.to_budget) and not configs and not inv.deployments:
        raise UsageError(
            "no deployment config uses this root, so every namespace would look stale; name "
            "the active deployment(s) with --config CONFIG (or name namespaces with --namespace)"
        )
    if (req.stale or req.to_budget) and not configs and inv.notes:
        raise UsageError(
            "some configs under configs/ did not load, so the active namespaces are not "
            "certain; name them with --config CONFIG (" + "; ".join(inv.notes) + ")"
        )
    if req.to_budget and not inv.deployments:
        raise UsageError("--to-budget needs a deployment config on this root (--config)")
    if (req.unpinned or req.to_budget) and inv.unsure:
        raise UsageError(
            "the active namespace of an unpinned deployment on this root is not certain, "
            "since a manifest cannot be read (" + "; ".join(inv.unsure[:3]) + "): fix or "
            "remove it, or name namespaces with --namespace"
        )


def unpinned_usage(res: ScanResult, pinned: Mapping[str, PinnedUsage],
                   held: Mapping[str, PinSet] | None = None,
                   hold_all: bool = False) -> dict[str, UsageView]:
    """Each prefix's scan figures less its warm-set pins (measured just after the scan), so
    that a plan never counts on bytes it may not delete (pure). A namespace whose pins are
    held whole (``held`` with :attr:`~kvpersist.l2.pins.usage.PinSet.held`; every prefix with
    ``hold_all``) has nothing left to choose from."""
    out: dict[str, UsageView] = dict(res.prefixes)
    for ns, pu in pinned.items():
        u = res.prefixes.get(ns)
        if u is not None:
            out[ns] = without_pins(u.files, u.bytes, u.use_hist, u.last_use_ns, pu)
    for ns, u in res.prefixes.items():
        p = (held or {}).get(ns)
        if hold_all or (p is not None and p.held):
            out[ns] = Unpinned(0, 0, {}, u.last_use_ns)
    return out


def select(res: ScanResult, inv: Inventory, req: PruneRequest,
           ram_bytes: int | None = None,
           pinned: Mapping[str, PinnedUsage] | None = None,
           held: Mapping[str, PinSet] | None = None, hold_all: bool = False,
           ) -> tuple[RetentionPlan, dict[str, Any] | None]:
    """The retention plan for ``req`` from one scan (and, for --to-budget, the budget of the
    deployment that needs the most freed). ``pinned``: what each namespace's warm-set pins
    hold; they are left out of what --stale, --unpinned and --to-budget may choose, and so
    is every namespace held whole (``held``, ``hold_all``: see :func:`unpinned_usage`)."""
    now = time.time_ns()
    prefixes = unpinned_usage(res, pinned or {}, held, hold_all)
    if not req.to_budget:
        older, age_notes = req.older_than_s, list[str]()
        if req.max_age:
            older, age_notes = configured_max_age(inv)
        plan = plan_explicit(prefixes, res.temp, active=inv.active, now_ns=now,
                             namespaces=req.namespaces, stale=req.stale,
                             unpinned=req.unpinned, temp_older_than_s=req.temp_older_than_s,
                             older_than_s=older, force=req.force)
        return (dataclasses.replace(plan, notes=(*age_notes, *plan.notes)) if age_notes
                else plan), None
    m = measurement_of(res, ram_bytes)
    need = 0
    budget_doc = None
    for dep in inv.deployments:
        bp = plan_with(dep, m, inv.others(dep))
        want = bp.over_low_watermark_bytes
        if req.force:
            want = max(want, bp.prune_suggested_bytes)
        if want >= need:
            need, budget_doc = want, {
                "config": dep.name, "limit_bytes": bp.limit_bytes,
                "low_watermark_bytes": bp.low_watermark_bytes, "on_disk_bytes": bp.on_disk_bytes,
                "need_bytes": want,
            }
    extra = {} if req.temp_older_than_s is None else {"temp_min_age_s": req.temp_older_than_s}
    plan = plan_retention(prefixes, res.temp, active=inv.active, need_bytes=need,
                          now_ns=now, allow_active=req.force, **extra)
    return plan, budget_doc


@dataclass
class PruneOutcome:
    """What a prune did (or would do), with the plan that chose it."""

    result: PruneResult
    plan: RetentionPlan
    active: set[str] = field(default_factory=set)
    budget: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**self.result.to_dict(), "active": sorted(self.active), "budget": self.budget,
                "retention": self.plan.to_dict()}


def prune(root: str | None, configs: Sequence[str], req: PruneRequest, *, apply: bool = False,
          list_paths: bool = False,
          progress: ProgressFactory | None = None) -> PruneOutcome:
    """Select and delete (``apply``) or list (dry run) under the root's prune lock.

    Raises UsageError for a request or inventory that cannot be pruned safely, PruneLocked if
    another prune holds the root, KvpError if the root cannot be read. A dry run never
    creates anything.
    """
    check_request(req)
    inv = resolve_inventory(root, configs)
    check_inventory(req, inv, configs)
    if req.max_age:
        configured_max_age(inv)  # before the root is opened: a usage error, nothing scanned

    def bar(what: str) -> Callable[..., None] | None:
        return progress(what) if progress is not None else None

    # the one opening of the root: the lock, the scan, the pins, the deletion and the record
    # of the run all use this handle
    with open_existing(inv.root) as handle:
        lock = prune_lock(handle) if apply else contextlib.nullcontext()
        with lock:
            budget_doc = None
            if req.needs_scan:
                snap = snapshot(handle, manifests=False, hist=req.to_budget, pin_hist=True,
                                progress=bar("scanned entries"))
                pins, pin_problems = dict(snap.pins), list(snap.pin_problems)
                hold_all = bool(snap.pins_unreadable_dir)
                plan, budget_doc = select(snap.scan, inv, req, pinned=snap.pinned, held=pins,
                                          hold_all=hold_all)
            else:
                read = read_pins(handle)
                pins, pin_problems = dict(read.pins), list(read.problems)
                hold_all = bool(read.unreadable_dir)
                plan = select_named(active=inv.active, now_ns=time.time_ns(),
                                    namespaces=req.namespaces,
                                    temp_older_than_s=req.temp_older_than_s, force=req.force)
            result = prune_stream(handle, plan.selections, active=inv.active,
                                  dry_run=not apply, list_paths=list_paths,
                                  progress=bar("files deleted" if apply else "files selected"),
                                  lock=False, manifest_dirs=manifest_dirs(inv.deployments),
                                  keep=all_names(pins.values()),
                                  keep_namespaces=frozenset(
                                      ns for ns, p in pins.items() if p.held),
                                  keep_all=hold_all)
            result.warnings.extend(pin_problems)
            if apply:
                warning = record_run(handle, "prune", ok=not result.errors, counts={
                    "deleted_files": result.deleted_files,
                    "deleted_bytes": result.deleted_bytes,
                    "errors": len(result.errors)}, mode="apply")
                if warning:
                    result.warnings.append(warning)
    return PruneOutcome(result, plan, set(inv.active), budget_doc)
