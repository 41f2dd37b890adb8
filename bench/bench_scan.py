#!/usr/bin/env python3
"""Scan benchmark: ``kvp-admin report --json`` against ``du -s --apparent-size -b``.

Paired alternating whole-process runs on one synthetic tree (bench/gen_tree.py; generated if
missing, reused otherwise): each round runs both commands once, back to back, the order
alternating from round to round (du first, then report first, ...), so a change of the
machine's load between rounds affects both sides of a round's ratio alike. One discarded
warm-up run of each first (page cache warm). Per run: wall time, CPU time (user + system of
the process and its children, from ``wait4``), peak RSS (``ru_maxrss`` from ``wait4``: the
largest single process; Linux keeps a forked child's figure across exec, so it is never below
this benchmark process's own RSS), the 1-minute load average and the runnable tasks just before it.
The report's ``total_bytes`` is checked against du's number in every round. One last report
run samples the RSS of its whole process tree every 10 ms.

    python bench/bench_scan.py /var/tmp/kvbench --files 1000000 --rounds 7 \\
        --out bench/results/scan-1M.json

The interpreter writes its bytecode cache as an installed package would (a
``PYTHONDONTWRITEBYTECODE`` of the caller is not passed on), and ``KVP_*`` variables are
dropped, so the report sees only ``--root``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if not k.startswith("KVP_") and k != "PYTHONDONTWRITEBYTECODE"}


def _runnable() -> int:
    with open("/proc/loadavg") as f:
        return int(f.read().split()[3].split("/")[0])


def run(argv: list[str], *, sample_tree: bool = False) -> dict[str, Any]:
    """One whole-process run of ``argv``: its stdout, wall and CPU seconds, peak RSS."""
    with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f:
        load, runnable = os.getloadavg()[0], _runnable()
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=out_f, stderr=err_f, cwd=REPO, env=_env())
        stop = threading.Event()
        peak = [0]
        th = threading.Thread(target=_sample_tree, args=(proc.pid, stop, peak), daemon=True)
        if sample_tree:
            th.start()
        _, status, ru = os.wait4(proc.pid, 0)  # this child's own resource usage
        wall = time.perf_counter() - t0
        stop.set()
        if sample_tree:
            th.join()
        proc.returncode = code = os.waitstatus_to_exitcode(status)
        out_f.seek(0)
        err_f.seek(0)
        out, err = out_f.read(), err_f.read()
    if code != 0:
        raise RuntimeError(f"{argv} failed ({code}): {err.decode()[-2000:]}")
    return {"wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime, "user_s": ru.ru_utime,
            "sys_s": ru.ru_stime, "maxrss_bytes": ru.ru_maxrss * 1024,
            "tree_rss_bytes": peak[0], "loadavg1": load, "runnable": runnable,
            "stdout": out.decode()}


def _sample_tree(pid: int, stop: threading.Event, peak: list[int]) -> None:
    """Peak of the summed RSS of ``pid`` and its children, sampled every 10 ms."""
    import psutil

    try:
        p = psutil.Process(pid)
    except psutil.Error:
        return
    while not stop.is_set():
        try:
            procs = [p, *p.children(recursive=True)]
            peak[0] = max(peak[0], sum(q.memory_info().rss for q in procs))
        except psutil.Error:
            pass
        stop.wait(0.01)


def bench(root: Path, rounds: int, python: str) -> dict[str, Any]:
    du = ["du", "-s", "--apparent-size", "-b", str(root)]
    rep = [python, "-m", "kvpersist.cli", "report", "--root", str(root), "--json"]
    run(du)
    run(rep)  # warm-up (and the bytecode cache)
    pairs = []
    for i in range(rounds):
        order = (("du", du), ("report", rep)) if i % 2 == 0 else (("report", rep), ("du", du))
        r = {name: run(argv) for name, argv in order}
        du_bytes = int(r["du"].pop("stdout").split()[0])
        doc = json.loads(r["report"].pop("stdout"))
        if doc["total_bytes"] != du_bytes:
            raise SystemExit(f"round {i}: report total {doc['total_bytes']} != du {du_bytes}")
        r["report"]["scan_duration_s"] = doc["duration_s"]
        r["first"] = order[0][0]
        r["ratio_wall"] = r["report"]["wall_s"] / r["du"]["wall_s"]
        r["ratio_cpu"] = r["report"]["cpu_s"] / r["du"]["cpu_s"]
        pairs.append(r)
        print(f"round {i}: du {r['du']['wall_s']:.2f} s, report {r['report']['wall_s']:.2f} s "
              f"(ratio {r['ratio_wall']:.2f}x wall, {r['ratio_cpu']:.2f}x cpu), load "
              f"{r['du']['loadavg1']:.2f}, runnable {r['report']['runnable']}", file=sys.stderr)
    mem = run(rep, sample_tree=True)
    mem.pop("stdout")
    walls = [p["ratio_wall"] for p in pairs]
    cpus = [p["ratio_cpu"] for p in pairs]
    loads = [p[k]["loadavg1"] for p in pairs for k in ("du", "report")]
    return {
        "pairs": pairs,
        "ratio_wall_median": statistics.median(walls),
        "ratio_wall_min": min(walls), "ratio_wall_max": max(walls),
        "ratio_cpu_median": statistics.median(cpus),
        "du_wall_median_s": statistics.median(p["du"]["wall_s"] for p in pairs),
        "report_wall_median_s": statistics.median(p["report"]["wall_s"] for p in pairs),
        "report_maxrss_bytes": max(p["report"]["maxrss_bytes"] for p in pairs),
        "report_tree_rss_bytes": mem["tree_rss_bytes"],
        "loadavg1_median": statistics.median(loads),
        "loadavg1_min": min(loads), "loadavg1_max": max(loads),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--files", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--python", default=sys.executable, help="interpreter for the report")
    ap.add_argument("--out", type=Path, default=None, help="write the raw results here (JSON)")
    a = ap.parse_args()
    root = a.workdir / "tree-flat"
    marker = root / f".generated-{a.files}"
    if not marker.exists():
        shutil.rmtree(root, ignore_errors=True)
        t = time.perf_counter()
        # in a child: the generator's name lists would otherwise stay in this process's
        # ru_maxrss, which a forked-and-exec'd command inherits
        subprocess.run([sys.executable, str(HERE / "gen_tree.py"), str(root), "--files",
                        str(a.files), "--namespaces", "4", "--jobs", str(a.jobs)], check=True)
        print(f"generated the tree in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        marker.touch()
    result: dict[str, Any] = {
        "files": a.files, "layout": "flat", "cpus": os.cpu_count(),
        "python": platform.python_version(), "kernel": platform.release(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "scan": bench(root, a.rounds, a.python),
    }
    s = result["scan"]
    print(f"report / du wall: median {s['ratio_wall_median']:.2f}x (min "
          f"{s['ratio_wall_min']:.2f}x, max {s['ratio_wall_max']:.2f}x), cpu median "
          f"{s['ratio_cpu_median']:.2f}x; peak RSS {s['report_maxrss_bytes'] / 1e6:.1f} MB "
          f"(tree {s['report_tree_rss_bytes'] / 1e6:.1f} MB); load {s['loadavg1_min']:.1f}-"
          f"{s['loadavg1_max']:.1f}", file=sys.stderr)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
