#!/usr/bin/env python3
"""Warm restart benchmark (docs/benchmarks.md, "Warm restart").

    python bench/warm_restart_bench.py [--rounds 3] [--size bench] [--out FILE]

Real vLLM (CPU build) + real lmcache server through ``kvp-admin launch``/``stop``, on a
generated demo model, with a warm set (``KVP_WARMUP_FILE``) holding the chat's opening
(every message but the final question). Per round, a fresh chat (new seed) and four
time-to-first-token figures for the same request:

- ``cold``: first launch, nothing cached: full prefill;
- ``l1``: the reference, served from the cache server's L1 in the running session (vLLM alone
  restarted, so vLLM's own prefix cache is empty and the server still holds the chunks);
- ``restart_no_warmup``: both restarted, the chunk files evicted from the page cache,
  ``launch --no-warmup``: the request pays the L2 -> L1 load;
- ``restart_warmup``: both restarted, the chunk files evicted, ``launch`` runs the warm-up
  before it reports ready.

The two restart variants alternate their order between rounds. Every phase sends one short
"Say hello." request first so vLLM's own first-request overhead is outside the figures (as
in ``kvp-admin demo``). Load (/proc/loadavg) is recorded per phase. Output texts must be
identical across the four phases of a round.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvpersist.demo.chat import chat_completion, long_chat  # noqa: E402
from kvpersist.demo.model import generate_model  # noqa: E402
from kvpersist.demo.run import _identity_file  # noqa: E402
from kvpersist.system import procs  # noqa: E402

PY = sys.executable
KVP = [PY, "-m", "kvpersist.cli"]
HELLO = [{"role": "user", "content": "Say hello."}]
RETAINED = re.compile(r"retained keys \((\d+) L1, (\d+) L2\)")


def evict_chunk_files(root: str, prefix: str) -> int:
    """Drop the namespace's chunk files from the page cache (``POSIX_FADV_DONTNEED`` after a
    sync), as a host reboot would, leaving the rest of the page cache (the venv, the model
    weights) as a service restart leaves it. Returns the files evicted. With O_DIRECT (the
    default) the server's L2 reads bypass the page cache anyway."""
    os.sync()
    n = 0
    for p in Path(root).iterdir():
        if p.name.startswith(prefix) and p.name.endswith(".bin") and not p.is_symlink():
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def kvp(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([*KVP, *args], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=1200)
    if r.returncode != 0:
        raise SystemExit(f"kvp-admin {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def log_since(path: str, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def retained(text: str) -> tuple[int, int]:
    pairs = [(int(a), int(b)) for a, b in RETAINED.findall(text)]
    return sum(a for a, _ in pairs), sum(b for _, b in pairs)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", default="bench")
    ap.add_argument("--turns", type=int, default=16)
    ap.add_argument("--out", default="")
    ap.add_argument("--workdir", default="")
    args = ap.parse_args()

    from kvpersist.stack import processes as proc
    from kvpersist.stack.launch_plan import prepare_launch

    wd = Path(args.workdir or tempfile.mkdtemp(prefix="kvp-warm-bench-"))
    wd.mkdir(parents=True, exist_ok=True)
    model = generate_model(args.size, wd / "hub")
    config = _identity_file(wd, args.size)
    warm_file = wd / "warm.jsonl"
    env = dict(os.environ)
    for k in [k for k in env if k.startswith("KVP_")]:
        env.pop(k)
    env.update({
        "KVP_CACHE_ROOT": str(wd / "cache"), "KVP_MODEL_PATH": str(model),
        "KVP_LMCACHE_PORT": str(procs.free_port()),
        "KVP_LMCACHE_HTTP_PORT": str(procs.free_port()),
        "KVP_VLLM_PORT": str(procs.free_port()), "KVP_L1_SIZE_GB": "1",
        "KVP_WARMUP_FILE": str(warm_file), "LMCACHE_DISABLE_BANNER": "1",
    })
    (wd / "cache").mkdir(mode=0o700, exist_ok=True)
    prepared = prepare_launch(config, environ=env)
    dep, plan = prepared.dep, prepared.plan
    served = dep.settings.served_model_name
    rounds: list[dict[str, Any]] = []

    def ask(chat: list[dict[str, str]]) -> dict[str, Any]:
        chat_completion(plan.vllm_url, served, HELLO, max_tokens=2)
        off = os.path.getsize(plan.server_log)
        la = load()
        r = chat_completion(plan.vllm_url, served, chat, max_tokens=24)
        time.sleep(0.5)
        l1, l2 = retained(log_since(plan.server_log, off))
        return {"ttft_s": round(r.ttft_s, 4), "text": r.text, "prompt_tokens": r.prompt_tokens,
                "request_chunks_from_l1": l1, "request_chunks_from_l2": l2, "load1": la}

    try:
        for i in range(args.rounds):
            seed = random.SystemRandom().randrange(1, 1 << 30)
            chat = long_chat(turns=args.turns, words_per_turn=150, seed=seed)
            warm_file.write_text(json.dumps({"messages": chat[:-1]}) + "\n")
            rnd: dict[str, Any] = {"round": i + 1, "seed": seed}
            print(f"[round {i + 1}] cold", file=sys.stderr)
            kvp(env, "launch", config, "--no-warmup")
            rnd["cold"] = ask(chat)
            want = (rnd["cold"]["prompt_tokens"] or 0) // dep.generic.chunk_size

            def stored(w: int = want) -> bool:
                return sum(1 for p in Path(plan.cache_root).iterdir()
                           if p.name.startswith(dep.namespace)) >= w

            procs.wait_for(stored, 30, 0.5)
            print(f"[round {i + 1}] L1 reference (vLLM alone restarted)", file=sys.stderr)
            proc.stop_vllm(plan)
            proc.start_vllm(plan, timeout=600)
            rnd["l1"] = ask(chat)
            order = ["restart_no_warmup", "restart_warmup"]
            if i % 2:
                order.reverse()
            for name in order:
                print(f"[round {i + 1}] {name}", file=sys.stderr)
                kvp(env, "stop", config)
                rnd[f"{name}_chunk_files_evicted"] = evict_chunk_files(plan.cache_root,
                                                                       dep.namespace)
                off = os.path.getsize(plan.server_log) if os.path.exists(plan.server_log) else 0
                t = time.monotonic()
                extra = ["--no-warmup"] if name == "restart_no_warmup" else []
                out = kvp(env, "launch", config, "--json", *extra)
                launch_s = time.monotonic() - t
                boot = log_since(plan.server_log, off)
                res = ask(chat)
                res["launch_s"] = round(launch_s, 2)
                res["warmup_chunks_from_l2"] = retained(boot)[1]
                try:
                    res["launch_warmup"] = json.loads(out.stdout).get("warmup")
                except ValueError:
                    res["launch_warmup"] = None
                rnd[name] = res
            kvp(env, "stop", config)
            phases = ("cold", "l1", "restart_no_warmup", "restart_warmup")
            texts = {rnd[k]["text"] for k in phases}
            rnd["identical"] = len(texts) == 1
            # from the cache (every phase but cold) the computation is the same: those must
            # agree; cold computes the whole prompt in one prefill (other kernel shapes)
            rnd["identical_from_cache"] = len({rnd[k]["text"] for k in phases[1:]}) == 1
            for k in phases:
                rnd[k]["text_sha256"] = hashlib.sha256(rnd[k].pop("text").encode()).hexdigest()[:16]
            ref = rnd["l1"]["ttft_s"]
            rnd["ratios_to_l1"] = {k: round(rnd[k]["ttft_s"] / ref, 3)
                                   for k in ("cold", "restart_no_warmup", "restart_warmup")}
            print(json.dumps(rnd), file=sys.stderr)
            rounds.append(rnd)
    finally:
        subprocess.run([*KVP, "stop", config], env=env, cwd=REPO, capture_output=True)

    def med(key: str) -> dict[str, float]:
        xs = [r["ratios_to_l1"][key] for r in rounds]
        return {"median": round(statistics.median(xs), 3), "min": min(xs), "max": max(xs)}

    summary = {"rounds": len(rounds), "size": args.size, "namespace": dep.namespace,
               "ttft_ratio_to_l1": {k: med(k) for k in ("cold", "restart_no_warmup",
                                                          "restart_warmup")},
               "l1_ttft_s_median": statistics.median(r["l1"]["ttft_s"] for r in rounds),
               "all_identical": all(r["identical"] for r in rounds),
               "all_identical_from_cache": all(r["identical_from_cache"] for r in rounds),
               "detail": rounds}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
