#!/usr/bin/env python3
"""The returning-users storm after a restart (docs/benchmarks.md, "Storm after a restart").

    python bench/restart_storm.py [--rounds 2] [--users 8] [--size demo] [--out FILE]

Real vLLM (CPU build) and a real ``lmcache server`` through ``kvp-admin launch``/``stop`` on a
generated demo model; a warm set holding every user's chat opening (all messages but the last
question). Per round, N users with fresh chats (new seeds), each storm N streamed requests sent
at once, time to first token per user:

- ``cold``: the first launch of the round on an empty cache root (a new root per round):
  every user's prefill computed (and stored);
- ``steady``: the same deployment running, vLLM's own prefix cache reset
  (``/reset_prefix_cache``, VLLM_SERVER_DEV_MODE=1), the same storm: served from the cache
  server's L1 by a warm vLLM;
- ``restart``: ``kvp-admin stop`` and ``kvp-admin launch`` of both (prime and warm-up before
  ready), the same storm.

p50 and p95 per storm; the ratios restart/steady and restart/cold per round, then their
medians. Output texts of a user must be identical across the three storms. Load is recorded.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvpersist.demo.chat import ChatResult, chat_completion, long_chat  # noqa: E402
from kvpersist.demo.model import generate_model  # noqa: E402
from kvpersist.demo.run import _identity_file  # noqa: E402
from kvpersist.stack.launch_plan import prepare_launch  # noqa: E402

sys.path.insert(0, str(REPO / "bench"))
from restart_downtime import bench_env, kvp, load  # noqa: E402


def pct(xs: list[float], q: float) -> float:
    """The q-quantile of ``xs`` (nearest rank)."""
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * len(s) + 0.5) - 1))]


def storm(url: str, served: str, chats: list[list[dict[str, str]]]) -> dict[str, Any]:
    la = load()
    with ThreadPoolExecutor(len(chats)) as pool:
        res: list[ChatResult] = list(pool.map(
            lambda c: chat_completion(url, served, c, max_tokens=16), chats))
    ttfts = [r.ttft_s for r in res]
    return {"load1": la, "p50_s": round(statistics.median(ttfts), 4),
            "p95_s": round(pct(ttfts, 0.95), 4), "max_s": round(max(ttfts), 4),
            "ttft_s": [round(t, 4) for t in ttfts], "texts": [r.text for r in res]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--size", default="demo")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--out", default="")
    ap.add_argument("--workdir", default="")
    args = ap.parse_args()

    import requests

    wd = Path(args.workdir or tempfile.mkdtemp(prefix="kvp-storm-"))
    wd.mkdir(parents=True, exist_ok=True)
    model = generate_model(args.size, wd / "hub")
    config = _identity_file(wd, args.size)
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        chats = [long_chat(turns=args.turns, words_per_turn=150, seed=9000 + 100 * i + u)
                 for u in range(args.users)]
        warm_file = wd / f"warm-{i}.jsonl"
        warm_file.write_text("".join(json.dumps({"messages": c[:-1]}) + "\n" for c in chats))
        root = wd / f"cache-{i}"
        root.mkdir(mode=0o700)
        env = bench_env(root, model, warm_file)
        prepared = prepare_launch(config, environ=env)
        url, served = prepared.plan.vllm_url, prepared.dep.settings.served_model_name
        rnd: dict[str, Any] = {"round": i + 1}
        kvp(env, "launch", config)
        try:
            rnd["cold"] = storm(url, served, chats)
            time.sleep(2)
            requests.post(f"{url}/reset_prefix_cache", timeout=30).raise_for_status()
            rnd["steady"] = storm(url, served, chats)
            kvp(env, "stop", config)
            launched, took = kvp(env, "launch", config, "--json")
            rnd["restart_launch_s"] = round(took, 2)
            rnd["restart_warmup"] = json.loads(launched.stdout).get("warmup")
            rnd["restart"] = storm(url, served, chats)
        finally:
            kvp(env, "stop", config)
        rnd["identical"] = all(
            rnd["cold"]["texts"][u] == rnd["steady"]["texts"][u] == rnd["restart"]["texts"][u]
            for u in range(args.users))
        rnd["ratios"] = {
            "restart_to_steady_p95": round(rnd["restart"]["p95_s"] / rnd["steady"]["p95_s"], 3),
            "restart_to_cold_p95": round(rnd["restart"]["p95_s"] / rnd["cold"]["p95_s"], 3),
            "restart_to_steady_p50": round(rnd["restart"]["p50_s"] / rnd["steady"]["p50_s"], 3),
            "restart_to_cold_p50": round(rnd["restart"]["p50_s"] / rnd["cold"]["p50_s"], 3)}
        print(f"round {i + 1}: " + ", ".join(
            f"{k} p50 {rnd[k]['p50_s']} s p95 {rnd[k]['p95_s']} s"
            for k in ("cold", "steady", "restart")) + f"; {rnd['ratios']}", flush=True)
        rounds.append(rnd)
        shutil.rmtree(root, ignore_errors=True)

    def col(k: str, q: str) -> list[float]:
        return [r[k][q] for r in rounds]

    summary = {
        "schema": "kvpersist.bench.restart-storm/1", "size": args.size, "users": args.users,
        "rounds": args.rounds,
        **{f"{k}_{q}": round(statistics.median(col(k, q)), 4)
           for k in ("cold", "steady", "restart") for q in ("p50_s", "p95_s")},
        "ratios": {k: round(statistics.median([r["ratios"][k] for r in rounds]), 3)
                   for k in rounds[0]["ratios"]},
        "identical": all(r["identical"] for r in rounds),
        "detail": rounds,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "detail"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if summary["identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
