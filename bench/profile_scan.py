#!/usr/bin/env python3
"""Where a scan's time goes: floors measured in-process on one tree, next to ``du``.

    python bench/profile_scan.py ROOT [--rounds 3]

Prints, per stage (best of the rounds, seconds):
  du            du -s --apparent-size -b ROOT (subprocess, for reference)
  names         os.scandir over the root only (getdents + one DirEntry per entry)
  names+lstat   the same plus one lstat per regular file (what du does, from Python)
  scan w=1      kvpersist.l2.scan.scan_root, one process, no histogram (what report runs)
  scan w=2      the same split over two processes
  scan+hist     one process with the last-use histogram (what prune --to-budget runs)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpersist.l2.scan import scan_root  # noqa: E402
from kvpersist.l2.tree import open_root  # noqa: E402


def best(fn: Callable[[], object], rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root")
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    root = a.root

    def du() -> None:
        subprocess.run(["du", "-s", "--apparent-size", "-b", root], check=True,
                       stdout=subprocess.DEVNULL)

    def names() -> None:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with os.scandir(fd) as it:
                for _ in it:
                    pass
        finally:
            os.close(fd)

    def names_lstat() -> None:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with os.scandir(fd) as it:
                for e in it:
                    if e.is_file(follow_symlinks=False):
                        e.stat(follow_symlinks=False)
        finally:
            os.close(fd)

    def scan(*, workers: int, hist: bool) -> None:
        with open_root(root, purpose="scan") as handle:  # the opening, as report counts it
            scan_root(handle, workers=workers, hist=hist)

    stages = {
        "du": du,
        "names": names,
        "names+lstat": names_lstat,
        "scan w=1": lambda: scan(workers=1, hist=False),
        "scan w=2": lambda: scan(workers=2, hist=False),
        "scan+hist": lambda: scan(workers=1, hist=True),
    }
    out = {"root": root, "loadavg_before": os.getloadavg()}
    for label, fn in stages.items():
        out[label] = round(best(fn, a.rounds), 3)
        print(f"{label:12s} {out[label]:8.3f} s", file=sys.stderr)
    out["loadavg_after"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
