"""Use case: what is on a cache root, per namespace (``kvp-admin report``)."""

from __future__ import annotations

from collections.abc import Sequence

from kvpersist.l2.inventory import open_existing, resolve_inventory
from kvpersist.l2.report import Report, report_on
from kvpersist.l2.scan import ProgressFn
from kvpersist.stack.canary.run import canary_status
from kvpersist.stack.locate import locate

__all__ = ["Report", "report"]


def report(root: str | None, configs: Sequence[str] = (), *,
           progress: ProgressFn | None = None) -> Report:
    """Scan the root (given, or the configs' cache root) once and join it with the
    manifests and the configured deployments. Raises UsageError for a missing root."""
    inv = resolve_inventory(root, configs)
    with open_existing(inv.root) as handle:
        rep = report_on(handle, inv, progress=progress)
    canaries = {d.namespace: canary_status(locate(d)) for d in inv.deployments}
    for row in rep.doc["namespaces"]:
        # the canary of each configured deployment's namespace (docs/canary.md): failed
        # means vLLM serves it without the cache until `kvp-admin canary reset`
        c = canaries.get(row["prefix"])
        row["canary"] = None if c is None else {
            "state": c["state"], "failed_at": (c.get("failed") or {}).get("at"),
            "last_passed_at": c.get("last_passed_at")}
    return rep
