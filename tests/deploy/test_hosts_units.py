"""The units under the real systemd 252, on a real host (issue 41).

One host whose PID 1 is systemd (tests/deploy/_hosts.py), its NVMe mounted by its own mount
unit ``NVME_SETTLE_S`` seconds after boot (as a data disk in /etc/fstab with ``nofail``),
converged by the kvp role over SSH with one deployment, ``demo`` (the tiny model in float32,
vLLM's CPU build as a direct process, a warm set, the three timers). What each test does to
the units is what an operator does (``systemctl``, ``kill -9``, a reboot); the signals each
process receives are observed with strace (tests/deploy/_hosts.py ``SignalWatch``).

1. The cache server runs in its sandbox (user, capabilities, seccomp, read-only system,
   hidden /root, its cache root the one writable data path); a cold chat is stored.
2. ``systemctl start kvp-vllm@demo`` with both units stopped: the cache server starts
   first, vLLM after it, the unit turns active only after the warm-up; the chat hits from
   disk (the server restarted: L1 empty).
3. ``systemctl restart kvp-lmcache@demo``: vLLM keeps running, re-registers with the new
   server, and the chat hits from disk. ``systemctl restart kvp-vllm@demo``: the cache server
   keeps running, the new vLLM is active after its warm-up, and the chat (vLLM's own prefix
   cache emptied) hits the cache server.
4. ``kill -9`` of the cache server: ``Restart=on-failure`` brings it back after 10 s, its
   launch checks the crash window first; vLLM keeps running.
5. ``kill -9`` of vLLM's API server: systemd kills what is left of the unit (observed), and
   ``Restart=always`` brings vLLM back, active after its warm-up; the chat hits.
6. The health, scrub and max-age timers (their periods shortened by a drop-in) fire and
   their JSON results are in the journal.
7. ``systemctl stop`` of vLLM mid-storm (8 users) and of the cache server, the signals
   observed under ``KillMode=mixed``; then a reboot (``podman restart``): the units come back
   by themselves once the NVMe is mounted, in order; the 8 users get their reference answers
   (0 wrong) and the returning user hits from disk.
8. ``systemctl kill kvp-vllm@demo`` (all processes, SIGTERM): what it does, observed.
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import pytest

from bench.traffic import conversation, make_users

from ..fullstack._nsclient import NsClient
from . import _deployment as dep
from . import _hosts
from ._hosts import Delivery, Host, Hosts, SignalWatch

pytestmark = [pytest.mark.deploy, pytest.mark.fullstack]

NAME = "demo"
ROOT = f"{_hosts.CACHE_PARENT}/{NAME}"
CONFIG = f"/etc/kvpersist/{NAME}/identity.env"
STATE = f"/var/lib/kvpersist/{NAME}"
LMCACHE = f"kvp-lmcache@{NAME}.service"
VLLM = f"kvp-vllm@{NAME}.service"
TIMERS = ("health", "scrub", "prune-max-age")
#: the NVMe appears this long after boot (kvp-test-nvme-settle.service)
NVME_SETTLE_S = 8
#: the storm: 8 users with histories of their own (bench/traffic.py)
USERS = make_users(8, seed=41, turns=6, words=120)
STORM = [(u.uid, 0, conversation(u, 0, {})) for u in USERS]
#: the test's own drop-in for vLLM: /reset_prefix_cache (vLLM's development endpoint), so
#: that a chat can be made to miss vLLM's own prefix cache and ask the cache server
DEV_DROPIN = (f"/etc/systemd/system/{VLLM}.d/50-test-dev-mode.conf",
              "[Service]\nEnvironment=VLLM_SERVER_DEV_MODE=1\n")
#: the test's timer drop-ins: fire 3 s after the timer starts, then every hour
TIMER_DROPIN = "[Timer]\nOnBootSec=\nOnActiveSec=3s\nOnUnitActiveSec=1h\nRandomizedDelaySec=0\n" \
    "AccuracySec=1s\n"


@dataclass
class Unit:
    hosts: Hosts
    host: Host
    reference: str = ""
    refs: dict[tuple[int, int], str] = field(default_factory=dict)
    #: signals observed, per situation (printed at the end, docs/deployment.md)
    signals: dict[str, list[Delivery]] = field(default_factory=dict)
    seen: dict[str, Any] = field(default_factory=dict)

    def kvp(self, *args: str, check: bool = False) -> Any:
        return self.host.exec(f"{_hosts.HOST_VENV}/bin/kvp-admin", *args, check=check,
                              timeout=300)

    def pid(self, unit: str) -> int:
        return int(self.host.show(unit, "MainPID")["MainPID"])

    def when(self, unit: str, prop: str) -> float:
        """A timestamp property of ``unit`` (e.g. ActiveEnterTimestamp) as epoch seconds."""
        v = self.host.systemctl("show", unit, f"--property={prop}", "--timestamp=us+utc")
        stamp = v.stdout.strip().split("=", 1)[1]
        return datetime.strptime(stamp, "%a %Y-%m-%d %H:%M:%S.%f UTC").replace(
            tzinfo=UTC).timestamp()

    def client(self) -> NsClient:
        return NsClient(self.host.wrap, "http://127.0.0.1:8000")

    def chat(self, *, reset: bool = False) -> tuple[str, float, float]:
        """The returning user's chat: answer, tokens from LMCache (external) and from vLLM's
        own prefix cache; ``reset``: vLLM's prefix cache emptied first."""
        with self.client() as c:
            if reset:
                assert c.send({"op": "post", "path": "/reset_prefix_cache"})["status"] == 200
            ext = c.send({"op": "metric", "name": dep.HITS})["value"]
            loc = c.send({"op": "metric", "name": dep.LOCAL_HITS})["value"]
            got = c.send({"op": "chat", "messages": dep.CHAT, "max_tokens": 24})
            assert "error" not in got, got
            ext = c.send({"op": "metric", "name": dep.HITS})["value"] - ext
            loc = c.send({"op": "metric", "name": dep.LOCAL_HITS})["value"] - loc
        return str(got["text"]), ext, loc

    def server_log(self, pid: int) -> str:
        return self.host.journal("-u", LMCACHE, f"_PID={pid}")

    def wait_registered(self, server_pid: int, timeout: float = 180) -> None:
        """Until vLLM's connector registered its KV layout with the server ``server_pid``."""
        deadline = time.monotonic() + timeout
        while "Registered non-GPU context" not in self.server_log(server_pid):
            assert time.monotonic() < deadline, self.server_log(server_pid)[-3000:]
            time.sleep(2)

    def wait_active(self, unit: str, timeout: float = 600, not_pid: int = 0) -> int:
        """Until ``unit`` is active with a main process other than ``not_pid``; its pid."""
        deadline = time.monotonic() + timeout
        while True:
            shown = self.host.show(unit, "ActiveState", "MainPID")
            if shown["ActiveState"] == "active" and int(shown["MainPID"]) not in (0, not_pid):
                return int(shown["MainPID"])
            assert time.monotonic() < deadline, (unit, shown, self.host.journal(
                "-u", unit, "-n", "60"))
            time.sleep(1)

    def watch(self, name: str, *units: str) -> SignalWatch:
        return SignalWatch.start(self.host, units, self.hosts.base / f"strace-{name}.txt")


@pytest.fixture(scope="module")
def unit(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Unit]:
    data, model = dep.make_data(tmp_path_factory.mktemp("hosts-data"))
    hosts = _hosts.start_hosts(["u1"], data=data, settle_s=NVME_SETTLE_S)
    try:
        u = Unit(hosts, hosts.hosts["u1"])
        u.host.sh(f"mkdir -p /etc/systemd/system/{VLLM}.d")
        u.host.write(*DEV_DROPIN)
        inv = hosts.inventory({"u1": {"kvp_deployments": [{
            "name": NAME, "cache_root": ROOT, "vllm": True,
            "env": dep.demo_env(model, KVP_L2_MAX_AGE="30d")}]}},
            dep.group_vars(kvp_max_age_prune_timer=True))
        run = hosts.playbook(_hosts.ANSIBLE_DIR / "kvpersist.yml", inv)
        hosts.timings["converge"] = round(run.seconds, 1)
        assert run.returncode == 0, run.output[-6000:] + hosts.journals(80)
        yield u
        print("\nreal host, the units, measured (s):", json.dumps(hosts.timings, indent=1))
        print("seen:", json.dumps(u.seen, indent=1, default=str))
        for what, seen in u.signals.items():
            print(f"signals, {what}:")
            for d in seen:
                print(f"  {d.process} <- {d.signal}" + (" (died of it)" if d.fatal else
                                                         f" from {d.sender}"))
    finally:
        hosts.close()


def _json_documents(text: str) -> list[dict[str, Any]]:
    """The JSON documents ``kvp-admin ... --json`` printed into a journal (indented: each from
    a line ``{`` to the next line ``}``)."""
    lines, docs = text.splitlines(), []
    for i, line in enumerate(lines):
        if line != "{":
            continue
        for j in range(i + 1, len(lines)):
            if lines[j] == "}":
                with contextlib.suppress(json.JSONDecodeError):
                    docs.append(json.loads("\n".join(lines[i:j + 1])))
                break
    return docs


def _timed(u: Unit, name: str, t0: float) -> None:
    u.hosts.timings[name] = round(time.monotonic() - t0, 1)


def test_the_cache_server_runs_in_its_sandbox_and_a_cold_chat_is_stored(unit: Unit) -> None:
    h = unit.host
    pid = unit.pid(LMCACHE)
    status = dict(line.split(":", 1) for line in h.exec("cat", f"/proc/{pid}/status").stdout
                  .splitlines() if ":" in line)
    uid = h.exec("id", "-u", "kvpersist").stdout.strip()
    assert status["Uid"].split()[0] == uid != "0"
    assert int(status["CapEff"], 16) == 0 and int(status["CapBnd"], 16) == 0
    assert status["NoNewPrivs"].strip() == "1" and status["Seccomp"].strip() == "2"
    # its mount namespace (/proc/PID/mountinfo: root within the file system, mount point,
    # options): the system read-only, the cache root and state writable, /root and /home
    # covered by systemd's inaccessible directory (mode 000), /proc with hidepid=invisible
    mounts = {}
    for line in h.exec("cat", f"/proc/{pid}/mountinfo").stdout.splitlines():
        f = line.split()
        mounts[f[4]] = (f[3], f[5].split(","), line.split(" - ", 1)[1])
    assert "ro" in mounts["/"][1], mounts["/"]
    assert "rw" in mounts[ROOT][1] and "rw" in mounts[STATE][1], (mounts[ROOT], mounts[STATE])
    for hidden in ("/root", "/home"):
        assert mounts[hidden][0].endswith("/inaccessible/dir"), mounts[hidden]
    assert "hidepid=invisible" in mounts["/proc"][2], mounts["/proc"]
    # a cold chat: its chunks stored owner-only; the reference answer, computed cold
    with unit.client() as c:
        refs = c.send({"op": "references", "requests": [[0, 0, dep.CHAT]],
                       "max_tokens": 24})["answers"]
    unit.reference = refs[0][2]
    text, _, _ = unit.chat()
    assert text == unit.reference
    # owner-only (the unit's UMask=0077 over LMCache's 0755: 0700), the service user's
    files = [f.split(" ", 2) for f in h.sh(f"stat -c '%a %U %n' {ROOT}/*.bin").stdout
             .splitlines() if f]
    assert len(files) >= 5, files
    assert all(int(mode, 8) & 0o077 == 0 and user == "kvpersist" for mode, user, _ in files), \
        files


def test_starting_vllm_starts_the_server_first_and_is_active_after_the_warmup(unit: Unit) -> None:
    assert unit.reference, "the cold chat did not run"
    h = unit.host
    h.systemctl("stop", VLLM, LMCACHE)
    t0 = time.monotonic()
    h.systemctl("start", VLLM, timeout=900)  # returns once the unit is active
    _timed(unit, "systemctl start kvp-vllm (both stopped)", t0)
    assert h.systemctl("is-active", LMCACHE).stdout.strip() == "active"
    server_up = unit.when(LMCACHE, "ActiveEnterTimestamp")
    vllm_started = unit.when(VLLM, "ExecMainStartTimestamp")
    vllm_active = unit.when(VLLM, "ActiveEnterTimestamp")
    assert server_up <= vllm_started, (server_up, vllm_started)
    warm = json.loads(h.exec("cat", f"{STATE}/warmup.json").stdout)
    finished = datetime.fromisoformat(warm["finished"].replace("Z", "+00:00")).timestamp()
    assert warm["state"] == "done", warm
    assert vllm_started < finished <= vllm_active, (vllm_started, finished, vllm_active)
    # the server restarted (L1 empty): the warm set came from disk
    assert warm["found_chunks"] == warm["requested_chunks"] > 0, warm
    log = unit.server_log(unit.pid(LMCACHE))
    assert re.search(r"retained keys \(0 L1, [1-9]\d* L2\)", log), log[-3000:]
    text, ext, loc = unit.chat()
    assert text == unit.reference
    assert ext + loc >= (warm["requested_chunks"] - 1) * dep.CHUNK, (ext, loc)
    unit.seen["warm_chunks"] = warm["requested_chunks"]


def test_a_restart_of_the_cache_server_leaves_vllm_serving_and_hits_from_disk(
        unit: Unit) -> None:
    h = unit.host
    vllm = unit.pid(VLLM)
    t0 = time.monotonic()
    h.systemctl("restart", LMCACHE)
    server = unit.wait_active(LMCACHE)
    unit.wait_registered(server)
    _timed(unit, "systemctl restart kvp-lmcache to vLLM registered again", t0)
    assert unit.pid(VLLM) == vllm
    text, ext, _ = unit.chat(reset=True)
    assert text == unit.reference
    assert ext >= (unit.seen.get("warm_chunks", 5) - 1) * dep.CHUNK, ext
    assert re.search(r"retained keys \(0 L1, [1-9]\d* L2\)", unit.server_log(server))


def test_a_restart_of_vllm_leaves_the_server_and_the_chat_hits_the_cache(unit: Unit) -> None:
    h = unit.host
    server, vllm = unit.pid(LMCACHE), unit.pid(VLLM)
    t0 = time.monotonic()
    h.systemctl("restart", VLLM, timeout=900)  # returns once the unit is active again
    _timed(unit, "systemctl restart kvp-vllm to active", t0)
    new = unit.pid(VLLM)
    assert new not in (0, vllm) and unit.pid(LMCACHE) == server
    warm = json.loads(h.exec("cat", f"{STATE}/warmup.json").stdout)
    assert warm["state"] == "done" and unit.when(VLLM, "ActiveEnterTimestamp") >= \
        datetime.fromisoformat(warm["finished"].replace("Z", "+00:00")).timestamp(), warm
    # a new vLLM: its own prefix cache starts empty; the chat comes from the cache server
    text, ext, loc = unit.chat(reset=True)
    assert text == unit.reference
    assert ext >= (unit.seen.get("warm_chunks", 5) - 1) * dep.CHUNK, (ext, loc)


def test_kill_9_of_the_cache_server_restarts_it_after_a_crash_window_check(unit: Unit) -> None:
    h = unit.host
    vllm, server = unit.pid(VLLM), unit.pid(LMCACHE)
    restarts = int(h.show(LMCACHE, "NRestarts")["NRestarts"])
    t0 = time.monotonic()
    h.exec("kill", "-9", str(server))
    new = unit.wait_active(LMCACHE, timeout=180, not_pid=server)
    _timed(unit, "kill -9 kvp-lmcache to active again", t0)
    assert int(h.show(LMCACHE, "NRestarts")["NRestarts"]) == restarts + 1
    journal = h.journal("-u", LMCACHE, "--since", "-5min")
    assert "Main process exited, code=killed, status=9/KILL" in journal, journal[-3000:]
    assert "not a clean stop (SERVICE_RESULT=signal EXIT_CODE=killed EXIT_STATUS=KILL)" \
        in journal, journal[-3000:]
    # Type=exec: active once kvp-admin runs, before its launch checked anything; by the time
    # vLLM registered with the new server, the launch has exec'd it, after the check
    unit.wait_registered(new)
    assert re.search(r"crash window: unclean stop: .*checked \d+ chunk file",
                     unit.server_log(new)), unit.server_log(new)[-3000:]
    assert unit.pid(VLLM) == vllm
    text, _, _ = unit.chat(reset=True)
    assert text == unit.reference


def test_kill_9_of_vllms_api_server_restarts_vllm(unit: Unit) -> None:
    h = unit.host
    vllm = unit.pid(VLLM)
    restarts = int(h.show(VLLM, "NRestarts")["NRestarts"])
    watch = unit.watch("kill9-vllm", VLLM)
    t0 = time.monotonic()
    try:
        h.exec("kill", "-9", str(vllm))
        new = unit.wait_active(VLLM, timeout=900, not_pid=vllm)
    finally:
        seen = watch.finish()
    _timed(unit, "kill -9 of vLLM's API server to active again", t0)
    unit.signals["kill -9 of vLLM's API server"] = seen
    assert int(h.show(VLLM, "NRestarts")["NRestarts"]) == restarts + 1
    journal = h.journal("-u", VLLM, "--since", "-15min")
    assert "Main process exited, code=killed, status=9/KILL" in journal, journal[-3000:]
    # what the API server left (its engine core and worker) systemd killed, observed: their
    # death by SIGKILL (strace) and systemd's own line for each
    others = [d for d in seen if "(main)" not in d.process]
    assert others and all(d.signal == "SIGKILL" and d.fatal for d in others), seen
    assert re.search(r"Killing process \d+ \(\S+\) with signal SIGKILL", journal), journal[-3000:]
    warm = json.loads(h.exec("cat", f"{STATE}/warmup.json").stdout)
    assert warm["state"] == "done" and unit.when(VLLM, "ActiveEnterTimestamp") >= \
        datetime.fromisoformat(warm["finished"].replace("Z", "+00:00")).timestamp()
    text, ext, loc = unit.chat()
    assert text == unit.reference and ext + loc > 0
    assert new != vllm


def test_the_timers_fire_and_their_results_are_in_the_journal(unit: Unit) -> None:
    h = unit.host
    for kind in TIMERS:
        h.sh(f"mkdir -p /etc/systemd/system/kvp-{kind}@{NAME}.timer.d")
        h.write(f"/etc/systemd/system/kvp-{kind}@{NAME}.timer.d/50-test.conf", TIMER_DROPIN)
    h.systemctl("daemon-reload")
    before = {k: h.show(f"kvp-{k}@{NAME}.service", "InvocationID")["InvocationID"]
              for k in TIMERS}
    t0 = time.monotonic()
    h.systemctl("restart", *(f"kvp-{k}@{NAME}.timer" for k in TIMERS))
    results: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + 300
    while len(results) < len(TIMERS) and time.monotonic() < deadline:
        time.sleep(2)
        for kind in TIMERS:
            svc = f"kvp-{kind}@{NAME}.service"
            shown = h.show(svc, "Result", "ExecMainStatus", "ActiveState", "InvocationID")
            if kind in results or shown["InvocationID"] in ("", before[kind]) \
                    or shown["ActiveState"] in ("activating", "active", "deactivating"):
                continue
            run = h.journal(f"_SYSTEMD_INVOCATION_ID={shown['InvocationID']}", "-o", "cat")
            docs = _json_documents(run)
            results[kind] = {"shown": shown, "docs": docs,
                             "journal": h.journal("-u", svc, "-n", "40")}
    _timed(unit, "timers fire and finish", t0)
    assert sorted(results) == sorted(TIMERS), results
    for kind, r in results.items():
        assert r["shown"]["Result"] == "success", (kind, r["journal"])
        assert r["docs"], (kind, r["journal"])
    health = results["health"]["docs"][-1]
    # the timer's run, as the service user, with the canary: a completed check (healthy, or
    # degraded with the checks that say why; the kills above leave their traces)
    assert health["status"] in ("healthy", "degraded") and health["namespace"], health
    assert health["components"]["canary"] == "ok", health["components"]
    unit.seen["health timer"] = {"status": health["status"], "not ok": [
        (c["name"], c["detail"]) for c in health["checks"] if c["status"] != "ok"]}
    # the unit's sandbox (ProtectSystem=strict) makes the cache root read-only in its view
    # only: the filesystem is read-write, and the cache root's checks say so
    root = {c["name"]: c for c in health["checks"] if c["name"].startswith("cache_root")}
    assert all(c["status"] == "ok" for c in root.values()), root
    assert "sandbox" in root["cache_root.read_only"]["detail"], root
    assert health["cache_root"]["read_only"] is False, health["cache_root"]
    assert results["scrub"]["docs"][-1].get("schema") == "kvpersist.scrub/1", \
        results["scrub"]["docs"]
    assert results["prune-max-age"]["docs"][-1].get("schema") == "kvpersist.prune/1", \
        results["prune-max-age"]["docs"]
    for kind in TIMERS:  # each scheduled again, an hour on
        shown = h.show(f"kvp-{kind}@{NAME}.timer", "NextElapseUSecMonotonic")
        assert shown["NextElapseUSecMonotonic"] not in ("", "infinity", "0"), shown


def test_stop_mid_storm_then_a_reboot_brings_the_units_back_with_no_wrong_answer(
        unit: Unit) -> None:
    h = unit.host
    with unit.client() as c:
        answers = c.send({"op": "references", "requests": STORM})["answers"]
    unit.refs = {(int(uid), int(rnd)): text for uid, rnd, text in answers}
    watch = unit.watch("stop", VLLM, LMCACHE)
    storm_done: list[Any] = []
    try:
        with unit.client() as c:
            t = threading.Thread(target=lambda: storm_done.append(c.send(
                {"op": "storm", "requests": STORM, "phase": "stop", "spread_s": 0.5})))
            t.start()
            time.sleep(2.0)
            t0 = time.monotonic()
            h.systemctl("stop", VLLM)
            _timed(unit, "systemctl stop kvp-vllm mid-storm", t0)
            t.join(600)
        t0 = time.monotonic()
        h.systemctl("stop", LMCACHE)
        _timed(unit, "systemctl stop kvp-lmcache", t0)
    finally:
        seen = watch.finish()
    unit.signals["systemctl stop (KillMode=mixed)"] = seen
    # KillMode=mixed: systemd's SIGTERM reaches each unit's main process and nothing else
    # (what is left when the main process has exited gets SIGKILL: strace sees only the death)
    # (a thread the main process started after strace attached is shown unlabeled)
    from_systemd = [d for d in seen if d.sender == "systemd (PID 1)"]
    for name in (VLLM, LMCACHE):
        # SIGTERM (then SIGCONT: systemd wakes a stopped process) to the main process only:
        # no other process of the unit ever hears from systemd before its SIGKILL
        assert not [d for d in from_systemd if d.process.startswith(name)
                    and "(main)" not in d.process], seen
        assert [d for d in from_systemd if d.signal == "SIGTERM" and (
            d.process == f"{name}: {d.process.split(': ', 1)[-1]}" and "(main)" in d.process
            or d.process.startswith("thread or child"))], (name, seen, watch.raw()[-3000:])
    assert {d.signal for d in from_systemd} <= {"SIGTERM", "SIGCONT"}, seen
    records = storm_done[0]["records"] if storm_done else []
    wrong = [r for r in records if not r["error_class"]
             and r["text"] != unit.refs[(r["uid"], r["round"])]]
    assert not wrong, wrong
    unit.seen["storm"] = {"ok": sum(1 for r in records if not r["error_class"]),
                          "errors": sorted({r["error_class"] for r in records
                                            if r["error_class"]})}
    # the reboot: every unit comes back by itself, once the NVMe is mounted, in order
    took = _hosts.reboot(h, timeout=240)
    unit.hosts.timings["podman restart to booted"] = round(took, 1)
    t0 = time.monotonic()
    unit.wait_active(VLLM, timeout=900)
    _timed(unit, "booted to kvp-vllm active", t0)
    mounted = unit.when(_hosts.NVME_UNIT, "ActiveEnterTimestamp")
    server_start = unit.when(LMCACHE, "ExecMainStartTimestamp")
    server_up = unit.when(LMCACHE, "ActiveEnterTimestamp")
    vllm_start = unit.when(VLLM, "ExecMainStartTimestamp")
    booted = unit.when("kvp-test-nvme-settle.service", "ExecMainStartTimestamp")
    assert booted + NVME_SETTLE_S - 1 <= mounted <= server_start <= server_up <= vllm_start, \
        (booted, mounted, server_start, server_up, vllm_start)
    assert "226/NAMESPACE" not in h.journal("-b", "-u", LMCACHE)
    text, ext, loc = unit.chat()
    assert text == unit.reference and ext + loc > 0
    with unit.client() as c:
        again = c.send({"op": "storm", "requests": STORM, "phase": "after-reboot",
                        "spread_s": 0.5})["records"]
    assert all(not r["error_class"] for r in again), again
    wrong = [r for r in again if r["text"] != unit.refs[(r["uid"], r["round"])]]
    assert not wrong, wrong


def test_systemctl_kill_sends_sigterm_to_every_process_of_the_unit(unit: Unit) -> None:
    h = unit.host
    unit.wait_active(VLLM)
    watch = unit.watch("kill", VLLM)
    try:
        h.systemctl("kill", VLLM)
        deadline = time.monotonic() + 120
        while h.show(VLLM, "ActiveState")["ActiveState"] == "active" \
                and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(5)
    finally:
        seen = watch.finish()
    unit.signals["systemctl kill (all processes, SIGTERM)"] = seen
    term = {d.process for d in seen if d.signal == "SIGTERM" and d.sender == "systemd (PID 1)"}
    assert term == set(watch.labels.values()), (term, watch.labels, watch.raw()[-3000:])
    unit.seen["after systemctl kill"] = h.show(VLLM, "ActiveState", "Result", "NRestarts")
