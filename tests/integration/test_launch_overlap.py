"""The launch overlaps vLLM's start with its own work (issue 23, docs/warm-restart.md): vLLM is
spawned first and loads its weights while the crash-window check runs and the cache server
starts. These tests show that the overlap keeps every guarantee, with the real processes:

- a refused preflight still starts nothing: no vLLM, no cache server (every program the
  launch executes is traced with ``strace -f -e execve``), the cache root not created;
- after an unclean stop, the crash-window check has quarantined a bad file before the cache
  server process exists, while vLLM, spawned before the check, is already loading (and a
  vLLM that does not serve in time is stopped, the healthy server left running);
- a cache server that does not come up stops the vLLM spawned beside it: nothing of the
  deployment is left running.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from kvpersist.demo.kvdriver import connect

from ..fullstack._stack import Stack, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture
def stack(tmp_path: Path, demo_model: Path) -> Iterator[Stack]:
    s = Stack(tmp_path, model=demo_model)
    try:
        yield s
    finally:
        s.cleanup()


def _pid_files(s: Stack) -> list[str]:
    """The deployment's pid files (the launch record beside them, ``*.launched.json``, may
    stay: it makes the next launch treat the stop as unclean and check the crash window)."""
    d = s.state_dir / "pids"
    return sorted(p.name for p in d.glob("*.pid")) if d.is_dir() else []


def _left_running(s: Stack) -> list[str]:
    """Processes that carry the deployment's cache root or state dir in their command line
    or environment (what a vLLM or server of this deployment would)."""
    marks = (str(s.root), str(s.state_dir))
    out = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] == psutil.STATUS_ZOMBIE or p.pid == os.getpid():
                continue
            text = " ".join(p.info["cmdline"] or []) + " " + " ".join(
                f"{k}={v}" for k, v in p.environ().items())
        except (psutil.Error, TypeError):
            continue
        if any(m in text for m in marks):
            out.append(f"{p.pid}: {' '.join(p.info['cmdline'] or [])[:200]}")
    return out


def _started_at(pid: int) -> float:
    """When ``pid`` started, on the wall clock of file times: its start in clock ticks since
    boot (/proc/PID/stat) plus the wall-clock time of the boot measured now to the
    nanosecond (psutil's create_time adds the boot time in whole seconds: up to 1 s off)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[19])  # field 22, starttime; fields[0] is field 3
    boot = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def test_a_refused_preflight_starts_nothing(stack: Stack, tmp_path: Path) -> None:
    """The vLLM port is taken: the preflight refuses (exit 2, naming the port); the launch
    executed neither vLLM nor the cache server, wrote no pid file and did not create the
    cache root."""
    trace = tmp_path / "execve.trace"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", int(stack.env["KVP_VLLM_PORT"])))
        taken.listen()
        stack.wrapper = ("strace", "-f", "-qq", "-e", "trace=execve", "-o", str(trace))
        r = stack.kvp("launch", stack.config, timeout=300)
        stack.wrapper = ()
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert stack.env["KVP_VLLM_PORT"] in r.stderr, r.stderr
    execs = [line for line in trace.read_text().splitlines() if "execve(" in line
             and "= -1" not in line]
    assert execs, "strace saw no execve at all"
    programs = [re.sub(r"^\d+\s+", "", e)[:300] for e in execs]
    started = [p for p in programs if "vllm" in p or "lmcache" in p]
    assert started == [], started
    assert not stack.root.exists()
    assert _pid_files(stack) == []
    assert _left_running(stack) == []


def test_crash_window_is_checked_before_the_server_exists_with_vllm_loading(
        stack: Stack) -> None:
    """kill -9 of the server; one chunk file written since the launch gets other bytes (what
    a crash could leave). The next launch of both spawns vLLM first; the bad file is in
    quarantine before the cache server process is created; vLLM was created before both."""
    ns = stack.render()["namespace"]
    stack.launch("--no-vllm")
    with connect(stack.rpc, stack.http, ns) as d:
        for seq in (1, 2):
            d.store(seq)
    assert wait_until(lambda: len(stack.chunk_files(ns)) == 8, 30)
    pid = int(stack.pid_file.read_text())
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: not psutil.pid_exists(pid)
                      or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 20)
    bad = stack.chunk_files(ns)[3]
    bad.write_bytes(os.urandom(bad.stat().st_size))

    # the creation times of vLLM's and the new server's processes, seen while the launch runs
    # (the pid file names the killed server until the new one is spawned)
    born: dict[str, float] = {}
    done = threading.Event()
    files = {"vllm": stack.state_dir / "pids" / f"{stack.config}.vllm.pid",
             "server": stack.pid_file}

    def watch() -> None:
        while not done.is_set() and len(born) < 2:
            for what, f in files.items():
                if what not in born:
                    with contextlib.suppress(OSError, ValueError, psutil.Error):
                        p = psutil.Process(int(f.read_text()))
                        if p.pid != pid and p.status() != psutil.STATUS_ZOMBIE:
                            born[what] = _started_at(p.pid)
            time.sleep(0.02)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        # vLLM is not waited for to serve (it loads for 40 s and more on 2 cores): past its
        # 2 s the launch stops it and leaves the healthy server running, as it does for any
        # vLLM that fails; the order of the three events is decided before that
        r = stack.kvp("launch", stack.config, "--no-warmup", "--vllm-timeout", "2",
                      timeout=300)
    finally:
        done.set()
        t.join(10)
    assert r.returncode != 0 and "vLLM" in r.stderr, (r.stdout, r.stderr)
    assert "crash window: unclean stop" in r.stderr and "1 quarantined" in r.stderr, r.stderr
    qdir = stack.root / ".kvpersist" / "quarantine"
    quarantined = list(qdir.iterdir())
    assert [q.name.split(".auth.")[0] for q in quarantined] == [bad.name], quarantined
    moved_at = quarantined[0].lstat().st_ctime  # the rename into quarantine
    assert set(born) == {"vllm", "server"}, born
    # a process's start is known to one clock tick
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert born["vllm"] < moved_at < born["server"] + tick, (born, moved_at)
    print(f"vLLM started {moved_at - born['vllm']:.3f} s before the bad file was in "
          f"quarantine, the server {born['server'] - moved_at:.3f} s after")
    st = stack.kvp_json("status", stack.config)
    assert st["lmcache"]["state"] == "running" and st["vllm"]["state"] == "absent", st
    # the server never had the file: it is a miss, the other chunks of its sequence hit
    with connect(stack.rpc, stack.http, ns) as d:
        lk, _ = d.lookup_and_retrieve(1, prefix=True)
        lk2, _ = d.lookup_and_retrieve(2, prefix=True)
    fewer, whole = sorted((lk.hit_chunks, lk2.hit_chunks))
    assert whole == 4 and fewer < 4, (lk, lk2)
    stack.stop()


def test_a_server_that_does_not_come_up_stops_the_vllm_beside_it(stack: Stack) -> None:
    """``--timeout 0.5``: the cache server is not healthy in time (it takes seconds). The
    launch stops the server and the vLLM it spawned before it, says so, and exits non-zero;
    no process of the deployment is left, no pid file."""
    r = stack.kvp("launch", stack.config, "--timeout", "0.5", "--no-warmup", timeout=300)
    assert r.returncode != 0, (r.stdout, r.stderr)
    m = re.search(r"stopping vLLM \(pid (\d+)\): the cache server did not start", r.stderr)
    assert m, r.stderr
    vpid = int(m.group(1))
    assert "lmcache server not healthy after" in r.stderr, r.stderr
    assert wait_until(lambda: not psutil.pid_exists(vpid)
                      or psutil.Process(vpid).status() == psutil.STATUS_ZOMBIE, 30)
    assert wait_until(lambda: _left_running(stack) == [], 30), _left_running(stack)
    assert _pid_files(stack) == []
    st = json.loads(stack.kvp("status", stack.config, "--json").stdout)
    assert st["lmcache"]["state"] == "absent" and st["vllm"]["state"] == "absent", st
