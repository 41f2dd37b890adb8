"""Use case: the L1/L2 sizing plan of a deployment (``kvp-admin budget``)."""

from __future__ import annotations

from kvpersist.config.loader import load_deployment
from kvpersist.l2.budget import BudgetPlan
from kvpersist.l2.inventory import size_deployment
from kvpersist.l2.read_path import ReadPath, explain_read_path
from kvpersist.stack.preread import mem_available


def budget(config: str) -> tuple[BudgetPlan, ReadPath]:
    """Load ``config``, measure its root once and plan its budget with the other deployments
    on that root (the inventory decides which); with it, the L2 read path and the launch
    pre-read's byte cap from this host's MemAvailable. The plan's problems are returned, not
    raised (``plan.ok``)."""

    dep = load_deployment(config)
    plan = size_deployment(dep, strict=False).plan
    return plan, explain_read_path(dep, mem_available=mem_available())
