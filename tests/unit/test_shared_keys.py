"""l2/shared/wire.py and the shared tier's health checks (pure, table-driven)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpersist.l2.fleet.host import decode_all
from kvpersist.l2.fleet.records import WRONG_TYPE, decode_record, record_key
from kvpersist.l2.shared.wire import (
    NOT_A_CHUNK,
    NOT_A_STRING,
    SKIPPED_SHOWN,
    Skipped,
    bounded,
    lock_key,
    match_pattern,
    namespace_of,
    namespace_problem,
    plan_store_budget,
    skipped_lines,
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



def test_a_server_started_without_the_tier_is_degraded_with_a_store_that_answers() -> None:
    """The launcher left the adapter out (lmcache_exec): the store answering later does not
    make the tier ok, the check names the restart."""
    from kvpersist.stack.lmcache_exec import SharedOff

    off = SharedOff(7, 0.0, "resp", "h:1", "Connection refused")
    up = {**BASE, "reachable": True, "auth_ok": True, "latency_ms": 0.3,
          "budget": plan_store_budget([1], [0], ["allkeys-lru"]).to_dict(),
          "off_since_start": {**off.to_dict(), "message": off.message()}}
    _, checks = verdict(Facts(expect_vllm=False, shared_tier=up))
    server = next(c for c in checks if c.name == "shared_tier.server")
    assert server.status == "degraded" and "restart the cache server" in server.detail
    assert next(c for c in checks if c.name == "shared_tier.store").status == "ok"
    assert component_status(checks)["shared_tier"] == "degraded"
    _, checks = verdict(Facts(expect_vllm=False, shared_tier={**up, "off_since_start": None}))
    assert component_status(checks)["shared_tier"] == "ok"


def test_metrics_say_whether_the_cache_server_runs_with_the_tier(tmp_path: Path) -> None:
    """kvpersist_cache_server_shared_tier: 0 with the launcher's record, 1 without, absent
    without a shared tier or a serving cache server (KvpersistCacheServerWithoutSharedTier)."""
    from kvpersist.actions.metrics import Exposition, health_families
    from kvpersist.config.loader import load_deployment
    from kvpersist.stack.health import HealthReport
    from kvpersist.stack.locate import locate

    loc = locate(load_deployment("cpu-demo", {"KVP_CACHE_ROOT": str(tmp_path / "c")},
                                 allow_unpinned=True))
    up = {**BASE, "reachable": True, "auth_ok": True, "off_since_start": None}

    def gauge(shared: dict[str, object] | None, serving: bool = True) -> list[float]:
        f = Facts(expect_vllm=False, shared_tier=shared, server_healthcheck=serving)
        status, checks = verdict(f)
        exp = Exposition()
        health_families(exp, HealthReport("cpu-demo", NS, status, tuple(checks), f, loc), 0.0)
        return [x.value for fam in exp.families.values() for x in fam.samples
                if x.name == "kvpersist_cache_server_shared_tier"]

    assert gauge(up) == [1]
    assert gauge({**up, "off_since_start": {"pid": 7, "message": "m"}}) == [0]
    assert gauge(None) == [] and gauge(up, serving=False) == []

# --------------------------------------------------------------------------- foreign keys
def test_skipped_keys_are_counted_per_kind_the_first_few_named_as_they_are() -> None:
    """The document names the keys as the store holds them (issue 40: --json is lossless);
    the text lines escape them."""
    sk = Skipped()
    for i in range(SKIPPED_SHOWN + 5):
        sk.add(NOT_A_STRING, f"{NS}@01000100@0@{i:x}@salt\n\x1b[2J\udcff")
    sk.add(NOT_A_CHUNK, f"{NS}@junk")
    doc = sk.to_dict()
    assert doc["count"] == SKIPPED_SHOWN + 6
    shown = doc["kinds"][NOT_A_STRING]
    assert shown["count"] == SKIPPED_SHOWN + 5 and len(shown["first"]) == SKIPPED_SHOWN
    assert all(n.endswith("salt\n\x1b[2J\udcff") for n in shown["first"])
    lines = skipped_lines(doc)
    assert all(line.isprintable() for line in lines) and "salt\\x0a" in lines[0]
    assert len(lines) == 2 and "and 5 more" in lines[0] and lines[1].startswith("1 keys")
    assert skipped_lines({}) == [] and Skipped().to_dict() == {"count": 0, "kinds": {}}


def test_bounded_lists_name_the_first_and_count_the_rest() -> None:
    assert bounded(["a", "b"]) == ["a", "b"]
    assert bounded([str(i) for i in range(25)], 3) == ["0", "1", "2", "... and 22 more"]


def test_a_fleet_record_of_another_type_is_a_problem_not_a_record() -> None:
    key = record_key(NS, "host-0123abcd")
    rec, why = decode_record(key, WRONG_TYPE)
    assert rec is None and "not a string" in why
    assert decode_record(key + "\n\x1b", b"{}")[1].startswith(f"{key}\\x0a\\x1b")
    assert "more than the 4,096" in decode_record(key, b"[" * 100_000)[1]  # not parsed
    deep = decode_record(key, b"[" * 2000 + b"]" * 2000)[1]  # no RecursionError
    assert "nested deeper than the 64 levels" in deep and deep.endswith("skipped"), deep
    records, problems = decode_all([(key, WRONG_TYPE)] * 30 + [(key, None)])
    assert records == [] and len(problems) == 11 and problems[-1] == "... and 20 more"
