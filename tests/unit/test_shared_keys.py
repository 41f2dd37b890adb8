"""l2/shared_keys.py and the shared tier's health checks (pure, table-driven)."""

from __future__ import annotations

import pytest

from kvpersist.l2.shared_keys import (
    lock_key,
    match_pattern,
    namespace_of,
    namespace_problem,
    plan_store_budget,
)
from kvpersist.stack.health import Facts, component_status, shared_checks, verdict

NS = "kvp-" + "a" * 32


@pytest.mark.parametrize(("key", "ns"), [
    (f"{NS}@01000100@0@" + "f" * 64, NS),
    (f"{NS}@02010201@1a@abcd@salt@x", NS),
    ("kvp-unpinned-" + "1" * 32 + "@01000100@0@ab", "kvp-unpinned-" + "1" * 32),
    ("test-model@01000100@0@ab", None),
    (f"{NS}_01000100_0_ab", None),
    (lock_key(NS), None),
    (f"{NS}@zz@0@ab", None),
])
def test_namespace_of_wire_keys(key: str, ns: str | None) -> None:
    assert namespace_of(key) == ns


def test_prune_pattern_is_one_namespace() -> None:
    assert match_pattern(NS) == f"{NS}@*"
    assert namespace_problem(NS) == ""
    for bad in ("kvp-*", "kvp-a?", "*", "kvp-AB", "x" + NS):
        assert namespace_problem(bad)


def test_store_budget_refuses_noeviction_and_warns_unlimited() -> None:
    ok = plan_store_budget([1 << 30] * 3, [5] * 3, ["allkeys-lru"] * 3)
    assert ok.problems == () and ok.warnings == () and ok.maxmemory_bytes == 3 << 30
    assert ok.nodes == 3
    for policy in ("noeviction", "volatile-lru", "volatile-ttl"):
        assert "allkeys-lru" in plan_store_budget([1], [0], [policy]).problems[0]
    assert plan_store_budget([0], [0], ["allkeys-lfu"]).warnings


BASE = {"endpoint": "h:1", "adapter": "resp"}


@pytest.mark.parametrize(("probe", "status"), [
    ({"reachable": False, "auth_ok": False, "error": "refused"}, "degraded"),
    ({"reachable": True, "auth_ok": False, "error": "WRONGPASS"}, "degraded"),
    ({"reachable": True, "auth_ok": True, "latency_ms": 0.3,
      "budget": plan_store_budget([1], [0], ["noeviction"]).to_dict()}, "degraded"),
    ({"reachable": True, "auth_ok": True, "latency_ms": 0.3,
      "budget": plan_store_budget([1], [0], ["allkeys-lru"]).to_dict()}, "ok"),
])
def test_shared_tier_is_degraded_never_down(probe: dict[str, object], status: str) -> None:
    checks = shared_checks({**BASE, **probe})
    assert component_status(checks) == {"shared_tier": status}
    assert all(c.status in ("ok", "degraded") for c in checks)
    f = Facts(expect_vllm=False, shared_tier={**BASE, **probe})
    overall, all_checks = verdict(f)
    assert any(c.name.startswith("shared_tier.") for c in all_checks)
    assert "shared_tier" in component_status(all_checks)
    assert overall == "down"  # the cache server itself is down in these facts, not the tier
