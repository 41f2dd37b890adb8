#!/usr/bin/env python3
"""What the first request that asks for logprobs costs a fresh vLLM (CPU build): the
canary's share of a launch's ready - serving (docs/benchmarks.md, issue 39).

    python bench/first_logprobs_probe.py [--rounds 2] [--dtype float32] [--workdir DIR]
        [--out FILE]

The demo model (tiny) and configs/cpu-demo's identity in ``--dtype``; per round, the same
processes a bare start runs (the cache server and vLLM with the argv ``kvp-admin launch``
would run: no preflight, no prime, no canary, no warm-up), then four completions of distinct
prompts of one length, one after the other, each timed to its last byte:

1. ``plain-1``: the first request of any kind (no logprobs);
2. ``plain-2``: a second plain one;
3. ``logprobs-1``: the first that asks for top-5 logprobs (the canary asks for them);
4. ``logprobs-2``: a second one.

If ``logprobs-1`` is slow where ``plain-2`` and ``logprobs-2`` are not, the cost is vLLM's
own first logprobs request (on the CPU build: its sampler's torch.compile of the logprobs
op), which the canary pays before ready and a bare start pays at a user's first request for
logprobs, if ever. The machine's load is recorded at each round.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from first_chat_restart import tiny_config  # noqa: E402
from restart_downtime import (  # noqa: E402
    ServingPoll,
    _sigterm_to_exit,
    bare_processes,
    bench_env,
    kvp,
)

from kvpersist.demo.model import generate_model  # noqa: E402
from kvpersist.stack.launch_plan import prepare_launch  # noqa: E402

STEPS = (("plain-1", 0), ("plain-2", 0), ("logprobs-1", 5), ("logprobs-2", 5))


def complete(plan: Any, model: str, prompt: str, logprobs: int) -> float:
    """One completion through the project's vLLM client, timed to its last byte."""
    body: dict[str, Any] = {"model": model, "prompt": prompt, "max_tokens": 4,
                            "temperature": 0.0}
    if logprobs:
        body["logprobs"] = logprobs
    t = time.monotonic()
    r = plan.vllm(300.0).completions(body)
    if r.status != 200:
        raise RuntimeError(f"/v1/completions answered {r.status}: {r.body[:300]!r}")
    return round(time.monotonic() - t, 4)


def one_round(plan: Any, served: str, logs: Path, n: int) -> dict[str, Any]:
    rec: dict[str, Any] = {"load": [round(x, 2) for x in os.getloadavg()]}
    t0 = time.monotonic()
    with bare_processes(plan, logs, "") as (srv, vl):
        rec["serving_s"] = round(ServingPoll(plan, t0).wait(900), 3)
        for i, (name, lp) in enumerate(STEPS):
            # distinct prompts of one length: no prefix-cache hit between the steps
            prompt = " ".join(f"round {n} step {i} word {j}" for j in range(40))
            rec[name] = complete(plan, served, prompt, lp)
        _sigterm_to_exit(vl)
        _sigterm_to_exit(srv)
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    wd = Path(args.workdir or tempfile.mkdtemp(prefix="kvp-logprobs-probe-"))
    wd.mkdir(parents=True, exist_ok=True)
    model = generate_model("tiny", wd / "hub")
    config = tiny_config(wd, "tiny", args.dtype)
    (wd / "cache").mkdir(mode=0o700, exist_ok=True)
    warm = wd / "warm.jsonl"  # one short entry: the launch wants a warm set that is not empty
    warm.write_text(json.dumps({"prompt": "a warm set of one short prompt"}) + "\n")
    env = bench_env(wd / "cache", model, warm)
    prepared = prepare_launch(config, environ=env)
    plan, served = prepared.plan, prepared.dep.settings.served_model_name
    logs = wd / "logs"
    logs.mkdir(exist_ok=True)
    # one kvp-admin launch and stop first: the state the server's argv uses (its key, its
    # records) exists, and the machine's compiled-kernel caches are as a restart finds them
    kvp(env, "launch", config)
    kvp(env, "stop", config)
    rounds = [one_round(plan, served, logs, n) for n in range(args.rounds)]
    summary = {name: statistics.median(r[name] for r in rounds) for name, _ in STEPS}
    doc = {"schema": "kvpersist.bench.first-logprobs/1", "dtype": args.dtype,
           "rounds": rounds, "median_s": summary}
    print(json.dumps(doc, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
