#!/usr/bin/env python3
"""One start-to-serving-and-stop cycle of the demo deployment, as one whole process, so that
an outside timer can pair kvpersist against the bare processes (docs/benchmarks.md,
"Restart downtime").

    python bench/serve_cycle.py kvpersist|bare WORKDIR

WORKDIR is a ``bench/restart_downtime.py --workdir`` directory after its run (the demo model,
its config, its cache root). ``kvpersist``: ``kvp-admin launch CONFIG --no-warmup`` (preflight,
the crash-window check, the cache server and vLLM started together; it returns when vLLM
serves the namespace), then ``kvp-admin stop CONFIG``. ``bare``: the very argv and environment
kvpersist renders for ``lmcache server`` and vLLM, started by hand at once, vLLM's readiness
polled every 0.1 s (``/health`` and the namespace listed), then SIGTERM to vLLM and to the
server, each waited for to its exit. Exit 0 when the cycle served.
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from restart_downtime import _sigterm_to_exit, bench_env  # noqa: E402

from kvpersist.stack.launch_plan import prepare_launch  # noqa: E402
from kvpersist.stack.processes import vllm_ready  # noqa: E402

KVP = [sys.executable, "-m", "kvpersist.cli"]


def main() -> int:
    mode, wd = sys.argv[1], Path(sys.argv[2])
    config = str(wd / "config-demo" / "identity.env")
    env = bench_env(wd / "cache", glob.glob(f"{wd}/hub/models--*/snapshots/*")[0],
                    wd / "warm.jsonl")
    # fixed ports: the cycles must find the same deployment every time
    env.update({"KVP_LMCACHE_PORT": "25561", "KVP_LMCACHE_HTTP_PORT": "25562",
                "KVP_VLLM_PORT": "25563"})
    if mode == "kvpersist":
        for args in (["launch", config, "--no-warmup"], ["stop", config]):
            r = subprocess.run([*KVP, *args], env=env, cwd=REPO, capture_output=True,
                               timeout=900)
            if r.returncode != 0:
                sys.stderr.write(r.stderr.decode(errors="replace"))
                return 1
        return 0
    plan = prepare_launch(config, environ=env).plan
    logs = wd / "logs"
    logs.mkdir(exist_ok=True)
    with open(logs / "cycle-server.log", "ab") as slog, \
            open(logs / "cycle-vllm.log", "ab") as vlog:
        srv = subprocess.Popen(plan.server_argv, env=plan.server_env, cwd=plan.state_dir,
                               stdout=slog, stderr=subprocess.STDOUT, start_new_session=True)
        vl = subprocess.Popen(plan.vllm_argv, env=plan.vllm_env, cwd=plan.model_link_dir,
                              stdout=vlog, stderr=subprocess.STDOUT, start_new_session=True)
    served = False
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and vl.poll() is None:
            if vllm_ready(plan, 1.0):
                served = True
                break
            time.sleep(0.1)
    finally:
        for p in (vl, srv):  # each and what it started, to its exit
            with contextlib.suppress(subprocess.TimeoutExpired, OSError):
                _sigterm_to_exit(p, timeout=120)
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return 0 if served else 1


if __name__ == "__main__":
    raise SystemExit(main())
