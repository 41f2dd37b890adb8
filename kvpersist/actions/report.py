"""Use case: what is on a cache root, per namespace (``kvp-admin report``)."""

from __future__ import annotations

from collections.abc import Sequence

from kvpersist.l2.inventory import open_existing, resolve_inventory
from kvpersist.l2.report import Report, report_on
from kvpersist.l2.scan import ProgressFn

__all__ = ["Report", "report"]


def report(root: str | None, configs: Sequence[str] = (), *,
           progress: ProgressFn | None = None) -> Report:
    """Scan the root (given, or the configs' cache root) once and join it with the
    manifests and the configured deployments. Raises UsageError for a missing root."""
    inv = resolve_inventory(root, configs)
    with open_existing(inv.root) as handle:
        return report_on(handle, inv, progress=progress)
