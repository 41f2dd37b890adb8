"""Production traffic end to end (issue 21): the returning-users storm after every kind of
restart, on real vLLM (CPU build) + a real lmcache server, in float32 (the oracle: there,
vLLM's outputs do not depend on what was cached or on batching; see docs/persistence.md).

One deployment; N = 8 users with long histories sharing a system prompt, 2 new users joining
each round, greedy decoding (bench/traffic.py). Every round's reference outputs are computed
first, each request alone with a ``cache_salt`` of its own (a cold prefill on the same engine);
then all users send at once, within one second, while (or right after) the deployment is
restarted one way or another:

1. steady state: two rounds, no restart;
2. restart of both (``stop``, then ``launch`` while the users come back): requests that
   arrive while vLLM does not listen are refused and sent again (the documented restart
   window); every returning user's history is then found by LMCache in L2 (vLLM's prefix
   cache and L1 are empty);
3. ``restart --only vllm`` (the ``restart`` command) while the users come back: the cache
   server keeps its L1, histories hit; vLLM drains the requests in flight at its stop
   (``--shutdown-timeout``, rendered), so no answer is cut short;
4. ``restart --only server``: vLLM keeps serving (no user sees an error at all), cold while
   the server is away, then reconnects;
5. ``kill -9`` of the cache server mid-storm, then ``launch`` starts only the server (the
   crash-window check runs first);
6. ``kill -9`` of vLLM mid-storm, then ``launch`` starts only vLLM.

Asserted in every phase: every output equals its reference (0 wrong outputs), errors only
inside the restart window (vLLM not listening, or a request cut by the kill), every user
served in the end. vLLM starts 4 times in all.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.traffic import (
    Record,
    compare,
    conversation,
    float32_config,
    make_users,
    references,
    storm,
    summary,
)
from kvpersist.system import procs

from ._stack import Stack, l2_hits_in_log, l2_hits_in_text
from ._traffic import Beside, outside_window

pytestmark = pytest.mark.fullstack

N, NEW, ROUNDS = 8, 2, 7
USERS = make_users(N, seed=21, turns=6, words=130, new=NEW, rounds=ROUNDS)
CHUNK = 256
STATE: dict[str, Any] = {"refs": {}, "records": []}
#: what a client may see in the restart window (docs/persistence.md, "Production traffic"):
#: nothing listens (connect), the connection is refused mid-handshake (reset), a stopping vLLM
#: answers 500 "cannot schedule new futures after shutdown", or ends the stream of a request it
#: received as it stopped without a normal finish (finish_reason "abort" or none, no text: it
#: closes its HTTP server last); only when vLLM is killed, a stream cut short. Every such
#: request is sent again and then gets its reference answer.
PLANNED_ERRORS = {"connect", "reset", "http-500", "finish-abort", "finish-None"}
WINDOW_ERRORS = PLANNED_ERRORS | {"stream"}
#: the texts of a stopping vLLM's 500s: its thread pool is shut down, or (a request that came
#: as its engine core process exited) vLLM's EngineDeadError; any other 500 is a finding
SHUTDOWN_500S = ("cannot schedule new futures after shutdown", "EngineCore encountered an issue")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("traffic")
    cfg = float32_config(tmp / "cpu-demo-fp32")
    s = Stack(tmp, config=str(cfg), model=demo_model)
    try:
        yield s
    finally:
        s.cleanup()


def _batch(rnd: int) -> list[tuple[int, int, list[dict[str, str]]]]:
    return [(u.uid, rnd, conversation(u, rnd, STATE["refs"])) for u in USERS if u.joins <= rnd]


def _refs(stack: Stack, rnd: int) -> list[tuple[int, int, list[dict[str, str]]]]:
    batch = _batch(rnd)
    STATE["refs"].update(references(stack.vllm_url, "cpu-demo", batch))
    return batch


def _storm(stack: Stack, batch: list[tuple[int, int, list[dict[str, str]]]], phase: str,
           retry_s: float = 0.0) -> list[Record]:
    recs = storm(stack.vllm_url, "cpu-demo", batch, phase=phase, spread_s=1.0,
                 seed=len(STATE["records"]), retry_until=time.monotonic() + retry_s)
    STATE["records"] += recs
    for cls in sorted({r.error_class for r in recs if not r.ok}):
        texts = sorted({r.error[:300] for r in recs if r.error_class == cls})
        print(f"\n{phase}: {sum(r.error_class == cls for r in recs)} x {cls}: "
              + " | ".join(texts[:4]))
    wrong = compare(recs, STATE["refs"])
    assert not wrong, wrong
    served = {(r.uid, r.round) for r in recs if r.ok}
    assert served == {(uid, rnd) for uid, rnd, _ in batch}, summary(recs)
    return recs


def _history_hit(recs: list[Record], rnd: int) -> list[str]:
    """Returning users whose history (every full chunk of what they sent the round before)
    was not found in a cache."""
    out = []
    for r in recs:
        user = USERS[r.uid]
        if not r.ok or user.joins >= rnd:
            continue
        before = [p for p in STATE["records"] if p.uid == r.uid and p.round == rnd - 1 and p.ok]
        full = (before[0].prompt_tokens or 0) // CHUNK * CHUNK if before else 0
        if (r.cached_tokens or 0) < full:
            out.append(f"user {r.uid}: {r.cached_tokens} cached < {full}")
    return out


def _kill(pid_file: Path, sig: int = signal.SIGKILL) -> int:
    pid = int(pid_file.read_text().split()[0])
    os.kill(pid, sig)
    return pid


def test_steady_state_storm_of_returning_and_new_users(stack: Stack) -> None:
    info = stack.launch()
    STATE["ns"] = info["namespace"]
    for rnd in (0, 1):
        recs = _storm(stack, _refs(stack, rnd), f"steady-{rnd}")
        assert all(r.ok for r in recs), summary(recs)
    assert not _history_hit([r for r in recs], 1)


def test_restart_of_both_storm_hits_every_history_from_l2(stack: Stack) -> None:
    """Both stopped, then launched while every user comes back: those who arrive before vLLM
    listens are refused and retry; every returning user's history is then found in L2 (vLLM's
    prefix cache and the server's L1 are empty after the restart)."""
    batch = _refs(stack, 2)
    stopped = stack.stop()
    assert [s["how"] for s in stopped["stopped"]] == ["terminated", "terminated"], stopped
    mark = stack.server_log.stat().st_size
    t0 = time.time()
    launch = Beside(lambda: stack.launch())
    time.sleep(0.5)
    recs = _storm(stack, batch, "restart-both", retry_s=600)
    doc = launch.join()
    assert doc["started"] == ["server", "vllm"], doc
    late = outside_window(recs, (t0, launch.ended))
    assert not late, [(r.uid, r.error_class, r.error) for r in late]
    assert {r.error_class for r in recs if not r.ok} <= PLANNED_ERRORS
    missed = _history_hit(recs, 2)
    assert not missed, (missed, [(r.uid, r.cached_tokens, r.prompt_tokens, r.error_class)
                                 for r in recs])
    log = stack.server_log.read_bytes()[mark:].decode(errors="replace")
    assert l2_hits_in_text(log) and max(l2_hits_in_text(log)) >= 3, log[-2000:]


def test_restart_of_vllm_only_keeps_the_server_and_its_l1(stack: Stack) -> None:
    batch = _refs(stack, 3)
    server_pid = procs.check_pid_file(str(stack.pid_file), ()).pid
    t0 = time.time()
    restart = Beside(lambda: stack.kvp_json("restart", stack.config, "--only", "vllm"))
    time.sleep(0.5)
    recs = _storm(stack, batch, "restart-vllm", retry_s=600)
    doc = restart.join()
    assert doc["restarted"] == ["vllm"], doc
    assert procs.check_pid_file(str(stack.pid_file), ()).pid == server_pid
    assert not outside_window(recs, (t0, restart.ended))
    # vLLM drains what is in flight at a stop (--shutdown-timeout): no answer is cut short;
    # a request that came while it stopped or did not listen failed at once and was sent again
    assert {r.error_class for r in recs if not r.ok} <= PLANNED_ERRORS, summary(recs)
    odd = {r.error for r in recs if r.error_class == "http-500"
           and not any(t in r.error for t in SHUTDOWN_500S)}
    assert not odd, odd
    assert not _history_hit(recs, 3)


def test_restart_of_the_server_only_is_invisible_to_users(stack: Stack) -> None:
    batch = _refs(stack, 4)
    restart = Beside(lambda: stack.kvp_json("restart", stack.config, "--only", "server"))
    time.sleep(0.5)
    recs = _storm(stack, batch, "restart-server")
    doc = restart.join()
    assert doc["restarted"] == ["server"], doc
    assert all(r.ok for r in recs), summary(recs)  # vLLM never stopped: no error at all


def test_kill_9_of_the_server_mid_storm_then_launch_starts_only_the_server(
        stack: Stack) -> None:
    batch = _refs(stack, 5)
    killer = Beside(lambda: (time.sleep(1.0), _kill(stack.pid_file)))
    recs = _storm(stack, batch, "kill9-server")
    killer.join()
    assert all(r.ok for r in recs), summary(recs)  # vLLM serves on, cold
    doc = stack.launch()
    assert doc["lmcache"]["pid"] and doc["vllm"] is None, doc
    assert any("vLLM already runs" in n for n in doc["notes"]), doc["notes"]
    assert doc["crash_window"]["unclean"] is True, doc["crash_window"]
    recs = _storm(stack, batch, "after-kill9-server")
    assert all(r.ok for r in recs)


def _a_server_that_does_not_start_stops_the_vllm_beside_it(stack: Stack,
                                                          vllm_pid_file: Path) -> None:
    """The launch starts vLLM first (it loads its weights while the server starts); when the
    server is not healthy in time (``--timeout 0.5``), the launch fails and stops that vLLM:
    nothing of the deployment is left running."""
    r = stack.kvp("launch", stack.config, "--timeout", "0.5", "--json")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "stopping vLLM" in r.stderr and "not healthy after" in r.stderr, r.stderr
    st = stack.kvp_json("status", stack.config, check=False)
    assert st["lmcache"]["state"] != "running" and st["vllm"]["state"] != "running", st
    assert not vllm_pid_file.exists()


def test_kill_9_of_vllm_mid_storm_then_launch_starts_only_vllm(stack: Stack) -> None:
    batch = _refs(stack, 6)
    vllm_pid_file = stack.state_dir / "pids" / f"{Path(stack.config).name}.vllm.pid"
    t0 = time.time()
    killer = Beside(lambda: (time.sleep(1.5), _kill(vllm_pid_file))[-1])
    # vLLM's engine core and worker outlive the kill of its API server (a session of their
    # own, 2 GB here): the launch stops them before it starts a new vLLM beside them
    left = Beside(lambda: (killer.join(), time.sleep(1.0), procs.leftovers(killer.result))[-1])
    relaunch = Beside(lambda: (left.join(), stack.launch())[-1])
    recs = _storm(stack, batch, "kill9-vllm", retry_s=600)
    doc = relaunch.join()
    assert doc["vllm"] and doc["vllm"]["pid"], doc
    assert left.result, "nothing of the killed vLLM outlived it"
    assert not procs.leftovers(killer.result), "the launch left the killed vLLM's engine"
    assert not any(p.is_running() and p.status() != "zombie" for p in left.result)
    assert any("cache server already runs" in n for n in doc["notes"]), doc["notes"]
    assert not outside_window(recs, (t0, relaunch.ended))
    assert {r.error_class for r in recs if not r.ok} <= WINDOW_ERRORS
    stack.stop()
    _a_server_that_does_not_start_stops_the_vllm_beside_it(stack, vllm_pid_file)
    records: list[Record] = STATE["records"]
    wrong = compare(records, STATE["refs"])
    print("\n" + json.dumps({"phases": sorted({r.phase for r in records}),
                             "requests": len(records),
                             "compared": sum(1 for r in records if r.ok),
                             "wrong": len(wrong), **summary(records)}, indent=1))
    assert not wrong
    assert max(l2_hits_in_log(stack.server_log)) >= 3
