#!/usr/bin/env python3
"""Where the time of ``kvp-admin launch`` goes, phase by phase (docs/benchmarks.md, "First
chat after a restart").

    python bench/launch_trace.py WORKDIR [--dtype float32] [--rounds 2] [--code DIR]

WORKDIR is a ``bench/first_chat_restart.py --workdir`` directory after its run (the demo
model, the deployment of ``--dtype``, both chats stored). Per round, from everything stopped:
``kvp-admin launch CONFIG`` whole process (the kvpersist of ``--code``, default this
checkout), every progress line it writes to stderr time-stamped on arrival (seconds since the
launch began), vLLM's readiness polled every 0.05 s beside it ("vLLM serves"), the launch's
exit ("ready"), then the warm-set user's first streamed token; then ``kvp-admin stop``.
One block per round: each line's time and the line; at the end the JSON of the phases.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from first_chat_restart import Deployment  # noqa: E402
from restart_downtime import kvp  # noqa: E402

from kvpersist.demo.chat import chat_completion, long_chat  # noqa: E402
from kvpersist.demo.model import generate_model  # noqa: E402
from kvpersist.stack.processes import vllm_ready  # noqa: E402


def trace(dep: Deployment, code: Path) -> dict[str, Any]:
    t0 = time.monotonic()
    serving: list[float] = []

    def poll() -> None:
        while not serving and time.monotonic() - t0 < 600:
            if vllm_ready(dep.plan, 1.0):
                serving.append(time.monotonic() - t0)
                return
            time.sleep(0.05)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    p = subprocess.Popen([sys.executable, "-m", "kvpersist.cli", "launch", dep.config],
                         env={**dep.env, "PYTHONPATH": str(code)}, cwd=code,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []
    assert p.stderr is not None
    for line in p.stderr:
        lines.append((round(time.monotonic() - t0, 3), line.rstrip()))
    if p.wait() != 0:
        raise SystemExit(f"launch -> {p.returncode}\n" + "\n".join(x for _, x in lines))
    ready = time.monotonic() - t0
    th.join(5)
    r = chat_completion(dep.plan.vllm_url, dep.served, dep.w, max_tokens=16, min_tokens=16)
    first = time.monotonic() - t0 - (r.total_s - r.ttft_s)
    kvp(dep.env, "stop", dep.config)
    return {"load": [round(x, 2) for x in os.getloadavg()], "lines": lines,
            "serving_s": round(serving[0], 3) if serving else None,
            "ready_s": round(ready, 3), "first_answer_s": round(first, 3),
            "w_first_ttft": round(r.ttft_s, 4), "text": r.text}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--code", default=str(REPO))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    wd = Path(args.workdir)
    model = generate_model(args.size, wd / "hub")
    w = long_chat(turns=args.turns, words_per_turn=150, seed=4242)
    o = long_chat(turns=args.turns, words_per_turn=150, seed=7070)
    dep = Deployment(wd, args.size, args.dtype, model, w, o)
    out = []
    for i in range(args.rounds):
        rec = trace(dep, Path(args.code).resolve())
        out.append(rec)
        print(f"round {i + 1}: serving {rec['serving_s']} s, ready {rec['ready_s']} s, first "
              f"answer {rec['first_answer_s']} s (W TTFT {rec['w_first_ttft']} s), load "
              f"{rec['load']}")
        for t, line in rec["lines"]:
            print(f"  {t:8.3f}  {line}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
