"""Use case: the L1/L2 sizing plan of a deployment (``kvp-admin budget``)."""

from __future__ import annotations

from kvpersist.l2.budget import BudgetPlan
from kvpersist.l2.inventory import size_deployment


def budget(config: str) -> BudgetPlan:
    """Load ``config``, measure its root once and plan its budget with the other deployments
    on that root (the inventory decides which). The plan's problems are returned, not
    raised (``plan.ok``)."""
    from kvpersist.config.loader import load_deployment

    dep = load_deployment(config)
    return size_deployment(dep, strict=False).plan
