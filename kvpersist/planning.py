"""Glue between a deployment and its budget plan, for render and launch.

Measures the cache root and host RAM (the I/O in :func:`kvpersist.scan.measure_and_plan`),
plans with the pure :mod:`kvpersist.budget`, and hands render the two figures it needs:
LMCache's L1 size and the L2 adapter's ``max_capacity_gb``. A plan with problems (an L1 that
does not fit in RAM, no room left under the budget) stops render and launch with exit 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpersist.settings import Deployment


@dataclass(frozen=True)
class Sizing:
    """The two figures render needs, and the plan they come from."""

    l1_size_gb: float
    l2_capacity_gb: float
    reasons: tuple[str, ...]
    plan: Any = None


def sizing_for(dep: Deployment) -> Sizing:
    """L1 size and L2 capacity for ``dep`` from what is really on its filesystem."""
    from kvpersist.scan import measure_and_plan

    plan = measure_and_plan(dep, others=_other_deployments(dep))
    plan.raise_for_problems()
    return Sizing(plan.l1_size_gb, plan.l2_max_capacity_gb, tuple(plan.reasons), plan)


def _other_deployments(dep: Deployment) -> tuple[Any, ...]:
    """Other shipped/installed deployments that share this cache root (for quotas)."""
    from kvpersist.scan import resolve_inventory

    try:
        inv = resolve_inventory(str(dep.cache_root))
    except Exception:  # other configs are context only; a broken one must not block this one
        return ()
    return tuple(d for d in inv.deployments if d.namespace != dep.namespace)
