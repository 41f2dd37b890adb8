#!/usr/bin/env python3
"""Reproduction: how the orphaned engine of a ``kill -9``'d vLLM is stopped changes answers.

    python bench/orphan_repro.py --signal term|kill|term-worker|term-engine [--users 8] \\
        [--seed 21] [--workdir DIR] [--out FILE]

The first round of the 60-minute soak (bench/soak.py, seed 21), alone, on a fresh cache
root: the float32 copy of cpu-demo on the generated tiny model, launched by ``kvp-admin
launch``; every user's request is first answered alone (the reference), then all users send
it again within one second while, 1 s into that storm, vLLM's API server gets ``kill -9``.
Its engine core and worker survive (docs/vllm-restart-findings.md, 4). This script stops them
itself with ``--signal`` (SIGTERM: a graceful shutdown; SIGKILL: none; or SIGTERM to the
worker only, or to the engine core only, the rest SIGKILLed after it), waits until they are
gone, then runs ``kvp-admin launch``, which starts vLLM again (it finds nothing left to stop).
The storm's requests are retried until served. Then every request is sent once more, alone:
an answer that is still wrong then came from what the cache holds.

Printed and written to ``--out``: the wrong answers of the storm and of the repeat. Exit 1 if
any answer was wrong.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# the soak's deployment and its traffic driver (bench/traffic.py, through bench/soak.py)
from bench.soak import (  # noqa: E402
    User,
    compare,
    conversation,
    make_deployment,
    references,
    storm,
    user_history,
)
from kvpersist.demo.model import generate_model  # noqa: E402
from kvpersist.system import procs  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--signal", choices=("term", "kill", "term-worker", "term-engine"),
                    required=True,
                    help="term/kill: every orphan; term-worker/term-engine: SIGTERM to the "
                         "worker (or the engine core) only, the others SIGKILLed once it is gone")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvp-orphan-"))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    model = generate_model("tiny", work / "hub")
    users = {u: User(u, 0, user_history(u, args.seed, 8, 150)) for u in range(args.users)}
    warm = work / "warm.jsonl"
    warm.write_text(json.dumps({"messages": users[0].opening()[:1]}) + "\n")
    dep = make_deployment(work, l1_gb=0.125, l2_budget="600M", model=model, warm=warm)
    dep.kvp_json("launch", str(dep.config))
    batch = [(u, 0, conversation(users[u], 0, {})) for u in users]
    refs = references(dep.url, "cpu-demo", batch)
    event: dict[str, Any] = {"signal": args.signal}

    def kill_and_relaunch() -> None:
        time.sleep(1.0)  # mid-storm
        pid = dep.kill9("vllm")
        event["killed"] = pid
        time.sleep(1.0)
        left = procs.leftovers(pid)
        event["orphans"] = [p.name() for p in left]
        t0 = time.monotonic()
        only = {"term-worker": "VLLM::Worker", "term-engine": "VLLM::EngineCore"}.get(args.signal)
        if only:
            first = [p for p in left if p.name() == only]
            for p in first:
                p.send_signal(signal.SIGTERM)
            psutil.wait_procs(first, timeout=60)
            for p in left:
                if p not in first and p.is_running():
                    p.kill()
        else:
            for p in left:
                p.send_signal(signal.SIGTERM if args.signal == "term" else signal.SIGKILL)
        gone, alive = psutil.wait_procs(left, timeout=90)
        event["orphans_exit_s"] = round(time.monotonic() - t0, 2)
        event["orphans_still_alive"] = len(alive)
        for p in alive:
            p.kill()
        doc = dep.kvp_json("launch", str(dep.config))
        event["started_again"] = doc.get("started")

    th = threading.Thread(target=kill_and_relaunch, daemon=True)
    th.start()
    recs = storm(dep.url, "cpu-demo", batch, phase="kill9-vllm", spread_s=1.0, seed=args.seed,
                 retry_until=time.monotonic() + 900)
    th.join(900)
    wrong = compare(recs, refs)
    again = []
    for item in batch:
        r = storm(dep.url, "cpu-demo", [item], phase="again", spread_s=0.0, seed=1,
                  retry_until=time.monotonic() + 120)[-1]
        again.append({"user": item[0], "cached_tokens": r.cached_tokens,
                      "same": r.text == refs[(item[0], 0)]})
    dep.kvp("stop", str(dep.config))
    doc = {"event": event, "storm_wrong": wrong,
           "again_wrong": [a for a in again if not a["same"]], "again": again,
           "users": args.users, "seed": args.seed}
    print(json.dumps(doc, indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if wrong or doc["again_wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
