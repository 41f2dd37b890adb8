"""NVMe budget, per-namespace quotas and host-RAM check for one deployment (pure).

Why this exists: stock LMCache's ``nixl_store_dynamic`` adapter keeps a byte counter that starts
at 0 when the server starts. Files already on disk are invisible to it until a lookup
rediscovers them, and a rediscovered file is only *served* if it still fits under
``max_capacity_gb`` (``nixl_store_dynamic_l2_adapter.py``: "Secondary lookup hit ... but capacity
exceeded, skipping"). So the capacity handed to the server must satisfy two things at once:

1. **budget**: in the worst case the server writes ``C`` new bytes while none of its old files are
   touched, so the disk holds ``inactive + own + C`` (plus what other active deployments may
   hold); that must stay within the limit: ``C <= share - own``;
2. **reuse**: a restarted server must be able to rediscover all its earlier files: ``C >= own``.

Both hold while ``own <= share / 2``. The plan uses ``C = share - own`` (the largest value that
keeps the budget) and, when ``own`` has grown past half the share, says how many bytes of the
namespace's least-recently-used files ``kvp-admin prune --to-budget --force`` should remove.
The formula is documented in docs/inventory.md.

Everything here takes values and returns values; nothing reads the disk.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from kvpersist.config.values import GIB, format_size, parse_size_or_percent
from kvpersist.errors import ConfigError, Problem

if TYPE_CHECKING:
    from kvpersist.config.deployment import Deployment

#: The least L2 capacity handed to a server (LMCache refuses 0).
MIN_CAPACITY_BYTES = GIB // 4
#: Host RAM kept for vLLM and the OS when no explicit reserve is given: this fraction of RAM,
#: but at least DEFAULT_RAM_RESERVE_MIN.
DEFAULT_RAM_RESERVE_FRACTION = 0.25
DEFAULT_RAM_RESERVE_MIN = 4 * GIB
#: LMCache's L1 page (``align_bytes``): its nixl adapter registers L1 in pages of this size,
#: and an L1 whose size in bytes is not a whole number of them fails to start.
L1_PAGE_BYTES = 4096
#: ``prune --to-budget`` brings the total on disk down to this fraction of the limit.
DEFAULT_LOW_WATERMARK = 0.5


def resolve_size(spec: str | int | float, whole: int, what: str) -> int:
    """Bytes from ``spec`` (bytes, "500G", or "80%" of ``whole``). Raises ConfigError."""
    if isinstance(spec, bool):
        raise ConfigError(Problem(what, f"not a size: {spec!r}"))
    if isinstance(spec, int | float):
        if spec < 0:
            raise ConfigError(Problem(what, f"must not be negative, got {spec}"))
        return int(spec)
    try:
        size, frac = parse_size_or_percent(spec)
    except ValueError as exc:
        raise ConfigError(Problem(what, str(exc), "use e.g. 80%, 500G or a byte count")) from exc
    if frac is not None:
        return int(whole * frac)
    assert size is not None
    return size


def capacity_gb(nbytes: int) -> float:
    """``max_capacity_gb`` (GiB, as LMCache multiplies by 1024**3) rounded *down* to 0.01."""
    return math.floor(nbytes / GIB * 100) / 100


def l2_limit(*, fs_total_bytes: int, fs_avail_bytes: int, l2_now_bytes: int,
             l2_budget: str | int, l2_reserve: str | int) -> tuple[int, int, int]:
    """(budget, reserve, limit) in bytes: the limit is the budget, lowered so that the reserve
    stays free given what the cache holds now (``l2_now_bytes``) and the free space.
    Raises ConfigError for unparsable size specs."""
    budget_bytes = resolve_size(l2_budget, fs_total_bytes, "l2_budget")
    reserve_bytes = resolve_size(l2_reserve, fs_total_bytes, "l2_reserve")
    fs_room = max(0, l2_now_bytes + fs_avail_bytes - reserve_bytes)
    return budget_bytes, reserve_bytes, min(budget_bytes, fs_room)


@dataclass(frozen=True)
class BudgetPlan:
    """What the server of one deployment may use, and why."""

    namespace: str
    fs_total_bytes: int
    fs_avail_bytes: int
    budget_bytes: int
    reserve_bytes: int
    limit_bytes: int
    on_disk_bytes: int
    own_bytes: int
    inactive_bytes: int
    other_active_bytes: int
    quota_bytes: int | None
    share_bytes: int
    l2_max_capacity_bytes: int
    l2_max_capacity_gb: float
    reusable_bytes: int
    worst_case_bytes: int
    within_budget: bool
    prune_suggested_bytes: int
    low_watermark_bytes: int
    over_low_watermark_bytes: int
    l1_size_gb: float
    l1_max_gb: float
    host_ram_bytes: int
    ram_reserve_bytes: int
    reasons: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    problems: tuple[Problem, ...] = field(default=())

    @property
    def ok(self) -> bool:
        """False when the deployment must not start with this plan (see ``problems``)."""
        return not self.problems

    def raise_for_problems(self) -> None:
        """Raise ConfigError listing every problem, if there are any."""
        if self.problems:
            raise ConfigError(list(self.problems), source=f"budget for {self.namespace}")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (schema ``kvpersist.budget/1``)."""
        d = asdict(self)
        d["problems"] = [str(p) for p in self.problems]
        d["reasons"] = list(self.reasons)
        d["warnings"] = list(self.warnings)
        d["ok"] = self.ok
        return {"schema": "kvpersist.budget/1", **d}


def plan_budget(
    *,
    namespace: str,
    fs_total_bytes: int,
    fs_avail_bytes: int,
    on_disk: Mapping[str, int],
    l1_size_gb: float,
    host_ram_bytes: int,
    temp_bytes: int = 0,
    l2_budget: str | int = "80%",
    l2_reserve: str | int = "5%",
    quota: str | int | None = None,
    other_active: Mapping[str, str | int | None] | None = None,
    other_l1_gb: float = 0.0,
    ram_reserve_bytes: int | None = None,
    low_watermark: float = DEFAULT_LOW_WATERMARK,
) -> BudgetPlan:
    """Plan L1 and the L2 ``max_capacity_gb`` for the deployment whose namespace is ``namespace``.

    Given: the filesystem size and free space (for an unprivileged writer), the bytes each
    file-name prefix holds under the cache root now (``on_disk``; include every prefix, active
    or not) and stale ``temp_bytes``, the configured budget and reserve ("80%" of the
    filesystem, "500G", or bytes), this namespace's optional quota ("%" of the limit, or a
    size), the other active namespaces sharing the root with their quotas (None = an equal
    share of what is not under quota), host RAM, the L1 of other servers on this host, and
    the RAM kept for vLLM and the OS.

    Returns a :class:`BudgetPlan`; its ``problems`` are fatal (an L1 that does not fit in RAM),
    its ``warnings`` are not. Raises ConfigError only for unparsable size specs.
    """
    other_active = dict(other_active or {})
    other_active.pop(namespace, None)
    reasons: list[str] = []
    warnings: list[str] = []
    problems: list[Problem] = []

    l2_now = sum(on_disk.values()) + temp_bytes
    budget_bytes, reserve_bytes, limit = l2_limit(
        fs_total_bytes=fs_total_bytes, fs_avail_bytes=fs_avail_bytes, l2_now_bytes=l2_now,
        l2_budget=l2_budget, l2_reserve=l2_reserve)
    fs_room = max(0, l2_now + fs_avail_bytes - reserve_bytes)
    reasons.append(
        f"budget {format_size(budget_bytes)} (l2_budget={l2_budget} of a "
        f"{format_size(fs_total_bytes)} filesystem)"
    )
    if fs_room < budget_bytes:
        reasons.append(
            f"limit lowered to {format_size(limit)}: the cache holds {format_size(l2_now)}, the "
            f"filesystem has {format_size(fs_avail_bytes)} available and "
            f"{format_size(reserve_bytes)} (l2_reserve={l2_reserve}) must stay free"
        )
        warnings.append(
            f"the filesystem cannot hold the whole budget; the limit is {format_size(limit)}"
        )

    own = int(on_disk.get(namespace, 0))
    active = {namespace, *other_active}
    inactive = sum(b for p, b in on_disk.items() if p not in active) + temp_bytes
    other_active_bytes = sum(int(on_disk.get(p, 0)) for p in other_active)
    pool = max(0, limit - inactive)
    reasons.append(
        f"{format_size(inactive)} belong to no active deployment (stale, unpinned, other "
        f"prefixes, temp files); {format_size(pool)} remain for "
        f"{len(active)} active namespace(s)"
    )

    quota_bytes = None if quota in (None, "") else resolve_size(quota, limit, "l2_quota")
    other_quotas = {
        p: (None if q in (None, "") else resolve_size(q, limit, f"quota of {p}"))
        for p, q in other_active.items()
    }
    quoted = sum(q for q in other_quotas.values() if q is not None)
    unquoted = sum(1 for q in other_quotas.values() if q is None)
    if quota_bytes is not None:
        share = min(quota_bytes, pool)
        quoted += quota_bytes
        reasons.append(f"share = quota {format_size(quota_bytes)}, at most the pool")
    else:
        unquoted += 1
        share = max(0, pool - quoted) // unquoted
        reasons.append(
            f"share = (pool - other quotas {format_size(quoted)}) / {unquoted} "
            f"= {format_size(share)}"
        )
    if quoted > pool:
        warnings.append(
            f"quotas add up to {format_size(quoted)}, more than the {format_size(pool)} pool"
        )

    capacity = share - own
    if capacity < MIN_CAPACITY_BYTES:
        capacity = max(capacity, MIN_CAPACITY_BYTES)
        warnings.append(
            f"namespace {namespace} already holds {format_size(own)} of its "
            f"{format_size(share)} share; the server gets the minimum "
            f"{format_size(capacity)} and the disk may exceed the limit by "
            f"{format_size(max(0, own + capacity - share))} until pruned"
        )
    reasons.append(
        f"max_capacity = share - own = {format_size(share)} - {format_size(own)}: new "
        f"writes cannot push the disk past the share even if no old file is touched"
    )
    reusable = min(own, capacity)
    if own > capacity:
        warnings.append(
            f"only {format_size(reusable)} of the namespace's {format_size(own)} on disk can "
            f"be rediscovered after a restart (LMCache skips lookups past max_capacity)"
        )
    prune_suggested = max(0, own - share // 2)
    if prune_suggested:
        reasons.append(
            f"the namespace is past half its share: prune {format_size(prune_suggested)} of its "
            f"least recently used files (kvp-admin prune --to-budget --force) so that it can "
            f"both reuse all it holds and stay within the budget"
        )
    worst = inactive + other_active_bytes + own + capacity
    low_mark = int(limit * low_watermark)
    over_low = max(0, l2_now - low_mark)

    # ---- L1 in host RAM
    if ram_reserve_bytes is None:
        ram_reserve_bytes = max(
            DEFAULT_RAM_RESERVE_MIN, int(host_ram_bytes * DEFAULT_RAM_RESERVE_FRACTION)
        )
    l1_room = host_ram_bytes - ram_reserve_bytes - int(other_l1_gb * GIB)
    l1_max_gb = max(0.0, math.floor(l1_room / GIB * 100) / 100)
    if l1_size_gb * GIB > l1_room:
        problems.append(
            Problem(
                "l1_size_gb",
                f"L1 of {l1_size_gb:g} GiB does not fit: host RAM {format_size(host_ram_bytes)}"
                f", {format_size(ram_reserve_bytes)} kept for vLLM and the OS, "
                f"{other_l1_gb:g} GiB used by other servers' L1",
                f"set KVP_L1_SIZE_GB to at most {l1_max_gb:g}",
            )
        )
    else:
        reasons.append(f"L1 {l1_size_gb:g} GiB fits (at most {l1_max_gb:g} GiB on this host)")
    l1_bytes = int(l1_size_gb * GIB)  # how LMCache turns --l1-size-gb into bytes
    if l1_bytes % L1_PAGE_BYTES:
        problems.append(
            Problem(
                "l1_size_gb",
                f"L1 of {l1_size_gb:g} GiB is {l1_bytes:,} bytes, not a whole number of "
                f"LMCache's {L1_PAGE_BYTES:,}-byte L1 pages: its NVMe (nixl) adapter fails to "
                "start (NIXL_ERR_NOT_FOUND registering the last, partial page)",
                "set KVP_L1_SIZE_GB to a whole number of MiB (e.g. 0.125 for 128 MiB, 0.5, "
                "or a whole number of GiB)",
            )
        )

    return BudgetPlan(
        namespace=namespace,
        fs_total_bytes=fs_total_bytes,
        fs_avail_bytes=fs_avail_bytes,
        budget_bytes=budget_bytes,
        reserve_bytes=reserve_bytes,
        limit_bytes=limit,
        on_disk_bytes=l2_now,
        own_bytes=own,
        inactive_bytes=inactive,
        other_active_bytes=other_active_bytes,
        quota_bytes=quota_bytes,
        share_bytes=share,
        l2_max_capacity_bytes=capacity,
        l2_max_capacity_gb=max(0.01, capacity_gb(capacity)),
        reusable_bytes=reusable,
        worst_case_bytes=worst,
        within_budget=worst <= limit,
        prune_suggested_bytes=prune_suggested,
        low_watermark_bytes=low_mark,
        over_low_watermark_bytes=over_low,
        l1_size_gb=l1_size_gb,
        l1_max_gb=l1_max_gb,
        host_ram_bytes=host_ram_bytes,
        ram_reserve_bytes=ram_reserve_bytes,
        reasons=tuple(reasons),
        warnings=tuple(warnings),
        problems=tuple(problems),
    )


def plan_for_deployment(
    deployment: Deployment,
    *,
    fs_total_bytes: int,
    fs_avail_bytes: int,
    on_disk: Mapping[str, int],
    host_ram_bytes: int,
    temp_bytes: int = 0,
    others: Sequence[Deployment] = (),
) -> BudgetPlan:
    """:func:`plan_budget` for a loaded Deployment.

    ``others`` are the other deployments sharing this deployment's cache root (the inventory
    layer decides which, comparing real paths): their ``l2_quota`` applies to the shared L2
    pool and their L1 adds to host RAM use.
    """
    s = deployment.settings
    same_root = [o for o in others if o.namespace != deployment.namespace]
    return plan_budget(
        namespace=deployment.namespace,
        fs_total_bytes=fs_total_bytes,
        fs_avail_bytes=fs_avail_bytes,
        on_disk=on_disk,
        temp_bytes=temp_bytes,
        l2_budget=s.l2_budget,
        l2_reserve=s.l2_reserve,
        quota=s.l2_quota or None,
        other_active={o.namespace: o.settings.l2_quota or None for o in same_root},
        l1_size_gb=float(s.l1_size_gb),
        other_l1_gb=sum(float(o.settings.l1_size_gb) for o in same_root),
        host_ram_bytes=host_ram_bytes,
    )
