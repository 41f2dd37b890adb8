"""Glue between a deployment and its budget plan: gathers the facts (I/O), plans (pure).

Render and launch size LMCache's L1 and the L2 ``max_capacity_gb`` from what this returns.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpersist.fsio import fs_usage
from kvpersist.settings import Deployment
from kvpersist.units import GIB, parse_size_or_percent


@dataclass(frozen=True)
class Sizing:
    """The two figures render needs, and why."""

    l1_size_gb: float
    l2_capacity_gb: float
    reasons: tuple[str, ...]


def sizing_for(dep: Deployment) -> Sizing:
    """L1 size and L2 capacity for ``dep`` from the filesystem that holds its cache root."""
    fs_size, _free = fs_usage(dep.cache_root)
    budget_bytes, budget_pct = parse_size_or_percent(dep.settings.l2_budget)
    budget = budget_bytes if budget_bytes is not None else int(fs_size * (budget_pct or 0))
    cap = budget / GIB
    return Sizing(dep.settings.l1_size_gb, cap,
                  (f"L2 budget {dep.settings.l2_budget} of the filesystem = {cap:.3f} GiB",))
