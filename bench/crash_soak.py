"""Soak: kill -9 the cache server in the middle of store bursts, many times, and audit every
file it published by authentication (not by size).

Each cycle, in each lane (an independent cpu-demo deployment on its own temp cache root and
loopback ports; lanes run side by side to fit the run into the time available):

1. the crash-window check exactly as ``kvp-admin launch`` runs it
   (:func:`kvpersist.stack.launch.check_crash_window`: unclean stop → verify the files written
   since the last launch, quarantine those that fail), then the server is started
   (:func:`kvpersist.stack.processes.start_server`);
2. a store-burst client (LMCache's own multiprocess client, ``bench/_soak_client.py``, started
   ahead) stores sequences; after a random 0.1-0.8 s the server gets SIGKILL;
3. audit: every chunk file published since the cycle started is authenticated with the
   deployment's key (``verify_root(since_ns=...)``, no quarantine) and its size compared with
   the frame size.

At the end each lane launches once more, looks up (and retrieves) every completed sequence
and compares the retrieved bytes with what was stored, stops cleanly, and runs a full verify.

usage: python bench/crash_soak.py [--cycles 200] [--lanes 2] [--out FILE]
Prints and writes (``--out``) one JSON document with the totals and each lane's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FRAME_SIZE = 528384  # the cpu-demo (tiny) chunk as an aesgcm frame, padded to 4 KiB


def _env(root: Path) -> dict[str, str]:
    from kvpersist.system.procs import free_port
    from tests.integration._prefetch_faults import lab_env

    return lab_env(root, free_port)


def _client(env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(REPO / "bench" / "_soak_client.py")],
                            cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True,
                            env=dict(env, PYTHONPATH=str(REPO)))


_LOG_LOCK = threading.Lock()


def lane(idx: int, cycles: int, tmp: Path, seed: int, out: dict[str, Any],
         log: Path | None = None) -> None:
    from kvpersist.demo.kvdriver import connect
    from kvpersist.l2.keys import store as keys
    from kvpersist.l2.tree import open_root
    from kvpersist.l2.verify.root import verify_root
    from kvpersist.stack import launch as lc
    from kvpersist.stack import processes as proc
    from kvpersist.stack.launch_plan import prepare_launch
    from kvpersist.stack.preflight import preflight
    from kvpersist.system import procs

    root = tmp / f"lane{idx}" / "cache"
    root.parent.mkdir(parents=True)
    root.mkdir(mode=0o700)
    env = _env(root)
    p = prepare_launch("cpu-demo", environ=env)
    plan = p.plan
    pre = preflight(p.dep, plan, p.sizing, with_vllm=False)
    assert not pre.problems, pre.problems
    lc.prepare_state(plan, p.rendered, p.sizing, weights=pre.weights)
    key = keys.read_key(plan.serde_key_file)
    rng = random.Random(seed)
    stored: dict[int, list[str]] = {}
    t = {"cycles": 0, "files_published": 0, "torn_by_size": 0, "failing_authentication": 0,
         "quarantined_at_launch": 0, "crash_checks": 0, "crash_check_files": 0,
         "crash_check_seconds": 0.0, "sequences_stored": 0, "stale_padding_files": 0}
    client = _client(env)
    t0 = time.monotonic()
    try:
        for cyc in range(cycles):
            since = time.time_ns()
            crash = lc.check_crash_window(plan, proc.server_state(plan), how="soak")
            if crash.ran:
                t["crash_checks"] += 1
                t["crash_check_files"] += crash.files
                t["crash_check_seconds"] += crash.seconds
            t["quarantined_at_launch"] += len(crash.quarantined)
            srv = proc.start_server(plan, timeout=120)
            assert client.stdin is not None and client.stdout is not None
            client.stdin.write(f"tcp://127.0.0.1:{plan.listen['lmcache'][1]} "
                               f"{plan.server_http_url} {plan.namespace} {100000 * cyc}\n")
            client.stdin.flush()
            first = client.stdout.readline()
            time.sleep(rng.uniform(0.1, 0.8))
            assert srv.pid is not None
            os.kill(srv.pid, signal.SIGKILL)
            procs.wait_for(lambda pid=srv.pid: not procs.alive(pid), 20, 0.1)
            client.kill()
            rest, _ = client.communicate(timeout=30)
            client = _client(env)  # the next cycle's, importing while this one is audited
            for line in [first, *rest.splitlines()]:
                if line.strip():
                    rec = json.loads(line)
                    stored[rec["seq"]] = rec["digests"]
                    t["sequences_stored"] += 1
            with open_root(root, purpose="verify") as handle:
                v = verify_root(handle, plan.namespace, key=key, rate_mb_s=None, since_ns=since)
            t["files_published"] += v.files
            t["failing_authentication"] += sum(f.kind == "auth" for f in v.findings)
            t["torn_by_size"] += sum(f.kind == "size" for f in v.findings)
            t["stale_padding_files"] += _stale_padding(root, since)
            t["cycles"] += 1
            if log is not None:
                with _LOG_LOCK, log.open("a") as f:
                    f.write(json.dumps({"lane": idx, "cycle": cyc, "at": round(
                        time.monotonic() - t0, 1), **t}, sort_keys=True) + "\n")
        client.kill()
        client.wait()
        # the end: launch (crash check), every completed sequence looked up, a clean stop
        crash = lc.check_crash_window(plan, proc.server_state(plan), how="soak-final")
        t["quarantined_at_launch"] += len(crash.quarantined)
        proc.start_server(plan, timeout=120)
        full = same = 0
        with connect(f"tcp://127.0.0.1:{plan.listen['lmcache'][1]}", plan.server_http_url,
                     plan.namespace) as d:
            for seq, digests in sorted(stored.items()):
                lk, got = d.lookup_and_retrieve(seq)
                if lk.hit_chunks == lk.total_chunks:
                    full += 1
                    same += got == digests
        stop = proc.stop_server(plan, timeout=60)
        with open_root(root, purpose="verify") as handle:
            final = verify_root(handle, plan.namespace, key=key, rate_mb_s=None)
        t.update({"lookups": len(stored), "full_hits": full, "full_hits_identical": same,
                  "final_stop": stop.how, "final_files": final.files,
                  "final_authenticated": final.authenticated,
                  "final_findings": len(final.findings),
                  "quarantine_dir_files": len(list((root / ".kvpersist" / "quarantine").glob(
                      "*"))) if (root / ".kvpersist" / "quarantine").is_dir() else 0,
                  "seconds": round(time.monotonic() - t0, 1)})
    finally:
        client.kill()
        st = proc.server_state(plan)
        if st.running and st.pid:
            procs.stop_process(st.pid, timeout=30)
        out[f"lane{idx}"] = t


def _stale_padding(root: Path, since: int) -> int:
    """Files published since ``since`` whose 4 KiB padding after the frame is not zero
    (LMCache writes stale L1 bytes there; a valid frame nonetheless)."""
    end = 1 + 12 + 524288 + 16
    n = 0
    for f in root.glob("*.bin"):
        st = f.stat()
        if st.st_mtime_ns >= since and st.st_size == FRAME_SIZE:
            with open(f, "rb") as fh:
                fh.seek(end)
                n += any(fh.read())
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=200, help="cycles in all (split over lanes)")
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--log", type=Path, help="append each lane's running totals per cycle")
    a = ap.parse_args()
    per = [a.cycles // a.lanes + (i < a.cycles % a.lanes) for i in range(a.lanes)]
    out: dict[str, Any] = {}
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvp-soak-") as tmp:
        threads = [threading.Thread(target=lane, args=(i, n, Path(tmp), 1000 + i, out, a.log))
                   for i, n in enumerate(per)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    keys_ = ["cycles", "files_published", "torn_by_size", "failing_authentication",
             "quarantined_at_launch", "crash_checks", "crash_check_files", "sequences_stored",
             "stale_padding_files", "lookups", "full_hits", "full_hits_identical",
             "final_files", "final_authenticated", "final_findings"]
    total = {k: sum(int(v.get(k, 0)) for v in out.values()) for k in keys_}
    doc = {"schema": "kvpersist.crash-soak/1", "seconds": round(time.monotonic() - t0, 1),
           "lanes": a.lanes, "total": total, "per_lane": out}
    text = json.dumps(doc, indent=2, sort_keys=True)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
