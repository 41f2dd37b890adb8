"""``kvp-admin fleet status`` (pure part, kvpersist.l2.fleet.status) and the optional fields
of the fleet record it shows (since, health, nvme): backward-compatible decoding of older
records, the same strictness for the new fields as for the old ones, the size bound."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from kvpersist.cli import main
from kvpersist.commands.fleet import format_status
from kvpersist.l2.fleet.records import (
    HEALTH_STATES,
    MAX_COUNT,
    MAX_FIELD_CHARS,
    MAX_RECORD_BYTES,
    MAX_TIME_S,
    MAX_TTL_S,
    RECORD_TTL_S,
    FleetRecord,
    HealthStamp,
    NvmeUse,
    Stored,
    decode_record,
    host_id,
    serde_fingerprint,
)
from kvpersist.l2.fleet.status import SCHEMA, FleetStatus, namespace_status

from .test_cli_startup import HEAVY, loaded_modules, matching

NS = "kvp-" + "a" * 32
KEY_A, KEY_B = os.urandom(32), os.urandom(32)
NOW = 1_800_000_000.0


def rec(host: str = "a", key: bytes | None = KEY_A, at: float = NOW - 60,
        **extra: object) -> FleetRecord:
    hid = host_id(f"host-{host}", "m" * 32, f"/var/lib/kvpersist/{host}")
    r = FleetRecord(namespace=NS, host=f"host-{host}", host_id=hid, deployment="demo",
                    version="0.3.0", serde="aesgcm" if key else "none",
                    serde_key_fingerprint=serde_fingerprint(key) if key else "",
                    updated_at=at)
    return replace(r, **extra)  # type: ignore[arg-type]


FULL = rec(since=NOW - 7200, health=HealthStamp("healthy", NOW - 60),
           nvme=NvmeUse(1234, 5 << 30, NOW - 7200))


# --------------------------------------------------------------------------- the record


def test_a_record_with_the_new_fields_round_trips() -> None:
    doc = json.loads(FULL.encode())
    assert doc["since"] == NOW - 7200
    assert doc["health"] == {"status": "healthy", "at": NOW - 60}
    assert doc["nvme"] == {"files": 1234, "bytes": 5 << 30, "at": NOW - 7200}
    assert decode_record(FULL.key, FULL.encode()) == (FULL, "")


def test_a_record_carries_the_canary_a_health_run_read() -> None:
    """docs/canary.md: fleet status shows a host whose namespace's canary failed; a value
    this kvpersist does not know is dropped, not trusted."""
    failed = replace(FULL, health=HealthStamp("degraded", NOW - 60, "failed"))
    assert json.loads(failed.encode())["health"]["canary"] == "failed"
    assert decode_record(failed.key, failed.encode()) == (failed, "")
    odd = json.loads(failed.encode())
    odd["health"]["canary"] = "great"
    back, why = decode_record(failed.key, json.dumps(odd).encode())
    assert why == "" and back is not None and back.health is not None
    assert back.health.canary is None


def test_an_older_record_without_them_decodes_with_none() -> None:
    old = {"schema": "kvpersist.fleet-record/1", "namespace": NS, "host": "host-a",
           "host_id": rec().host_id, "deployment": "demo", "version": "0.2.0",
           "serde": "aesgcm", "serde_key_fingerprint": "0" * 16, "updated_at": NOW,
           "ttl_s": RECORD_TTL_S}
    got, why = decode_record(rec().key, json.dumps(old))
    assert why == "" and got is not None
    assert (got.since, got.health, got.nvme) == (None, None, None)
    # and what this version writes without them is exactly that older record
    assert set(json.loads(rec().encode())) == set(old)


def test_null_is_absent() -> None:
    doc = {**json.loads(rec().encode()), "since": None, "health": None, "nvme": None}
    assert decode_record(rec().key, json.dumps(doc)) == (rec(), "")


def test_keys_the_new_objects_do_not_know_are_ignored() -> None:
    doc = json.loads(FULL.encode())
    doc["health"]["checks"] = 7
    doc["nvme"]["temp_files"] = 3
    assert decode_record(FULL.key, json.dumps(doc)) == (FULL, "")


def _with(**change: object) -> str:
    return json.dumps({**json.loads(FULL.encode()), **change})


GOOD_HEALTH = {"status": "healthy", "at": NOW}
GOOD_NVME = {"files": 1, "bytes": 2, "at": NOW}

#: hostile values of the new fields: each makes the whole record foreign
HOSTILE: list[tuple[str, str]] = [
    (_with(since="yesterday"), "since is not a number"),
    (_with(since=True), "since is not a number"),
    (_with(since=[NOW]), "since is not a number"),
    (_with(since=-1), "since is not a number"),
    (_with(since=MAX_TIME_S + 1), "since is not a number"),
    (_with(since=10 ** 400), "since is not a number"),
    (_with(health="healthy"), "health is not an object"),
    (_with(health=[GOOD_HEALTH]), "health is not an object"),
    (_with(health={"at": NOW}), "health is not an object"),
    (_with(health={"status": "fine", "at": NOW}), "health is not an object"),
    (_with(health={"status": "healthy" * 40, "at": NOW}), "health is not an object"),
    (_with(health={"status": ["healthy"], "at": NOW}), "health is not an object"),
    (_with(health={"status": "healthy"}), "health is not an object"),
    (_with(health={"status": "healthy", "at": -5}), "health is not an object"),
    (_with(health={"status": "healthy", "at": "now"}), "health is not an object"),
    (_with(health={"status": "healthy", "at": False}), "health is not an object"),
    (_with(health={"status": "healthy", "at": 1e300}), "health is not an object"),
    (_with(nvme=5), "nvme is not an object"),
    (_with(nvme={**GOOD_NVME, "files": -1}), "nvme is not an object"),
    (_with(nvme={**GOOD_NVME, "files": 1.5}), "nvme is not an object"),
    (_with(nvme={**GOOD_NVME, "files": 2.0}), "nvme is not an object"),
    (_with(nvme={**GOOD_NVME, "files": True}), "nvme is not an object"),
    (_with(nvme={**GOOD_NVME, "files": "7"}), "nvme is not an object"),
    (_with(nvme={**GOOD_NVME, "bytes": MAX_COUNT + 1}), "nvme is not an object"),
    (_with(nvme={**GOOD_NVME, "bytes": 10 ** 30}), "nvme is not an object"),
    (_with(nvme={"files": 1, "bytes": 2}), "nvme is not an object"),
    (_with(nvme={**GOOD_NVME, "at": -0.5}), "nvme is not an object"),
    (_with(nvme={**GOOD_NVME, "at": None}), "nvme is not an object"),
    # issue 40: a ttl_s of 400 digits ended fleet status with OverflowError (updated_at + ttl_s)
    (_with(ttl_s=10 ** 400), "ttl_s is not a whole number"),
    (_with(ttl_s=MAX_TTL_S + 1), "ttl_s is not a whole number"),
    (_with(ttl_s=0), "ttl_s is not a whole number"),
    (_with(ttl_s=1290.0), "ttl_s is not a whole number"),
    (_with(updated_at=10 ** 400), "updated_at is not a number"),
    (_with(updated_at=MAX_TIME_S + 1), "updated_at is not a number"),
    (_with(updated_at=-1), "updated_at is not a number"),
]
for _const, _why in (("NaN", "not a number JSON allows"), ("Infinity", "not a number JSON "
                     "allows"), ("-Infinity", "not a number JSON allows"),
                     ("1e309", "out of range")):
    HOSTILE.append((_with(since=12345.5).replace("12345.5", _const), _why))
    HOSTILE.append((_with(health={"status": "down", "at": 12345.5}).replace("12345.5", _const),
                    _why))
    HOSTILE.append((_with(nvme={**GOOD_NVME, "at": 12345.5}).replace("12345.5", _const), _why))
HOSTILE.append((_with(health={"status": "healthy", "at": NOW, "pad": "x" * MAX_RECORD_BYTES}),
                "more than the 4,096"))
HOSTILE.append((_with(health={"status": "healthy", "at": NOW,
                              "deep": json.loads("[" * 70 + "]" * 70)}), "nested"))


@pytest.mark.parametrize(("value", "why"), HOSTILE)
def test_a_hostile_new_field_makes_the_record_foreign(value: str, why: str) -> None:
    got, reason = decode_record(FULL.key, value)
    assert got is None and why in reason and reason.endswith("skipped"), reason
    assert "foreign" in reason
    # and the status of a namespace with such a record is built without an exception
    st = namespace_status(NS, [(FULL.host_id, value)], NOW)
    assert st.live == [] and st.problems and json.dumps(st.to_dict(NOW))


@pytest.mark.parametrize("state", HEALTH_STATES)
def test_every_health_verdict_is_a_status(state: str) -> None:
    r = replace(FULL, health=HealthStamp(state, NOW))
    assert decode_record(r.key, r.encode()) == (r, "")


def test_the_largest_record_this_version_writes_fits_the_bound() -> None:
    """Every text field at its limit, the numbers at theirs: still within MAX_RECORD_BYTES."""
    big = "x" * MAX_FIELD_CHARS
    name = "h" * 63
    r = replace(FULL, host=big, host_id=host_id(name, "m", "/s"), deployment=big,
                version=big, serde=big, serde_key_fingerprint=big, updated_at=MAX_TIME_S,
                ttl_s=MAX_TTL_S, since=float(MAX_TIME_S) - 0.123456789,
                health=HealthStamp("degraded", float(MAX_TIME_S) - 0.123456789),
                nvme=NvmeUse(MAX_COUNT, MAX_COUNT, float(MAX_TIME_S) - 0.123456789))
    assert len(r.encode().encode()) <= MAX_RECORD_BYTES
    assert decode_record(r.key, r.encode()) == (r, "")


# --------------------------------------------------------------------------- the status


def members(*records: FleetRecord, gone: tuple[str, ...] = (),
            raw: tuple[tuple[str, Stored], ...] = ()) -> list[tuple[str, Stored]]:
    out: list[tuple[str, Stored]] = [(r.host_id, r.encode()) for r in records]
    return out + [(g, None) for g in gone] + list(raw)


def test_hosts_with_one_key_agree() -> None:
    st = namespace_status(NS, members(rec("a"), rec("b")), NOW, configured=["demo"])
    assert st.agreement == "agree" and len(st.live) == 2 and st.problems == ()
    doc = st.to_dict(NOW)
    assert [g["hosts"] for g in doc["fingerprints"]] == [sorted([rec("a").host_id,
                                                                 rec("b").host_id])]
    assert FleetStatus({}, (st,), NOW).exit_code == 0


def test_a_host_with_another_key_disagrees_and_exits_1() -> None:
    st = namespace_status(NS, members(rec("a"), rec("b"), rec("c", KEY_B)), NOW)
    assert st.agreement == "disagree"
    doc = FleetStatus({}, (st,), NOW).to_dict()
    assert doc["schema"] == SCHEMA == "kvpersist.fleet-status/1"
    assert doc["exit_code"] == 1 and doc["agree"] is False and doc["disagree"] == [NS]
    fps = {g["serde_key_fingerprint"]: g["hosts"] for g in doc["namespaces"][0]["fingerprints"]}
    assert fps[serde_fingerprint(KEY_B)] == [rec("c").host_id]
    text = json.dumps(doc)
    assert KEY_A.hex() not in text and KEY_B.hex() not in text


def test_another_serde_disagrees_too() -> None:
    st = namespace_status(NS, members(rec("a"), rec("b", None)), NOW)
    assert st.agreement == "disagree"


def test_gone_and_stale_hosts_are_shown_but_never_disagree() -> None:
    stale = rec("s", KEY_B, at=NOW - RECORD_TTL_S - 5)  # the store still returned it
    gone = rec("g").host_id
    st = namespace_status(NS, members(rec("a"), stale, gone=(gone,)), NOW)
    states = {r.host_id: r.state for r in st.rows}
    assert states == {rec("a").host_id: "live", stale.host_id: "stale", gone: "gone"}
    assert st.agreement == "agree"
    rows = {h["host_id"]: h for h in st.to_dict(NOW)["hosts"]}
    assert rows[gone]["deployment"] is None and rows[gone]["state"] == "gone"
    assert rows[stale.host_id]["expires_in_s"] == -5.0
    assert FleetStatus({}, (st,), NOW).exit_code == 0


def test_a_record_just_within_its_ttl_is_live() -> None:
    r = rec("a", at=NOW - RECORD_TTL_S)
    assert namespace_status(NS, members(r), NOW).rows[0].state == "live"


def test_no_live_host_is_none_and_a_foreign_index_unknown() -> None:
    assert namespace_status(NS, members(gone=(rec("g").host_id,)), NOW).agreement == "none"
    st = namespace_status(NS, None, NOW, index_problem="kvpersist-fleet:x holds another type")
    assert st.agreement == "unknown" and st.rows == () and st.problems
    assert FleetStatus({}, (st,), NOW).exit_code == 0


def test_foreign_records_are_problems_bounded_never_rows() -> None:
    bad = [(host_id(f"x{i}", "m", "/s"), "not json") for i in range(25)]
    st = namespace_status(NS, members(rec("a"), raw=tuple(bad)), NOW)
    assert [r.host_id for r in st.rows] == [rec("a").host_id]
    assert len(st.problems) == 11 and st.problems[-1] == "... and 15 more"
    hostile = _with(nvme={**GOOD_NVME, "files": -1})
    st = namespace_status(NS, [(FULL.host_id, hostile)], NOW)
    assert st.rows == () and "nvme is not an object" in st.problems[0]


def test_new_fields_are_shown_with_their_ages() -> None:
    st = namespace_status(NS, members(FULL), NOW, configured=["demo"])
    doc = FleetStatus({"endpoint": "127.0.0.1:6379", "cluster": False}, (st,), NOW).to_dict()
    [h] = doc["namespaces"][0]["hosts"]
    assert h["since"] == NOW - 7200
    assert h["health"] == {"status": "healthy", "at": NOW - 60, "age_s": 60.0, "canary": None}
    assert h["nvme"] == {"files": 1234, "bytes": 5 << 30, "at": NOW - 7200, "age_s": 7200.0}
    text = format_status(doc)
    assert "healthy (60 s ago)" in text and "1,234 files" in text and "(2 h)" in text
    assert f"{NS} (configured here: demo): 1 live host(s), keys agree" in text
    assert serde_fingerprint(KEY_A) in text and "live" in text


def test_the_human_table_names_a_disagreement() -> None:
    st = namespace_status(NS, members(rec("a"), rec("c", KEY_B), gone=(rec("g").host_id,)),
                          NOW)
    text = format_status(FleetStatus({"endpoint": "e:1", "cluster": True}, (st,),
                                     NOW).to_dict())
    assert "KEYS DISAGREE" in text and "problem: the live hosts hold different serde keys" \
        in text
    gone_line = next(x for x in text.splitlines() if x.startswith(rec("g").host_id))
    assert gone_line.rstrip().endswith("gone")


# --------------------------------------------------------------------------- the command


def test_a_bad_namespace_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["fleet", "status", "--namespace", "kvp-nope", "--json"])
    assert exc.value.code == 2
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "kvpersist.error/1" and "--namespace" in doc["error"]


def test_fleet_status_never_imports_lmcache_or_torch() -> None:
    for args in (["fleet", "--help"], ["fleet", "status", "--help"]):
        code, modules = loaded_modules(*args)
        assert code == 0 and matching(modules, HEAVY) == []
    # it runs (no config has a shared tier here: exit 2) without them either
    code, modules = loaded_modules("fleet", "status", "--json")
    assert code == 2 and matching(modules, HEAVY) == []
