#!/usr/bin/env python3
"""Where the server's L2 -> L1 prefetch spends its time: ``perf record -a`` filtered by the
running ``lmcache server``'s pid (all its threads) while every stored sequence is looked up
once after the page cache was dropped (``preread``: and the files then pre-read into it);
docs/benchmarks.md, "L2 read path A/B".

    python bench/profile_prefetch.py [--seqs 16] [--variants default,no serde] [--out F.json]

Uses the fills and rounds of bench/l2_read_ab.py. Reports per variant the share of samples
per shared object (libcrypto = the aesgcm decrypt, the kernel = reads and page faults,
libc = memcpy, python = the server's own code), the top symbols, and the server's CPU time
(all threads, user + system) during the lookups beside their wall time, and the time its
threads spent runnable but waiting for a CPU (schedstat): what is left of the wall time is
waiting for I/O or for each other.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from l2_read_ab import PREFETCH_RE, Variant, layout, loadavg, run_preread  # noqa: E402
from persistence_bench import (  # noqa: E402
    BENCH_SPEC,  # noqa: E402
    drop_caches,
    kvp,
)

from kvpersist.demo.kvdriver import connect  # noqa: E402


def server_pid(v: Variant) -> int:
    pid_file = v.log.parent.parent / "pids" / "cpu-demo.lmcache.pid"
    return int(pid_file.read_text().split()[0])


def schedstat(pid: int) -> dict[int, tuple[int, int]]:
    """Per thread of ``pid``: (ns on a CPU, ns runnable but waiting for a CPU), from
    /proc/PID/task/TID/schedstat."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            on, wait, _ = (Path(task) / "schedstat").read_text().split()
        except (OSError, ValueError):
            continue
        out[int(task.name)] = (int(on), int(wait))
    return out


def _samples(report: str) -> int:
    """The sample count in a ``perf report`` header (``# Samples: 84  of event ...``)."""
    for line in report.splitlines():
        if line.startswith("# Samples:"):
            n = line.split(":", 1)[1].split()[0]
            return int(float(n[:-1]) * 1000) if n.endswith("K") else int(n)
    return 0


def shares(report: str) -> list[tuple[str, float]]:
    """(name, percent) rows of ``perf report --stdio`` output."""
    out = []
    for line in report.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[0].endswith("%"):
            out.append((parts[1].strip(), float(parts[0][:-1])))
    return out


def profile(v: Variant, tmp: Path) -> dict[str, Any]:
    kvp(v.env, "launch", "cpu-demo", "--no-vllm")
    offset = v.log.stat().st_size
    data = tmp / f"perf-{v.dir.name}.data"
    try:
        pid = server_pid(v)
        drop_caches()
        load = loadavg()
        pre = run_preread(v.root, v.ns) if v.label.startswith("preread") else None
        # system-wide (-a; attaching with -p records nothing on this VM), filtered below
        perf = subprocess.Popen(["perf", "record", "-a", "-F", "499", "-g",
                                 "-o", str(data)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        time.sleep(1.0)
        proc = psutil.Process(pid)
        with connect(v.rpc, v.http, v.ns, num_tokens=v.tokens,
                     kvcache_shape_spec=BENCH_SPEC) as d:
            c0, q0, t0 = proc.cpu_times(), schedstat(pid), time.perf_counter()
            for s in range(1, v.seqs + 1):
                d.lookup(s)
            c1, q1, wall = proc.cpu_times(), schedstat(pid), time.perf_counter() - t0
        perf.send_signal(signal.SIGINT)
        perf.wait(timeout=60)
    finally:
        kvp(v.env, "stop", "cpu-demo")
    with open(v.log, "rb") as f:
        f.seek(offset)
        found = PREFETCH_RE.findall(f.read().decode(errors="replace"))
    prefetch_s = sum(float(ms) for _, ms in found) / 1000
    # percentages of the server's own samples
    report = ["perf", "report", "-i", str(data), "--stdio", "--no-children", "--pid", str(pid),
              "--percentage", "relative", "-g", "none"]
    by_dso = subprocess.run([*report, "--sort", "dso"], capture_output=True, text=True).stdout
    by_sym = subprocess.run([*report, "--sort", "dso,sym"], capture_output=True,
                            text=True).stdout
    dso = shares(by_dso)
    grouped: Counter[str] = Counter()
    for name, pct in dso:
        key = ("python" if "python" in name else
               "aes-gcm (cryptography's _rust)" if "libcrypto" in name or "_rust" in name else
               "kernel" if "kernel" in name else "libc" if "libc" in name else
               "torch" if "torch" in name else "nixl" if "nixl" in name or "plugin" in name
               else "other")
        grouped[key] += pct
    cpu_s = (c1.user - c0.user) + (c1.system - c0.system)
    return {"variant": v.label, "load": load, "preread": pre, "prefetch_s": round(prefetch_s, 3),
            "lookup_wall_s": round(wall, 3), "server_cpu_s": round(cpu_s, 3),
            "server_on_cpu_s": round(sum(q1[t][0] - q0.get(t, (0, 0))[0] for t in q1) / 1e9, 3),
            "server_runqueue_wait_s": round(
                sum(q1[t][1] - q0.get(t, (0, 0))[1] for t in q1) / 1e9, 3),
            "server_samples": _samples(by_dso),
            "mb": round(v.nbytes / 1e6, 1),
            "by_group_pct": {k: round(x, 1) for k, x in grouped.most_common()},
            "by_dso_pct": dso[:12], "top_symbols_pct": shares(by_sym)[:20]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--variants", default="default,no serde")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    out: dict[str, Any] = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "runs": []}
    with tempfile.TemporaryDirectory(prefix="kvp-prof-", dir="/var/tmp") as d:
        tmp = Path(d)
        done: list[Variant] = []
        for label in [x.strip() for x in args.variants.split(",") if x.strip()]:
            like = next((o for o in done if layout(o.label) == layout(label)), None)
            v = Variant(tmp, label, args.seqs, 2048, like)
            done.append(v)
            out["runs"].append(profile(v, tmp))
            print(json.dumps(out["runs"][-1]), file=sys.stderr)
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
