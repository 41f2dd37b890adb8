"""Use cases over the tiers: ``report --tier`` and ``prune --tier local|shared|all``.

Which tier's use case runs, in which order, and how their results merge into one document:
the local NVMe (:mod:`kvpersist.actions.report`, :mod:`kvpersist.actions.prune`) and the
shared tier (:mod:`kvpersist.actions.shared`). The commands call these and only parse and
format.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpersist.actions.prune import ProgressFactory, PruneOutcome, PruneRequest, prune
from kvpersist.actions.report import Report, report
from kvpersist.actions.shared import prune_shared, report_shared
from kvpersist.errors import EXIT_OK, EXIT_PROBLEM, UsageError

TIERS = ("local", "shared", "all")


def check_tier(tier: str) -> None:
    """Raise UsageError for a tier that is not one of :data:`TIERS`."""
    if tier not in TIERS:
        raise UsageError(f"--tier {tier!r}: use one of {', '.join(TIERS)}")


@dataclass(frozen=True)
class TierReport:
    """``report --tier``: the local report (None for ``shared``) and the shared tier's
    document (None for ``local``)."""

    tier: str
    local: Report | None = None
    shared: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """``shared``: the shared tier's document; ``local``: the report; ``all``: the report
        with the shared tier's document under ``"shared"``."""
        doc = self.local.to_dict() if self.local is not None else {}
        if self.tier == "shared":
            return self.shared or {}
        return {**doc, "shared": self.shared} if self.shared else doc


def report_tiers(tier: str, root: str | None, configs: Sequence[str] = (), *,
                 progress: ProgressFactory | None = None) -> TierReport:
    """Report ``tier``: the cache root (given, or the configs' cache root) scanned once,
    then the shared tier. ``progress(what)`` makes the progress callback of the scan.
    Raises UsageError (a bad tier, a missing root, no shared tier), KvpError when the
    store cannot be reached."""
    check_tier(tier)
    local: Report | None = None
    if tier in ("local", "all"):
        local = report(root, configs, progress=progress("scanned entries") if progress else None)
    shared = report_shared(configs) if tier in ("shared", "all") else None
    return TierReport(tier, local, shared)


@dataclass
class TierPrune:
    """``prune --tier``: the local outcome (None for ``shared``) and the shared tier's
    document (empty for ``local``)."""

    tier: str
    local: PruneOutcome | None = None
    shared: dict[str, Any] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        """1 when a local file could not be deleted, else 0."""
        return EXIT_PROBLEM if self.local is not None and self.local.result.errors else EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        """``shared``: the shared tier's document; ``local``: the local outcome; ``all``: the
        local outcome with the shared tier's document under ``"shared"``."""
        if self.local is None:
            return self.shared
        doc = self.local.to_dict()
        return {**doc, "shared": self.shared} if self.tier == "all" else doc


def check_tier_request(tier: str, req: PruneRequest, *, list_paths: bool = False) -> None:
    """Raise UsageError when ``tier`` is not local and ``req`` selects other than by
    namespace (the shared tier has no temp files, last use or budget)."""
    check_tier(tier)
    if tier != "local" and (req.stale or req.unpinned or req.temp_older_than_s is not None
                            or req.to_budget or list_paths or req.older_than_s is not None
                            or req.max_age):
        raise UsageError("--tier shared/all selects by --namespace only (no --stale, "
                         "--unpinned, --temp-older-than, --older-than, --max-age, "
                         "--to-budget or --list)")


def prune_tiers(tier: str, root: str | None, configs: Sequence[str], req: PruneRequest, *,
                apply: bool = False, list_paths: bool = False,
                progress: ProgressFactory | None = None,
                shared_progress: Callable[[int], None] | None = None) -> TierPrune:
    """Prune ``tier``: the shared tier first (``shared``, ``all``: by ``req.namespaces``),
    then the local cache root (``local``, ``all``). A dry run unless ``apply``.

    Raises UsageError for a request the tier cannot take (:func:`check_tier_request`) and
    whatever :func:`~kvpersist.actions.shared.prune_shared` and
    :func:`~kvpersist.actions.prune.prune` raise."""
    check_tier_request(tier, req, list_paths=list_paths)
    out = TierPrune(tier)
    if tier != "local":
        out.shared = prune_shared(configs, req.namespaces, apply=apply, force=req.force,
                                  progress=shared_progress)
    if tier != "shared":
        out.local = prune(root, configs, req, apply=apply, list_paths=list_paths,
                          progress=progress)
    return out
