"""procs.stop_process against a real process: one that has exited counts as stopped also
while it is a zombie nobody has reaped yet (an orphan's init may take seconds to reap it: the
stop must not wait for that). Escalation to SIGKILL: tests/integration/test_lifecycle_units.py."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil

from kvpersist.system import procs


def test_a_zombie_counts_as_exited() -> None:
    # the child exits at once; we (its parent) do not reap it until the end
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 10
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        t0 = time.monotonic()
        res = procs.stop_process(child.pid, timeout=5, kill_group=False)
        assert res.how == "terminated" and time.monotonic() - t0 < 1.0, res
        assert procs.wait_exited([psutil.Process(child.pid)], 0) == []
    finally:
        child.wait()

