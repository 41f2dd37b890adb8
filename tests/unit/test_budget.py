"""Budget plan: L2 max_capacity from what is really on disk, L1 vs host RAM (pure)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpersist.errors import ConfigError
from kvpersist.l2.budget import (
    MIN_CAPACITY_BYTES,
    BudgetPlan,
    capacity_gb,
    plan_budget,
    resolve_size,
)

GIB = 1024**3
NS = "kvp-" + "a" * 32
OLD = "kvp-" + "b" * 32
TB = 1024 * GIB


def plan(**kw: Any) -> BudgetPlan:
    args: dict[str, Any] = dict(namespace=NS, fs_total_bytes=TB, fs_avail_bytes=TB // 2, on_disk={},
                l1_size_gb=8, host_ram_bytes=64 * GIB, l2_budget="100G", l2_reserve="5%")
    args.update(kw)
    return plan_budget(**args)


def test_empty_cache_gets_the_whole_budget() -> None:
    p = plan()
    assert p.limit_bytes == 100 * GIB
    assert p.l2_max_capacity_bytes == 100 * GIB
    assert p.l2_max_capacity_gb == 100.0
    assert p.within_budget and p.ok and not p.warnings


def test_own_files_reduce_capacity_but_stay_reusable() -> None:
    p = plan(on_disk={NS: 30 * GIB})
    assert p.l2_max_capacity_bytes == 70 * GIB      # share - own
    assert p.reusable_bytes == 30 * GIB             # all earlier files can be rediscovered
    assert p.worst_case_bytes == 100 * GIB and p.within_budget
    assert p.prune_suggested_bytes == 0


def test_stale_namespaces_and_temp_count_against_the_budget() -> None:
    p = plan(on_disk={NS: 10 * GIB, OLD: 40 * GIB, "test-model": 5 * GIB}, temp_bytes=GIB)
    assert p.inactive_bytes == 46 * GIB
    assert p.share_bytes == 54 * GIB
    assert p.l2_max_capacity_bytes == 44 * GIB
    assert p.worst_case_bytes <= p.limit_bytes


def test_own_past_half_share_suggests_a_prune() -> None:
    p = plan(on_disk={NS: 80 * GIB})
    assert p.l2_max_capacity_bytes == 20 * GIB
    assert p.reusable_bytes == 20 * GIB
    assert p.prune_suggested_bytes == 30 * GIB
    assert any("rediscovered" in w for w in p.warnings)
    assert p.within_budget


def test_over_budget_gets_minimum_capacity_and_says_so() -> None:
    p = plan(on_disk={NS: 120 * GIB})
    assert p.l2_max_capacity_bytes == MIN_CAPACITY_BYTES
    assert not p.within_budget
    assert p.over_low_watermark_bytes == 70 * GIB
    assert p.ok  # not fatal: the server still runs, it just caches little


def test_filesystem_room_and_reserve_lower_the_limit() -> None:
    p = plan(fs_avail_bytes=60 * GIB, l2_reserve="20G", on_disk={NS: 10 * GIB})
    assert p.limit_bytes == 50 * GIB  # 10 on disk + 60 free - 20 reserve
    assert any("cannot hold the whole budget" in w for w in p.warnings)


def test_percent_budget() -> None:
    p = plan(l2_budget="50%", l2_reserve=0)
    assert p.budget_bytes == TB // 2


def test_quotas_split_a_shared_root() -> None:
    other = "kvp-" + "c" * 32
    p = plan(on_disk={NS: 0, other: 10 * GIB}, quota="30G", other_active={other: None})
    assert p.share_bytes == 30 * GIB
    q = plan(on_disk={NS: 0, other: 10 * GIB}, other_active={other: "40%"})
    assert q.share_bytes == 60 * GIB
    r = plan(on_disk={}, other_active={other: None})
    assert r.share_bytes == 50 * GIB
    s = plan(quota="80G", other_active={other: "50G"})
    assert any("quotas add up" in w for w in s.warnings)


def test_l1_that_does_not_fit_is_refused() -> None:
    p = plan(l1_size_gb=64, host_ram_bytes=64 * GIB)
    assert not p.ok
    assert p.problems[0].where == "l1_size_gb"
    assert "at most 48" in str(p.problems[0])
    with pytest.raises(ConfigError):
        p.raise_for_problems()
    assert not plan(l1_size_gb=20, host_ram_bytes=64 * GIB, other_l1_gb=30).ok


def test_bad_specs_raise_config_error() -> None:
    with pytest.raises(ConfigError):
        plan(l2_budget="lots")
    with pytest.raises(ConfigError):
        resolve_size(-1, 10, "x")


def test_capacity_rounds_down() -> None:
    assert capacity_gb(int(1.999 * GIB)) == 1.99
    assert plan(on_disk={NS: 1}).l2_max_capacity_gb <= 100.0


def test_plan_is_json_ready() -> None:
    import json

    d = plan(on_disk={NS: GIB}).to_dict()
    assert d["schema"] == "kvpersist.budget/1"
    json.dumps(d)


@given(own=st.integers(0, 200 * GIB), stale=st.integers(0, 200 * GIB),
       budget=st.integers(1 * GIB, 500 * GIB), avail=st.integers(0, TB))
def test_budget_invariants(own: int, stale: int, budget: int, avail: int) -> None:
    p = plan(on_disk={NS: own, OLD: stale}, l2_budget=budget, fs_avail_bytes=avail,
             l2_reserve=0)
    assert p.l2_max_capacity_bytes >= MIN_CAPACITY_BYTES
    # the guarantee: unless the plan says otherwise, the worst case fits the limit
    if p.within_budget:
        assert stale + own + p.l2_max_capacity_bytes <= p.limit_bytes
    else:
        assert p.warnings
    # reuse: while the namespace holds at most half its share, all of it is reusable
    if own <= p.share_bytes // 2 and p.l2_max_capacity_bytes > MIN_CAPACITY_BYTES:
        assert p.reusable_bytes == own


@pytest.mark.parametrize(("gb", "ok"), [(0.1, False), (0.05, False), (0.3, False),
                                        (0.125, True), (0.25, True), (1.5, True), (8, True)])
def test_an_l1_that_is_not_a_whole_number_of_lmcache_pages_is_refused(gb: float,
                                                                      ok: bool) -> None:
    """Found by the soak: ``KVP_L1_SIZE_GB=0.1`` is 107,374,182 bytes; LMCache registers L1
    with nixl in 4 KiB pages and its NVMe adapter then fails to start (NIXL_ERR_NOT_FOUND).
    The plan refuses it, naming the key, before anything starts."""
    p = plan(l1_size_gb=gb)
    bad = [x for x in p.problems if x.where == "l1_size_gb" and "4,096-byte" in x.message]
    assert (not bad) is ok, p.problems
    if not ok:
        assert "whole number of MiB" in bad[0].fix
