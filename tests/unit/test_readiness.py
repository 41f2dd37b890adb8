"""Readiness: the warm-up's verdict in health (pure, table-driven), its place in the overall
status and the metrics, and the small I/O that gathers its facts (a real pid file naming a
real process)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvpersist.actions.metrics import Exposition, health_families
from kvpersist.stack import health
from kvpersist.stack.warm import readiness
from kvpersist.stack.warm.readiness import WarmupFacts, epoch_of, judge
from kvpersist.system import procs

NS = "kvp-" + "a" * 32
OTHER = "kvp-" + "b" * 32
NOW = 1_800_000_000.0
SERVER_STARTED = NOW - 600


def record(state: str, *, ns: str = NS, started: Any = NOW - 30, **kw: Any) -> dict[str, Any]:
    rec = {"state": state, "namespace": ns, "started": started, "finished": None,
           "requested_chunks": 12, "found_chunks": 0, "bytes": 0, "seconds": None,
           "error": None}
    rec.update(kw)
    return rec


def facts(rec: dict[str, Any] | None, **kw: Any) -> WarmupFacts:
    base: dict[str, Any] = {"record": rec, "server_started": SERVER_STARTED, "wait_s": 120.0,
                            "now": NOW}
    base.update(kw)
    return WarmupFacts(**base)


@pytest.mark.parametrize(("rec", "kw", "status", "says"), [
    # no record at all: no check (a deployment without a warm set, or never warmed)
    (None, {}, None, ""),
    (record("done", found_chunks=12, bytes=12 << 22, seconds=1.5), {}, "ok", "12/12 chunks"),
    # an empty L2: 0 found is a completed warm-up, not a fault
    (record("done", found_chunks=0, seconds=0.4), {}, "ok", "0/12 chunks found"),
    (record("failed", error="503 past --wait"), {}, "degraded", "503 past --wait"),
    # warming while its process runs, however long
    (record("warming", started=NOW - 500), {"pid_state": "running", "pid": 42}, "warming",
     "pid 42"),
    # its process is gone without a result: killed or crashed
    (record("warming"), {"pid_state": "stale", "pid": 42,
                         "pid_reason": "process 42 is not running"}, "degraded",
     "ended without a result"),
    # a warm-up run by hand (no pid file): warming within KVP_WARMUP_WAIT + grace...
    (record("warming", started=NOW - 100), {}, "warming", "100 s"),
    # ...and stuck after it
    (record("warming", started=NOW - 300), {}, "degraded", "no process known"),
    (record("warming", started="not a time"), {}, "degraded", "unknown time"),
    # another namespace's record is ignored
    (record("failed", ns=OTHER), {}, "skipped", "ignored"),
    (record("warming", ns=OTHER), {"pid_state": "running"}, "skipped", "ignored"),
    # a record from before the cache server started: that L1 is gone
    (record("done", started=SERVER_STARTED - 60), {}, "skipped", "before the cache server"),
    (record("failed", started=SERVER_STARTED - 60), {}, "skipped", "before the cache server"),
    (record("done", started=SERVER_STARTED - 60), {"server_started": None}, "ok", "warm"),
    (record("paused"), {}, "degraded", "unknown state"),
    # the command ran without a warm set (KVP_WARMUP_FILE empty): nothing to judge
    (record("done", warm_set=False, requested_chunks=0), {}, "skipped", "no warm set"),
    (None, {"error": "warmup.json: Expecting value"}, "degraded", "unreadable"),
])
def test_judge(rec: dict[str, Any] | None, kw: dict[str, Any], status: str | None,
               says: str) -> None:
    got = judge(facts(rec, **kw), NS)
    if status is None:
        assert got is None
        return
    assert got is not None
    assert got[0] == status, got
    assert says in got[1], got


@pytest.mark.parametrize(("value", "want"), [
    (NOW, NOW), (int(NOW), NOW), (int(NOW * 1e9), NOW),
    ("2027-01-15T08:00:00+00:00", 1800000000.0), ("2027-01-15T08:00:00Z", 1800000000.0),
    ("2027-01-15T08:00:00", 1800000000.0), ("2027-01-15 09:00:00+01:00", 1800000000.0),
    (None, None), ("", None), ("yesterday", None), (True, None), ([1], None),
    (10 ** 400, None),  # a JSON integer too big for a float
])
def test_epoch_of(value: Any, want: float | None) -> None:
    assert epoch_of(value) == want


def _facts(**kw: object) -> health.Facts:
    """A healthy deployment (every probe fine), changed by ``kw``."""
    f = health.Facts(server_healthcheck=True, run_script_code=404, root_exists=True,
                     root_mode=0o700, root_writable=True, fs_avail_bytes=10 << 30,
                     reserve_bytes=1 << 30, vllm_health=True, served_model_name="m",
                     namespace=NS, lmcache_port=5555,
                     server_status={"storage_manager": {"l2_adapters": [
                         {"type": "DynamicNixlStoreL2Adapter", "is_healthy": True,
                          "event_loop_alive": True, "stored_object_count": 3}]}},
                     budget={"on_disk_bytes": 1, "own_bytes": 1, "limit_bytes": 10,
                             "l2_max_capacity_bytes": 10, "within_budget": True})
    f.vllm_models = [{"id": "m", "root": NS}]
    for k, v in kw.items():
        setattr(f, k, v)
    return f


WARMING = facts(record("warming"), pid_state="running", pid=42)
DONE = facts(record("done", found_chunks=12))
FAILED = facts(record("failed", error="timed out"))


@pytest.mark.parametrize(("change", "status", "code"), [
    ({"warmup": WARMING}, "warming", 3),
    ({"warmup": DONE}, "healthy", 0),
    ({"warmup": FAILED}, "degraded", 1),
    ({"warmup": facts(None)}, "healthy", 0),
    ({"warmup": facts(record("failed", ns=OTHER))}, "healthy", 0),
    # warming outranks degraded (a load balancer routing on exit 0 waits for it)...
    ({"warmup": WARMING, "fs_avail_bytes": 1}, "warming", 3),
    # ...down outranks warming (not serving at all)
    ({"warmup": WARMING, "vllm_health": False}, "down", 2),
    # the cache server is down: a warm-up that failed for it leaves the deployment degraded
    ({"warmup": FAILED, "server_healthcheck": False}, "degraded", 1),
])
def test_verdict_with_the_warmup(change: dict[str, object], status: str, code: int) -> None:
    got, checks = health.verdict(_facts(**change))
    assert got == status, checks
    assert health.EXIT[got] == code
    comps = health.component_status(checks)
    w = change["warmup"]
    assert isinstance(w, WarmupFacts)
    judged = judge(w, NS)
    assert comps.get("warmup") == (judged[0] if judged else None)


def test_health_json_and_metrics_show_warming(tmp_path: Path) -> None:
    f = _facts(warmup=WARMING)
    status, checks = health.verdict(f)
    from kvpersist.config.loader import load_deployment
    from kvpersist.stack.locate import locate

    dep = load_deployment("cpu-demo", {"KVP_CACHE_ROOT": str(tmp_path / "c")},
                          allow_unpinned=True)
    rep = health.HealthReport("cpu-demo", NS, status, tuple(checks), f, locate(dep))
    doc = rep.to_dict()
    assert doc["status"] == "warming" and doc["exit_code"] == 3
    assert doc["components"]["warmup"] == "warming"
    assert doc["warmup"]["pid_state"] == "running"
    assert doc["warmup"]["record"]["state"] == "warming"
    assert doc["warmup"]["state_file"] == str(tmp_path / ".kvpersist" / "c" / "warmup.json")
    exp = Exposition()
    health_families(exp, rep, NOW)
    samples = {(s.name, s.labels.get("component", "")): s.value
               for fam in exp.families.values() for s in fam.samples}
    assert samples[("kvpersist_deployment_health", "")] == 3
    assert samples[("kvpersist_component_health", "warmup")] == 3
    assert ("kvpersist_component_health", "warmup") in samples
    failed = _facts(warmup=FAILED)
    st, ch = health.verdict(failed)
    exp = Exposition()
    health_families(exp, health.HealthReport("cpu-demo", NS, st, tuple(ch), failed,
                                             locate(dep)), NOW)
    samples = {(s.name, s.labels.get("component", "")): s.value
               for fam in exp.families.values() for s in fam.samples}
    assert samples[("kvpersist_deployment_health", "")] == 1
    assert samples[("kvpersist_component_health", "warmup")] == 1


def test_gather_reads_the_record_and_checks_the_pid_file(tmp_path: Path) -> None:
    """The pid file names a live process carrying the warm-up's markers: running; once it
    has exited: stale (so a "warming" record it left is judged a dead warm-up)."""
    from kvpersist.config.loader import load_deployment
    from kvpersist.stack.locate import locate

    dep = load_deployment("cpu-demo", {"KVP_CACHE_ROOT": str(tmp_path / "c"),
                                       "KVP_WARMUP_WAIT": "45s"}, allow_unpinned=True)
    loc = locate(dep)
    assert loc.warmup_wait == 45.0
    Path(loc.warmup_pid_file).parent.mkdir(parents=True)
    empty = readiness.gather(loc, None)
    assert (empty.record, empty.error, empty.pid_state, empty.wait_s) == (None, "", "absent",
                                                                          45.0)
    assert judge(empty, dep.namespace) is None
    Path(loc.warmup_state_file).write_text(json.dumps(record("warming", ns=dep.namespace,
                                                             started=time.time())))
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                             *readiness.WARMUP_MARKERS])
    try:
        procs.write_pid_file(loc.warmup_pid_file, proc.pid)
        got = readiness.gather(loc, proc.pid)
        assert got.pid_state == "running" and got.pid == proc.pid
        assert got.record is not None and got.record["state"] == "warming"
        assert got.server_started is not None and abs(got.server_started - time.time()) < 60
        judged = judge(got, dep.namespace)
        assert judged is not None and judged[0] == "warming", judged
    finally:
        proc.kill()
        proc.wait()
    got = readiness.gather(loc, None)
    assert got.pid_state == "stale"
    judged = judge(got, dep.namespace)
    assert judged is not None and judged[0] == "degraded"
    Path(loc.warmup_state_file).write_text("{not json")
    assert readiness.gather(loc, None).error


def test_the_record_is_read_typed_and_its_error_cut(tmp_path: Path) -> None:
    """Only the record's own fields, each of its type; a long error is cut for showing; a
    field of another type makes the record unreadable (health: degraded), never a guess."""
    path = tmp_path / "warmup.json"
    path.write_text(json.dumps({**record("failed", error="e" * 50_000), "extra": [1] * 1000}))
    rec, error = readiness.read_record(str(path))
    assert error == "" and rec is not None and "extra" not in rec
    assert rec["state"] == "failed" and len(rec["error"]) < 1100
    assert "49,000 more characters" in rec["error"]
    for field, value in [("state", ["done"]), ("requested_chunks", 1.5),
                         ("found_chunks", True), ("bytes", -1), ("namespace", "n" * 300),
                         ("started", {"at": 1})]:
        path.write_text(json.dumps({**record("done"), field: value}))
        rec, error = readiness.read_record(str(path))
        assert rec is None and str(path) in error and field in error, (field, error)
        judged = judge(WarmupFacts(None, error), NS)
        assert judged is not None and judged[0] == "degraded"


def test_warmup_argv_is_the_contract() -> None:
    assert readiness.warmup_argv("cpu-demo", 120.0, "/s/h.json", python="/py") == [
        "/py", "-m", "kvpersist.cli", "warmup", "cpu-demo", "--wait", "120", "--json",
        "--rendered", "/s/h.json"]
    assert readiness.warmup_argv("/etc/x/identity.env", 2.5, "/h", python="/py")[5:7] == [
        "--wait", "2.5"]
    # the pid file of the child it starts is checked against markers its argv carries
    assert procs.cmdline_matches(readiness.warmup_argv("cpu-demo", 1.0, "/h"),
                                 readiness.WARMUP_MARKERS)
    # a warm-up run by hand, a launch --warmup-only are not the child
    assert not procs.cmdline_matches(["/py", "-m", "kvpersist.cli", "warmup", "cpu-demo"],
                                     readiness.WARMUP_MARKERS)
    assert not procs.cmdline_matches(["/py", "-m", "kvpersist.cli", "health", "cpu-demo"],
                                     readiness.WARMUP_MARKERS)


def test_a_bad_warmup_wait_is_a_config_error() -> None:
    from kvpersist.config.loader import load_deployment
    from kvpersist.errors import ConfigError

    for bad in ("0", "soon", "-5"):
        with pytest.raises(ConfigError, match="KVP_WARMUP_WAIT"):
            load_deployment("cpu-demo", {"KVP_CACHE_ROOT": "/tmp/x", "KVP_WARMUP_WAIT": bad},
                            allow_unpinned=True)


def test_root_runs_the_warmup_as_the_service_user(tmp_path: Path) -> None:
    """Root (the vLLM unit) runs the warm-up as KVP_SERVICE_USER, so that the record, pid
    file and log belong to the user whose health check reads them; anyone else runs it as
    themselves."""
    import os
    import pwd

    from kvpersist.config.loader import load_deployment
    from kvpersist.stack.locate import locate

    env = {"KVP_CACHE_ROOT": str(tmp_path / "c")}
    assert readiness.service_ids(locate(load_deployment("cpu-demo", env,
                                                        allow_unpinned=True))) is None
    user = pwd.getpwuid(65534).pw_name if os.geteuid() == 0 else pwd.getpwuid(os.getuid())[0]
    loc = locate(load_deployment("cpu-demo", {**env, "KVP_SERVICE_USER": user},
                                 allow_unpinned=True))
    want = (65534, pwd.getpwuid(65534).pw_gid) if os.geteuid() == 0 else None
    assert readiness.service_ids(loc) == want


def test_the_kv_port_is_read_from_a_process_argv_as_untrusted() -> None:
    """vLLM's ``--kv-transfer-config`` is read from whatever process the pid file names: a
    document nested 100,000 deep is no port, never a RecursionError."""
    good = '{"kv_connector_extra_config": {"lmcache.mp.port": 5555}}'
    procs_ = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", *args])
              for args in (["--kv-transfer-config", good],
                           ["--kv-transfer-config=" + "[" * 100_000],
                           ["--kv-transfer-config", '{"kv_connector_extra_config": []}'])]
    try:
        assert [health._kv_port_of(p.pid) for p in procs_] == [5555, None, None]
    finally:
        for p in procs_:
            p.kill()
            p.wait()
