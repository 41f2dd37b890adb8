#!/usr/bin/env python3
"""What the priming request must exercise: the first request after a restart of both, after
other priming requests (docs/benchmarks.md, "Restart downtime").

    python bench/prime_probe.py WORKDIR VARIANT [VARIANT ...]

WORKDIR is a ``bench/restart_downtime.py --workdir`` directory after its run (the demo model,
its config, the returning user's chat stored in its cache root, its warm set). Per VARIANT, in
the order given: ``kvp-admin launch`` (which primes vLLM and runs the warm-up), the variant's
own requests, then the returning user's chat ("target"), the same chat again (vLLM's own
prefix cache hit) and, after ``/reset_prefix_cache`` (VLLM_SERVER_DEV_MODE=1), once more
("steady": served from the cache server's L1 by a warm vLLM); then ``kvp-admin stop``.
Variants: ``none`` (the launch's prime only), ``short2`` (three more short requests),
``fresh`` (a new 2-turn chat of about 400 tokens: a full prefill, one chunk stored),
``fixed`` (the same ~670-token prompt every time: stored by its first run, retrieved after),
``chunk`` (a completion of the returning chat's first 257 token ids, one token: its first
chunk, which the warm-up put in L1, goes through LMCache's load into vLLM once before the
target; vLLM's prefix cache is reset after it, so the target takes nothing from it).
One line per variant, time to first token in seconds.
"""

from __future__ import annotations

import glob
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from restart_downtime import bench_env, kvp  # noqa: E402

from kvpersist.demo.chat import chat_completion, long_chat  # noqa: E402

SHORT = [{"role": "user", "content": "Hello."}]
FIXED = [{"role": "user", "content": " ".join(["restart primer words"] * 110)}]


def main() -> int:
    import requests

    wd, variants = sys.argv[1], sys.argv[2:]
    config = f"{wd}/config-demo/identity.env"
    chat = long_chat(turns=12, words_per_turn=150, seed=4242)  # restart_downtime.py's user
    env = bench_env(f"{wd}/cache", glob.glob(f"{wd}/hub/models--*/snapshots/*")[0],
                    f"{wd}/warm.jsonl")
    url, served = f"http://127.0.0.1:{env['KVP_VLLM_PORT']}", "cpu-demo"
    for variant in variants:
        kvp(env, "launch", config)
        pre: list[tuple[float, int | None]] = []
        if variant == "fixed":
            r = chat_completion(url, served, FIXED, max_tokens=2)
            pre.append((round(r.ttft_s, 3), r.prompt_tokens))
        elif variant == "fresh":
            fresh = long_chat(turns=2, words_per_turn=150, seed=int(time.time()))
            r = chat_completion(url, served, fresh, max_tokens=2)
            pre.append((round(r.ttft_s, 3), r.prompt_tokens))
        elif variant == "chunk":
            toks = requests.post(f"{url}/tokenize", json={
                "model": served, "messages": chat, "add_generation_prompt": True},
                timeout=30).json()["tokens"]
            t0 = time.monotonic()
            requests.post(f"{url}/v1/completions", json={
                "model": served, "prompt": toks[:257], "max_tokens": 1, "temperature": 0},
                timeout=60).raise_for_status()
            pre.append((round(time.monotonic() - t0, 3), 257))
            requests.post(f"{url}/reset_prefix_cache", timeout=30).raise_for_status()
        elif variant == "short2":
            for _ in range(3):
                r = chat_completion(url, served, SHORT, max_tokens=2)
                pre.append((round(r.ttft_s, 3), r.prompt_tokens))
        target = chat_completion(url, served, chat, max_tokens=24)
        again = chat_completion(url, served, chat, max_tokens=24)
        requests.post(f"{url}/reset_prefix_cache", timeout=30).raise_for_status()
        steady = chat_completion(url, served, chat, max_tokens=24)
        print(f"{variant} pre {pre} target {target.ttft_s:.3f} again(prefix) "
              f"{again.ttft_s:.3f} steady {steady.ttft_s:.3f}", flush=True)
        kvp(env, "stop", config)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
