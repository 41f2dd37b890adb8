"""Paired, alternating whole-process runs of commands against the first one.

    python bench/paired_runs.py [--runs N] [--warmup N] [--prepare NAME=CMD]... \\
        [--json OUT] NAME=CMD NAME=CMD...

Each round runs every command once, in turn (after its ``--prepare`` command, untimed), and
records wall time and CPU time (user + system of the process and its children, from
``wait4``). The ratios are the medians of the per-round ratios against the first command,
so a change of the machine's load between rounds affects both sides of a ratio alike. On a
busy machine the CPU-time ratio is the steadier figure. Commands run without a shell.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import time


def run_once(argv: list[str]) -> tuple[float, float]:
    """Wall and CPU seconds of one run of ``argv`` (its output discarded)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{shlex.join(argv)} exited {proc.returncode}")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--prepare", action="append", default=[], metavar="NAME=CMD")
    ap.add_argument("--json", dest="out")
    ap.add_argument("commands", nargs="+", metavar="NAME=CMD")
    args = ap.parse_args()
    cmds = [c.split("=", 1) for c in args.commands]
    prep = dict(p.split("=", 1) for p in args.prepare)
    times: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in cmds}
    for i in range(args.warmup + args.runs):
        for name, cmd in cmds:
            if name in prep:
                subprocess.run(shlex.split(prep[name]), check=True)
            t = run_once(shlex.split(cmd))
            if i >= args.warmup:
                times[name].append(t)
    base = cmds[0][0]
    result = {"runs": args.runs, "base": base, "commands": {}}
    print(f"{'command':34} {'wall median':>12} {'cpu median':>11} "
          f"{'wall ratio':>11} {'cpu ratio':>10}   ({base} / command, per-round medians)")
    for name, cmd in cmds:
        wall = [t[0] for t in times[name]]
        cpu = [t[1] for t in times[name]]
        wr = statistics.median(b[0] / t[0] for b, t in zip(times[base], times[name],
                                                             strict=True))
        cr = statistics.median(b[1] / t[1] for b, t in zip(times[base], times[name],
                                                             strict=True))
        result["commands"][name] = {"command": cmd, "wall_s": wall, "cpu_s": cpu,
                                    "wall_ratio": wr, "cpu_ratio": cr}
        print(f"{name:34} {statistics.median(wall) * 1000:10.1f}ms "
              f"{statistics.median(cpu) * 1000:9.1f}ms {wr:10.3f}x {cr:9.3f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
