#!/usr/bin/env python3
"""Where vLLM's first request for logprobs spends its seconds on the CPU build.

vLLM computes the rank of each sampled token with ``batched_count_greater_than``
(``vllm/v1/sample/ops/logprobs.py``), a function under ``torch.compile`` that is compiled at its
first call: at the first request that asks for logprobs, which after a kvpersist launch is the
canary's (docs/benchmarks.md, "The canary's seconds"). This script calls vLLM's own function
in a fresh process, as the engine does at that request (a float32 row per request, the
vocabulary's width), under cProfile, and splits the first call's time into the parts the
profile names: Inductor's check of the CPU's vector instruction sets (it compiles a test
program per instruction set and loads each in a child process), the cache keys (hashes of
torch's and Triton's sources), and the rest (tracing, loading the compiled kernel from the
Inductor cache). Then the same call again, and at two more batch sizes.

Usage: python bench/logprobs_compile_probe.py [--runs 3] [--vocab 32000] [--out FILE]

Each run is a fresh process (``--child``); the first run of a machine also fills Inductor's
cache (``TORCHINDUCTOR_CACHE_DIR`` or /tmp/torchinductor_USER), so its first call is the
slowest; the later runs show what every start of vLLM pays with a warm cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: profile entries whose cumulative time is one part of the first call
PARTS = {
    "vector_isa_check": "cpu_vec_isa.py:valid_vec_isa_list",
    "cache_keys": "autograd_cache.py:autograd_cache_key",
}


def child(vocab: int) -> dict[str, Any]:
    import cProfile
    import pstats

    t0 = time.perf_counter()
    import torch
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than
    imported = time.perf_counter() - t0

    def call(rows: int) -> float:
        x = torch.randn(rows, vocab, dtype=torch.float32)
        values = x[:, :1].clone()
        t = time.perf_counter()
        batched_count_greater_than(x, values)
        return time.perf_counter() - t

    prof = cProfile.Profile()
    prof.enable()
    first = call(1)
    prof.disable()
    stats = pstats.Stats(prof)
    parts: dict[str, float] = {}
    for name, needle in PARTS.items():
        file_part, func = needle.split(":")
        parts[name] = round(sum(
            v[3] for (path, _line, fn), v in stats.stats.items()  # type: ignore[attr-defined]
            if path.endswith(file_part) and fn == func), 3)
    return {"import_s": round(imported, 3), "first_s": round(first, 3), "parts": parts,
            "rest_s": round(first - sum(parts.values()), 3),
            "again_s": round(call(1), 4), "rows_3_s": round(call(3), 3),
            "rows_5_s": round(call(5), 4)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--out", default="")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.vocab)))
        return 0
    runs = []
    for i in range(args.runs):
        r = subprocess.run([sys.executable, __file__, "--child", "--vocab", str(args.vocab)],
                           capture_output=True, text=True, timeout=600, check=True)
        rec = json.loads(r.stdout.strip().splitlines()[-1])
        runs.append(rec)
        print(f"run {i + 1}: first call {rec['first_s']:.2f} s (vector-ISA check "
              f"{rec['parts']['vector_isa_check']:.2f} s, cache keys "
              f"{rec['parts']['cache_keys']:.2f} s, rest {rec['rest_s']:.2f} s); again "
              f"{rec['again_s'] * 1e3:.1f} ms; 3 rows {rec['rows_3_s']:.2f} s; 5 rows "
              f"{rec['rows_5_s'] * 1e3:.1f} ms", flush=True)
    later = runs[1:] or runs
    doc = {"schema": "kvpersist.bench.logprobs-compile/1", "vocab": args.vocab, "runs": runs,
           "later_first_s_median": round(statistics.median(r["first_s"] for r in later), 3)}
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
