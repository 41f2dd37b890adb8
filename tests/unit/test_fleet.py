"""Fleet records (kvpersist.l2.fleet.records), the health check on them and prune's active rule
(pure, table-driven and property-based)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import replace
from fnmatch import fnmatchcase

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpersist.actions.shared import active_reasons
from kvpersist.l2.fleet.records import (
    ALL_PATTERN,
    RECORD_TTL_S,
    WRONG_TYPE,
    FleetRecord,
    Oversized,
    Stored,
    by_namespace,
    decode_record,
    describe_hosts,
    format_age,
    host_id,
    index_key,
    is_fleet_key,
    is_record_key,
    key_conflicts,
    match_pattern,
    parse_record_key,
    record_key,
    record_ttl,
    serde_fingerprint,
)
from kvpersist.l2.keys import store as keys
from kvpersist.l2.shared.wire import lock_key, namespace_of
from kvpersist.l2.shared.wire import match_pattern as chunk_pattern
from kvpersist.stack.health import component_status, fleet_check, shared_checks

NS = "kvp-" + "a" * 32
NS2 = "kvp-unpinned-" + "b" * 32
KEY_A, KEY_B = os.urandom(32), os.urandom(32)


def rec(host: str = "a", key: bytes | None = KEY_A, ns: str = NS, at: float = 1000.0,
        serde: str = "aesgcm") -> FleetRecord:
    hid = host_id(f"host-{host}", "m" * 32, f"/var/lib/kvpersist/{host}")
    return FleetRecord(namespace=ns, host=f"host-{host}", host_id=hid, deployment="demo",
                       version="0.2.0", serde=serde,
                       serde_key_fingerprint=serde_fingerprint(key) if key else "",
                       updated_at=at)


# --------------------------------------------------------------------------- fingerprint


def test_fingerprint_is_the_keyed_hmac_and_never_the_key_or_a_plain_hash() -> None:
    fp = serde_fingerprint(KEY_A)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert fp == serde_fingerprint(bytes(KEY_A))  # deterministic
    assert fp != serde_fingerprint(KEY_B)
    assert fp not in KEY_A.hex()
    assert fp not in (hashlib.sha256(KEY_A).hexdigest(), keys.fingerprint(KEY_A))
    assert not hashlib.sha256(KEY_A).hexdigest().startswith(fp)
    with pytest.raises(ValueError):
        serde_fingerprint(b"")


@given(st.binary(min_size=16, max_size=64), st.binary(min_size=16, max_size=64))
def test_fingerprints_are_equal_exactly_for_equal_keys(a: bytes, b: bytes) -> None:
    assert (serde_fingerprint(a) == serde_fingerprint(b)) == (a == b)


# --------------------------------------------------------------------------- TTL


def test_ttl_covers_missed_refreshes_of_the_health_timer() -> None:
    assert record_ttl(300, 30, 300, 3) == 3 * 330 + 300 == RECORD_TTL_S
    assert record_ttl(60, 0, 0, 1) == 60
    # a record outlives the longest gap between two refreshes (a run, then period + jitter)
    assert RECORD_TTL_S > 300 + 30 + 300
    for bad in ((-1, 0, 0, 1), (1, 0, 0, 0)):
        with pytest.raises(ValueError):
            record_ttl(*bad)


@given(st.integers(0, 10_000), st.integers(0, 600), st.integers(0, 3600), st.integers(1, 9))
def test_ttl_grows_with_every_input(period: int, jitter: int, run: int, misses: int) -> None:
    base = record_ttl(period, jitter, run, misses)
    assert record_ttl(period + 1, jitter, run, misses) > base
    assert record_ttl(period, jitter, run, misses + 1) >= base
    assert base >= misses * period


# --------------------------------------------------------------------------- keys


def test_record_keys_are_never_chunk_keys() -> None:
    r = rec()
    assert r.key == record_key(NS, r.host_id) == f"kvpersist-fleet:{NS}:{r.host_id}"
    assert is_record_key(r.key) and not is_record_key(lock_key(NS))
    assert parse_record_key(r.key) == (NS, r.host_id)
    assert index_key(NS) == f"kvpersist-fleet:{NS}"
    assert not is_record_key(index_key(NS)) and is_fleet_key(index_key(NS))
    for bad in (f"kvpersist-fleet:{NS}:x:y", f"kvpersist-fleet:kvp-zz:{r.host_id}",
                f"kvpersist-lock:prune:{NS}", f"{NS}@01000100@0@ab"):
        assert parse_record_key(bad) is None and not is_record_key(bad)
    assert namespace_of(r.key) is None and namespace_of(index_key(NS)) is None
    for ns in (NS, NS2):
        chunk = f"{ns}@01000100@0@ab"
        assert fnmatchcase(chunk, chunk_pattern(ns))
        assert not fnmatchcase(record_key(ns, r.host_id), chunk_pattern(ns))
        assert fnmatchcase(record_key(ns, r.host_id), match_pattern(ns))
        assert not fnmatchcase(chunk, match_pattern(ns))
        assert not fnmatchcase(chunk, ALL_PATTERN)
        assert not fnmatchcase(index_key(ns), chunk_pattern(ns))
        assert not fnmatchcase(index_key(ns), match_pattern(ns))
    assert not fnmatchcase(record_key(NS2, r.host_id), match_pattern(NS))


def test_host_ids_separate_deployments_and_sanitize_names() -> None:
    a = host_id("gpu-01.example", "m1", "/var/lib/kvpersist/x")
    assert a.startswith("gpu-01.example-") and len(a.rsplit("-", 1)[1]) == 8
    assert a == host_id("gpu-01.example", "m1", "/var/lib/kvpersist/x")
    assert a != host_id("gpu-01.example", "m1", "/var/lib/kvpersist/y")
    assert a != host_id("gpu-01.example", "m2", "/var/lib/kvpersist/x")
    odd = host_id("we:ird/na me*", "", "/s")
    assert odd.startswith("we-ird-na-me-") and ":" not in odd and "*" not in odd
    assert host_id("", "", "/s").startswith("host-")
    assert len(host_id("h" * 300, "", "/s")) == 63 + 9


# --------------------------------------------------------------------------- encode/decode


def test_records_round_trip() -> None:
    r = rec()
    doc = json.loads(r.encode())
    assert doc["schema"] == "kvpersist.fleet-record/1" and doc["ttl_s"] == RECORD_TTL_S
    assert set(doc) == {"schema", "namespace", "host", "host_id", "deployment", "version",
                        "serde", "serde_key_fingerprint", "updated_at", "ttl_s"}
    assert KEY_A.hex() not in r.encode()
    assert decode_record(r.key, r.encode()) == (r, "")
    assert decode_record(r.key, r.encode().encode()) == (r, "")


def _with(r: FleetRecord, **change: object) -> str:
    return json.dumps({**r.to_dict(), **change})


def _without(r: FleetRecord, field: str) -> str:
    return json.dumps({k: v for k, v in r.to_dict().items() if k != field})


#: (value as stored, what the reason says): every one is foreign, none is guessed at
BAD_RECORDS: list[tuple[Stored, str]] = [
    (None, "gone"), ("not json", "not valid JSON"), ("[1]", "not a kvpersist.fleet-record/1"),
    (b"\xff\xfe", "not UTF-8"), (WRONG_TYPE, "not a string"),
    (Oversized(100 << 20), "104,857,600 bytes, more than the 4,096"),
    ("x" * 4097, "4,097 bytes"),
    ("[" * 2000 + "]" * 2000, "nested deeper than the 64 levels"),
    ('{"a":' * 65 + "1" + "}" * 65, "nested 65 levels deep"),
    (_with(rec(), schema="kvpersist.fleet-record/0"), "not a kvpersist.fleet-record/1"),
    (_with(rec(), host=7), "host is a number, not text"),
    (_with(rec(), host=["h"]), "host is an array, not text"),
    (_with(rec(), deployment={"a": 1}), "deployment is an object, not text"),
    (_with(rec(), serde=None), "serde is missing, not text"),
    (_without(rec(), "version"), "version is missing, not text"),
    (_with(rec(), host="gpu\x1b[2J"), "host is not printable text"),
    (_with(rec(), deployment="d" * 257), "deployment is not printable text"),
    (_with(rec(), updated_at=True), "updated_at is not a number"),
    (_with(rec(), updated_at="now"), "updated_at is not a number"),
    (_with(rec(), updated_at=-1), "updated_at is not a number"),
    (_with(rec(), ttl_s=1.5), "ttl_s is not a whole number"),
    (_with(rec(), ttl_s=0), "ttl_s is not a whole number"),
    (_with(rec(), ttl_s=False), "ttl_s is not a whole number"),
    (_without(rec(), "ttl_s"), "ttl_s is not a whole number"),  # never the default
    (_with(rec(), namespace=NS2), "names another key"),
    (_with(rec(), host_id="x:y"), "bad namespace or host id"),
]
for _const in ("NaN", "Infinity", "-Infinity", "1e309"):
    BAD_RECORDS.append((_with(rec(), updated_at=12345).replace("12345", _const),
                        "not a number JSON allows" if "e" not in _const else "out of range"))


@pytest.mark.parametrize(("value", "why"), BAD_RECORDS)
def test_bad_records_are_foreign_with_a_reason(value: Stored, why: str) -> None:
    got, reason = decode_record(rec().key, value)
    assert got is None and reason.startswith(rec().key) and why in reason, reason
    if value is not None:
        assert reason.endswith("skipped") and "foreign" in reason


def test_fields_a_newer_version_adds_are_ignored() -> None:
    r = rec()
    assert decode_record(r.key, _with(r, zone="eu-1")) == (r, "")
    assert decode_record(r.key, _with(r, updated_at=7)) == (replace(r, updated_at=7.0), "")


def test_a_record_under_a_wrong_key_is_not_trusted() -> None:
    r = rec()
    got, why = decode_record(record_key(NS, rec("b").host_id), r.encode())
    assert got is None and "another key" in why


# --------------------------------------------------------------------------- comparisons


def test_key_conflicts_are_other_hosts_of_the_namespace_with_another_key() -> None:
    own = rec("a")
    same, other, elsewhere = rec("b"), rec("c", KEY_B), rec("d", KEY_B, ns=NS2)
    plain = rec("e", None, serde="none")
    assert key_conflicts(own, [own, same, other, elsewhere, plain]) == [other, plain]
    assert key_conflicts(own, [rec("a", KEY_B)]) == []  # its own (older) record
    assert own.same_key(same) and not own.same_key(other)
    grouped = by_namespace([other, elsewhere, own, same])
    assert list(grouped) == [NS, NS2] and grouped[NS] == sorted([own, same, other],
                                                                key=lambda r: r.host_id)


def test_ages_are_told_in_plain_units() -> None:
    assert [format_age(s) for s in (0, 59.9, 119, 120, 7199, 7200)] == [
        "0 s", "59 s", "119 s", "2 min", "119 min", "2 h"]
    r = rec(at=1000.0)
    assert r.age_s(1300.0) == 300.0 and r.age_s(900.0) == 0.0  # a clock ahead: 0
    assert describe_hosts([r], 1300.0) == (f"{r.host_id} (deployment demo, refreshed "
                                           "5 min ago)")


def _facts(own: FleetRecord, others: list[FleetRecord], now: float = 1060.0) -> dict[str, object]:
    from kvpersist.l2.fleet.records import host_rows

    return {"host_id": own.host_id, "record_key": own.key, "serde": own.serde,
            "serde_key_fingerprint": own.serde_key_fingerprint,
            "others": host_rows(others, now),
            "conflicts": host_rows(key_conflicts(own, others), now), "problems": [],
            "error": ""}


def test_health_fleet_check() -> None:
    own, same, other = rec("a"), rec("b"), rec("c", KEY_B)
    alone = fleet_check(_facts(own, []))
    assert alone.status == "ok" and "no other host" in alone.detail
    equal = fleet_check(_facts(own, [same]))
    assert equal.status == "ok" and same.host_id in equal.detail
    bad = fleet_check(_facts(own, [same, other]))
    assert bad.status == "degraded" and bad.name == "shared_tier.serde_key"
    assert bad.detail.startswith(f"serde key differs from host {other.host_id}: chunks "
                                 f"stored by {other.host_id} miss here and vice versa")
    assert same.host_id not in bad.detail
    plain = fleet_check(_facts(own, [rec("e", None, serde="none")]))
    assert plain.status == "degraded" and "serde (aesgcm here, none there)" in plain.detail
    skipped = fleet_check({"error": "store gone"})
    assert skipped.status == "skipped" and "store gone" in skipped.detail


def test_the_fleet_check_belongs_to_the_shared_tier_component() -> None:
    shared = {"endpoint": "127.0.0.1:6379", "reachable": True, "auth_ok": True,
              "latency_ms": 0.3, "budget": {"maxmemory_bytes": 1, "eviction_policies":
                                            ["allkeys-lru"], "problems": [], "warnings": []},
              "fleet": _facts(rec("a"), [rec("c", KEY_B)])}
    checks = shared_checks(shared)
    assert [c.name for c in checks] == ["shared_tier.store", "shared_tier.budget",
                                        "shared_tier.serde_key"]
    assert component_status(checks) == {"shared_tier": "degraded"}
    del shared["fleet"]  # store not asked (unreachable): no fleet check
    assert [c.name for c in shared_checks(shared)] == ["shared_tier.store",
                                                       "shared_tier.budget"]


def test_prune_names_the_hosts_that_make_a_namespace_active() -> None:
    users = {NS: [rec("b", at=940.0), rec("c", at=1000.0)], NS2: []}
    got = active_reasons([NS, NS2], frozenset(), users, now=1000.0)
    assert got == [f"{NS} is active (2 host(s) serve it: {rec('b').host_id} (deployment "
                   f"demo, refreshed 60 s ago), {rec('c').host_id} (deployment demo, "
                   "refreshed 0 s ago))"]
    both = active_reasons([NS2], frozenset({NS2}), {NS2: [rec("b", ns=NS2)]}, now=1000.0)
    assert both[0].startswith(f"{NS2} is active (a deployment configured here uses it; "
                              "1 host(s) serve it: ")
    assert active_reasons([NS2], frozenset(), users, now=1000.0) == []


@pytest.mark.parametrize(("env", "deliberate", "clean"), [
    ({"SERVICE_RESULT": "success", "EXIT_CODE": "exited", "EXIT_STATUS": "0"}, True, True),
    # systemctl stop: SIGTERM ended the server (systemd counts SIGTERM as clean)
    ({"SERVICE_RESULT": "success", "EXIT_CODE": "killed", "EXIT_STATUS": "TERM"}, True, False),
    ({"SERVICE_RESULT": "signal", "EXIT_CODE": "killed", "EXIT_STATUS": "KILL"}, False, False),
    ({"SERVICE_RESULT": "exit-code", "EXIT_CODE": "exited", "EXIT_STATUS": "1"}, False, False),
    ({"SERVICE_RESULT": "timeout"}, False, False),
    ({}, False, False),
])
def test_a_deliberate_systemd_stop_withdraws_the_record(env: dict[str, str], deliberate: bool,
                                                        clean: bool) -> None:
    from kvpersist.stack.stops import systemd_stop_was_clean, systemd_stop_was_deliberate

    assert systemd_stop_was_deliberate(env) is deliberate
    assert systemd_stop_was_clean(env) is clean
