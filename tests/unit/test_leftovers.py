"""What a killed service leaves running: vLLM's engine core and worker outlive a ``kill -9``
of its API server (seen in the soak: six such pairs, 2.2 GB each, until the host ran out of
memory and a launch failed). Real processes here: a leader started like a service (a session
of its own) with a child, the leader killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from kvpersist.stack import processes
from kvpersist.stack.processes import refuse_if_running
from kvpersist.system import procs

CHILD = "import time; time.sleep(120)"


def _service(tmp_path: Path, child_marker: str) -> tuple[int, int]:
    """A leader (its own session, as launch starts vLLM) and its child; both pids."""
    script = (f"import subprocess, sys, time; "
              f"p = subprocess.Popen([sys.executable, '-c', {CHILD!r}, {child_marker!r}]); "
              f"print(p.pid, flush=True); time.sleep(120)")
    log = tmp_path / f"leader-{child_marker.replace(':', '')}.{time.monotonic_ns()}.log"
    proc = procs.start_background([sys.executable, "-c", script, "vllm-leader"],
                                  log_path=log, env=os.environ, cwd=str(tmp_path))
    assert procs.wait_for(lambda: log.read_text().strip() != "", 30, 0.05)
    return proc.pid, int(log.read_text().split()[0])


def _kill9(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
    assert procs.wait_for(lambda: not procs.alive(pid), 10, 0.05)


def test_a_killed_leaders_child_is_found_and_stopped(tmp_path: Path) -> None:
    leader, child = _service(tmp_path, "VLLM::EngineCore")
    assert procs.leftovers(leader) == []  # the leader lives: nothing is left over
    _kill9(leader)
    found = procs.leftovers(leader)
    assert [p.pid for p in found] == [child]
    assert procs.resident_bytes(found) > 0
    assert procs.stop_leftovers(found) == 1  # SIGKILL: nothing of it may run on
    assert not procs.alive(child)
    assert procs.leftovers(leader) == []


def test_a_session_with_a_stranger_in_it_is_never_touched(tmp_path: Path) -> None:
    leader, child = _service(tmp_path, "someone-elses-job")
    _kill9(leader)
    try:
        assert procs.leftovers(leader) == []
        assert procs.alive(child)
    finally:
        os.kill(child, signal.SIGKILL)


def test_launch_and_stop_stop_what_a_dead_vllm_left(tmp_path: Path) -> None:
    """A stale pid file of a killed vLLM: the launch (before it starts vLLM again) and stop
    both stop the leftovers and say so."""
    for use in ("launch", "stop"):
        leader, child = _service(tmp_path, "VLLM::Worker")
        pid_file = tmp_path / f"{use}.vllm.pid"
        procs.write_pid_file(pid_file, leader)
        _kill9(leader)
        state = procs.check_pid_file(pid_file, ("vllm-leader",))
        assert state.state == "stale"
        if use == "launch":
            lines: list[str] = []
            refuse_if_running(state, "vLLM", lines.append)
            said = " ".join(lines)
        else:
            said = processes._stop_by_pid_file("vLLM", state, 5).detail
        assert f"pid {child}" in said and "MiB resident" in said, said
        assert not procs.alive(child)
        assert not pid_file.exists()


def test_a_recycled_pid_is_a_live_process_and_nothing_is_stopped(tmp_path: Path) -> None:
    """A pid file naming a live process that is not ours: its session is not a leftover."""
    sleeper = subprocess.Popen([sys.executable, "-c", CHILD], start_new_session=True)
    try:
        assert procs.leftovers(sleeper.pid) == []
        assert psutil.Process(sleeper.pid).is_running()
    finally:
        sleeper.kill()
        sleeper.wait()



