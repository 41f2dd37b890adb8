"""The canary's pure parts: the verdict, the path, the prompt, the answer's parsing, the
record's format and bounds, health's check, the settings, and rendering without the cache
connector (docs/canary.md)."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from kvpersist.config.deployment import build_deployment
from kvpersist.config.generic import GenericConfig
from kvpersist.deploy import hook
from kvpersist.errors import ConfigError
from kvpersist.stack.canary import prompt, record, verdict
from kvpersist.stack.canary.probe import ProbeError, steps_of
from kvpersist.stack.canary.verdict import (
    FAILED,
    PASSED,
    UNKNOWN,
    Step,
    canary_health,
    compare,
    served_path,
    tolerance_for,
)
from kvpersist.stack.render import TEMPLATE_NAMES, render
from kvpersist.system.untrusted import UnreadableFile

from ..conftest import REPO
from .test_identity import BASE
from .test_settings import DEPLOY

TEMPLATES = {n: (REPO / "templates" / n).read_text() for n in TEMPLATE_NAMES}
NS = "kvp-0123456789abcdef0123456789abcdef"


def steps(*tops: dict[int, float]) -> tuple[Step, ...]:
    return tuple(Step(max(t, key=lambda k: t[k]), t) for t in tops)


REF = steps({1: -0.1, 2: -2.5, 3: -4.0}, {7: -0.5, 8: -1.5, 9: -3.0})


# ------------------------------------------------------------------------- verdict


def test_identical_steps_pass_with_zero_difference() -> None:
    v = compare(REF, REF, 1e-3)
    assert (v.state, v.max_diff, v.compared, v.mismatch_step) == (PASSED, 0.0, 2, None)


def test_a_difference_within_the_tolerance_passes_and_is_reported() -> None:
    obs = steps({1: -0.12, 2: -2.49, 3: -4.0}, {7: -0.5, 8: -1.5, 9: -3.0})
    v = compare(REF, obs, 0.05)
    assert v.state == PASSED and v.max_diff == pytest.approx(0.02)


def test_a_difference_past_the_tolerance_fails_naming_the_step() -> None:
    obs = steps({1: -0.1, 2: -2.5, 3: -4.0}, {7: -0.9, 8: -1.2, 9: -3.0})
    v = compare(REF, obs, 0.15)
    assert v.state == FAILED and v.mismatch_step is None and v.compared == 2
    assert "step 1" in v.why and "0.4" in v.why


def test_other_kv_fails_when_the_reference_token_is_not_served_at_all() -> None:
    """Wrong KV (another chunk's) in the measurement gave top lists with no token in
    common with the reference: the reference's token is absent, the difference infinite."""
    obs = steps({40: -0.2, 41: -1.0}, {7: -0.5})
    v = compare(REF, obs, 0.15)
    assert v.state == FAILED and v.max_diff == math.inf and v.mismatch_step == 0
    assert v.to_dict()["max_diff"] == "inf"  # JSON has no infinity


def test_another_greedy_token_fails_unless_the_reference_was_a_near_tie() -> None:
    clear = steps({1: -0.1, 2: -0.5})
    swapped = (Step(2, {1: -0.1, 2: -0.5}),)
    assert compare(clear, swapped, 0.15).state == FAILED
    tie = steps({1: -0.70, 2: -0.70001})
    assert compare(tie, (Step(2, {1: -0.70, 2: -0.70001}),), 0.15).state == PASSED


def test_too_few_steps_or_no_reference_is_unknown_never_passed() -> None:
    assert compare(REF, REF[:1], 0.1).state == UNKNOWN
    assert compare((), REF, 0.1).state == UNKNOWN


def test_tolerance_by_dtype_and_override() -> None:
    assert tolerance_for("float32") < tolerance_for("bfloat16")
    assert tolerance_for("fp8_e4m3") == verdict.DEFAULT_TOLERANCE
    assert tolerance_for("float32", 0.5) == 0.5


def test_steps_round_trip_and_refuse_garbage() -> None:
    assert verdict.steps_from([s.to_dict() for s in REF]) == REF
    for bad in ([{"token": 1}], [{"token": "x", "top": {}}], {"a": 1},
                [{"token": 1, "top": {"1": "nan"}}], [{"token": 1, "top": [1]}]):
        with pytest.raises(ValueError):
            verdict.steps_from(bad)


@pytest.mark.parametrize(("vllm", "extra", "path"), [
    (0, 512, "lmcache"), (384, 128, "lmcache"), (512, 0, "vllm"), (0, 0, "computed"),
    (None, 5, "unknown"), (5, None, "unknown")])
def test_served_path(vllm: int | None, extra: int | None, path: str) -> None:
    assert served_path(vllm, extra, 512) == path


# ------------------------------------------------------------------------- prompt


def test_prompt_is_whole_chunks_and_the_conversation_end() -> None:
    toks = list(range(1000))
    cut = prompt.cut(toks, 256, 2)
    assert cut == [*range(512), *range(1000 - prompt.TAIL_TOKENS, 1000)]
    assert prompt.cut(toks[:515], 256, 2) is None
    assert prompt.conversation(10) == prompt.conversation(10)  # seeded: the same every time
    assert len(prompt.conversation(30)[1]["content"].split()) == 30


# ------------------------------------------------------------------------- vLLM's answer


def answer(tokens: list[str], tops: list[dict[str, float]]) -> dict[str, Any]:
    return {"choices": [{"logprobs": {"tokens": tokens, "top_logprobs": tops}}]}


def test_steps_of_a_completions_answer() -> None:
    doc = answer(["token_id:5", "token_id:9"],
                 [{"token_id:5": -0.1, "token_id:6": -2.0}, {"token_id:9": -0.3}])
    assert steps_of(doc) == (Step(5, {5: -0.1, 6: -2.0}), Step(9, {9: -0.3}))


@pytest.mark.parametrize("doc", [
    {}, {"choices": []}, answer(["5"], [{"token_id:5": -1.0}]),
    answer(["token_id:5"], [{"token_id:5": "x"}]), answer(["token_id:5"], []),
    {"choices": [{"logprobs": None}]}])
def test_an_answer_without_usable_logprobs_is_a_probe_error(doc: dict[str, Any]) -> None:
    with pytest.raises(ProbeError):
        steps_of(doc)


# ------------------------------------------------------------------------- the record


def rec(**kw: Any) -> record.Record:
    base: dict[str, Any] = {"chunk_size": 256, "chunks": 2, "tokens": (1, 2, 3),
                            "reference": REF, "reference_at": "2026-12-06T00:00:00Z"}
    return record.Record(NS, **{**base, **kw})


def test_record_round_trip_keeps_a_failure_until_reset(tmp_path: Path) -> None:
    path = record.record_path(str(tmp_path), NS)
    r = rec().with_run({"state": "passed", "at": "a", "when": "launch"})
    assert r.state == "passed"
    r = r.with_run({"state": "failed", "at": "b", "detail": "step 0"})
    r = r.with_run({"state": "passed", "at": "c"})
    assert r.state == "failed" and r.failed["at"] == "b" and r.last["at"] == "c"
    record.write_record(path, r)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    back = record.read_record(path, NS)
    assert back == r
    assert back is not None and back.summary()["last_passed_at"] == "c"
    assert record.remove_record(path) and record.read_record(path, NS) is None
    assert not record.remove_record(path)


def test_history_is_bounded() -> None:
    r = rec()
    for i in range(record.HISTORY + 7):
        r = r.with_run({"state": "passed", "at": str(i)})
    assert len(r.history) == record.HISTORY and r.history[-1]["at"] == str(record.HISTORY + 6)


def test_fits_only_the_same_geometry_with_a_reference() -> None:
    assert rec().fits(256, 2)
    assert not rec().fits(256, 3) and not rec().fits(512, 2)
    assert not rec(reference=()).fits(256, 2)


@pytest.mark.parametrize(("change", "why"), [
    ({"schema": "other/1"}, "schema"),
    ({"namespace": "kvp-ffffffffffffffffffffffffffffffff"}, "record of"),
    ({"prompt": {"tokens": [1, "x"]}}, "token ids"),
    ({"prompt": {"tokens": [1], "chunk_size": -1}}, "small integer"),
    ({"reference": {"steps": [{"token": 1}]}}, "malformed"),
    ({"history": {"a": 1}}, "history"),
    ({"history": [{"state": "great"}]}, "state"),
])
def test_a_malformed_record_is_refused(tmp_path: Path, change: dict[str, Any],
                                       why: str) -> None:
    doc = {**rec().to_dict(), **change}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(UnreadableFile, match=why):
        record.read_record(str(path), NS)


def test_a_huge_or_linked_record_is_never_read(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with big.open("wb") as f:
        f.truncate(64 << 20)
    with pytest.raises(UnreadableFile):
        record.read_record(str(big), NS)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(rec().to_dict()))
    link = tmp_path / "link.json"
    link.symlink_to(good)
    with pytest.raises(UnreadableFile):
        record.read_record(str(link), NS)


# ------------------------------------------------------------------------- health


def test_health_of_the_canary() -> None:
    failed = {"state": "failed", "failed": {"at": "t", "detail": "step 0: gone"}}
    assert canary_health(failed, None, vllm_has_connector=True)[0] == "down"
    st, detail = canary_health(failed, None, vllm_has_connector=False)
    assert st == "degraded" and "step 0: gone" in detail and "canary reset" in detail
    assert canary_health(failed, None, vllm_has_connector=None)[0] == "degraded"
    passed = {"state": "passed", "last": {"state": "passed", "at": "t", "when": "launch",
                                          "path": "lmcache", "verdict": {"max_diff": 0.0}}}
    assert canary_health(passed, None, vllm_has_connector=True)[0] == "ok"
    unknown = {"state": "unknown", "last": {"state": "unknown", "detail": "busy"}}
    st, detail = canary_health(unknown, None, vllm_has_connector=True)
    assert st == "degraded" and "not a pass" in detail
    assert canary_health({"state": "none"}, None, vllm_has_connector=None)[0] == "skipped"
    # this health run's own run counts over the record's last one
    assert canary_health(passed, {"state": "unknown", "detail": "timeout"},
                         vllm_has_connector=True)[0] == "degraded"
    assert canary_health({"state": "unknown", "error": "bad"}, None,
                         vllm_has_connector=None)[0] == "degraded"


# ------------------------------------------------------------------------- settings, render


def dep(extra: dict[str, str] | None = None):
    return build_deployment("t", "t.env", {**BASE, **DEPLOY, **(extra or {})}, {},
                            GenericConfig())


def test_canary_settings() -> None:
    s = dep().settings
    assert (s.canary, s.canary_chunks, s.canary_tolerance) == (True, 2, 0.0)
    s = dep({"KVP_CANARY": "false", "KVP_CANARY_CHUNKS": "4",
             "KVP_CANARY_TOLERANCE": "0.3"}).settings
    assert (s.canary, s.canary_chunks, s.canary_tolerance) == (False, 4, 0.3)
    for key, value in (("KVP_CANARY_CHUNKS", "0"), ("KVP_CANARY_CHUNKS", "17"),
                       ("KVP_CANARY_TOLERANCE", "-1"), ("KVP_CANARY_TOLERANCE", "nan"),
                       ("KVP_CANARY", "maybe")):
        with pytest.raises(ConfigError, match=key):
            dep({key: value})


def test_rendered_without_the_connector_while_the_canary_failed() -> None:
    d = dep()
    normal = render(d, TEMPLATES, l1_size_gb=8, l2_capacity_gb=10)
    off = render(d, TEMPLATES, l1_size_gb=8, l2_capacity_gb=10, recompute="canary failed")
    assert "--kv-transfer-config" in normal.vllm_argv and normal.recompute == ""
    assert "--kv-transfer-config" not in off.vllm_argv
    assert off.as_json()["recompute"] == "canary failed"
    assert any("WITHOUT the cache connector" in w for w in off.warnings)
    # everything else is the same argv
    i = normal.vllm_argv.index("--kv-transfer-config")
    assert off.vllm_argv == normal.vllm_argv[:i] + normal.vllm_argv[i + 2:]
    # and the KV_PERSIST=1 hook adds no connector either
    doc = off.as_json()
    argv = hook.persist_argv(["vllm", "serve", "/models/llama"], doc)
    assert "--kv-transfer-config" not in argv and d.namespace in argv
    argv = hook.persist_argv(["vllm", "serve", "/models/llama"], normal.as_json())
    assert "--kv-transfer-config" in argv


def test_warm_sample_takes_the_entries_in_turn() -> None:
    from kvpersist.stack.canary.warm_sample import pick

    assert pick(5, 0, 2) == [0, 1] and pick(5, 4, 2) == [4, 0] and pick(2, 1, 9) == [1, 0]
    assert pick(0, 0, 3) == [] and pick(5, 0, 0) == []
    r = rec(warm_next=3)
    assert record.parse(r.to_dict(), NS).warm_next == 3
    with pytest.raises(ValueError, match="warm_next"):
        record.parse({**r.to_dict(), "warm_next": -1}, NS)


def test_a_record_root_writes_is_given_to_the_service_user(tmp_path: Path) -> None:
    """The vLLM unit's readiness step runs as root; the health timer, as the service user,
    reads and writes the record again: root gives the record and its directory away (the
    suite runs as root)."""
    import pwd

    nobody = pwd.getpwnam("nobody")
    owner = (nobody.pw_uid, nobody.pw_gid)
    path = str(tmp_path / "state" / record.CANARY_DIR / "kvp-x.json")
    record.write_record(path, record.Record("kvp-x"), owner)
    for p in (os.path.dirname(path), path):
        st = os.lstat(p)
        assert (st.st_uid, st.st_gid) == owner, p
        assert stat.S_IMODE(st.st_mode) & 0o077 == 0, p
    assert record.read_record(path, "kvp-x") == record.Record("kvp-x")
    assert record.record_owner("") is None
    assert record.record_owner("root") is None
    assert record.record_owner("nobody") == owner
