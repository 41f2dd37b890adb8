#!/usr/bin/env python3
"""Inventory benchmark: ``kvp-admin report --json`` vs ``du``, and ``prune`` vs ``find -delete``.

On the same synthetic tree (bench/gen_tree.py), in the same run, alternating the two tools
round by round (page cache warm; the first run of each is a discarded warm-up):

* scan: ``kvp-admin report --root R --json`` vs ``du -s --apparent-size -b R``: wall time
  (median of rounds), and peak RSS of the report (largest single process from wait4, and the
  sum over its process tree sampled every 10 ms);
* prune: ``kvp-admin prune --root R --namespace NS --apply`` vs
  ``find R -name 'NS_*' -type f -delete`` on one namespace (refilled before each run).

    python bench/bench_inventory.py /var/tmp/kvbench --files 1000000 --rounds 5
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
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

import psutil  # noqa: E402
from gen_tree import generate, namespaces  # noqa: E402

KVP = [sys.executable, "-m", "kvpersist.cli"]


def run_timed(argv: list[str], *, sample_tree: bool = False) -> dict[str, Any]:
    """Run argv (stdout discarded); wall seconds, exit code, peak RSS (bytes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=REPO,
                            env=env)
    tree_peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal tree_peak
        try:
            p = psutil.Process(proc.pid)
        except psutil.Error:
            return
        while not stop.is_set():
            try:
                procs = [p, *p.children(recursive=True)]
                tree_peak = max(tree_peak, sum(q.memory_info().rss for q in procs))
            except psutil.Error:
                pass
            stop.wait(0.01)

    th = threading.Thread(target=sample, daemon=True) if sample_tree else None
    if th:
        th.start()
    _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    stop.set()
    if th:
        th.join()
    proc.returncode = os.waitstatus_to_exitcode(status)
    err = proc.stderr.read().decode() if proc.stderr else ""
    if proc.returncode != 0:
        raise RuntimeError(f"{argv} failed ({proc.returncode}): {err[-2000:]}")
    return {"wall_s": wall, "maxrss_bytes": ru.ru_maxrss * 1024, "tree_rss_bytes": tree_peak}


def bench_scan(root: Path, rounds: int) -> dict[str, Any]:
    du = ["du", "-s", "--apparent-size", "-b", str(root)]
    rep = [*KVP, "report", "--root", str(root), "--json"]
    run_timed(du)
    run_timed(rep)  # warm-up
    du_t, rep_t = [], []
    for _ in range(rounds):
        du_t.append(run_timed(du)["wall_s"])
        rep_t.append(run_timed(rep)["wall_s"])
    mem = run_timed(rep, sample_tree=True)
    du_med, rep_med = statistics.median(du_t), statistics.median(rep_t)
    return {
        "du_s": du_t, "report_s": rep_t,
        "du_median_s": du_med, "report_median_s": rep_med,
        "ratio_median": rep_med / du_med,
        "ratio_best": min(rep_t) / min(du_t),
        "report_peak_rss_bytes": mem["maxrss_bytes"],
        "report_tree_rss_bytes": mem["tree_rss_bytes"],
    }


def bench_prune(root: Path, ns: str, files: int, rounds: int, shard: bool,
                jobs: int) -> dict[str, Any]:
    prune = [*KVP, "prune", "--root", str(root), "--namespace", ns, "--apply", "--json"]
    find = ["find", str(root), *([] if shard else ["-maxdepth", "1"]), "-name", f"{ns}_*",
            "-type", "f", "-delete"]
    kvp_t: list[float] = []
    find_t: list[float] = []
    for _ in range(rounds):
        for argv, acc in ((prune, kvp_t), (find, find_t)):
            generate(root, files, n_namespaces=4, shard_dirs=shard, jobs=jobs, only=ns)
            subprocess.run(["sync"], check=False)
            acc.append(run_timed(argv)["wall_s"])
    k, f = statistics.median(kvp_t), statistics.median(find_t)
    return {"prune_s": kvp_t, "find_s": find_t, "prune_median_s": k, "find_median_s": f,
            "ratio_median": k / f, "ratio_best": min(kvp_t) / min(find_t)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--files", type=int, default=1_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prune-rounds", type=int, default=3)
    ap.add_argument("--shard-dirs", action="store_true")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--skip-prune", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the tree afterwards")
    ap.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    a = ap.parse_args()

    root = a.workdir / ("tree-shard" if a.shard_dirs else "tree-flat")
    marker = root / f".generated-{a.files}"
    if not marker.exists():
        shutil.rmtree(root, ignore_errors=True)
        t = time.perf_counter()
        n = generate(root, a.files, n_namespaces=4, shard_dirs=a.shard_dirs, jobs=a.jobs)
        print(f"generated {n:,} files in {time.perf_counter() - t:.1f} s", file=sys.stderr)
        marker.touch()
    # the namespace pruned: the second pinned one (TP2, no temp files): files/4 files
    ns = namespaces(4)[1][0]
    result: dict[str, Any] = {
        "files": a.files, "layout": "shard_dirs" if a.shard_dirs else "flat",
        "cpus": os.cpu_count(), "python": platform.python_version(),
        "kernel": platform.release(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    result["loadavg_before"] = os.getloadavg()
    result["scan"] = bench_scan(root, a.rounds)
    print(json.dumps(result["scan"], indent=1), file=sys.stderr)
    if not a.skip_prune:
        result["prune"] = bench_prune(root, ns, a.files // 4, a.prune_rounds, a.shard_dirs,
                                      a.jobs)
        result["prune"]["namespace_files"] = a.files // 4
        # leave the tree complete
        generate(root, a.files // 4, n_namespaces=4, shard_dirs=a.shard_dirs, jobs=a.jobs,
                 only=ns)
    result["loadavg_after"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")
    if not a.keep:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
