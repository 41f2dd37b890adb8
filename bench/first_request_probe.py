#!/usr/bin/env python3
"""Where the first request after a restart spends the time that a steady request does not
(docs/benchmarks.md, "Restart downtime").

    python bench/first_request_probe.py [--restarts 4] [--workdir DIR] [--out FILE]
        [--pyspy DIR] [--settle S]

The set-up of ``bench/restart_downtime.py`` (the demo model, a returning user's 12-turn chat
computed and stored once, a warm set of its opening). Then per restart: ``kvp-admin launch``
(the prime and the warm-up), the returning user's request ("first"), and three "steady"
requests (vLLM's own prefix cache reset before each: served from the cache server's L1 by a
warm vLLM); ``kvp-admin stop``. Per request, besides the client's time to first token, the
split vLLM's own metrics give (the deltas of its histograms' sums around the request):
``engine_ttft`` (from the request's arrival in vLLM's front end to its first token),
``queue`` (waiting in the engine's scheduler, including an asynchronous KV load) and
``prefill`` (scheduled to first token), plus what is left: the front end (chat template,
tokenizer) and the HTTP stream. With ``--pyspy DIR``, py-spy (when installed) samples vLLM's
API server, its engine core and the cache server during the first and the first steady
request and writes one collapsed-stack file per process and request there.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from restart_downtime import bench_env, kvp, load, log_size, served_from  # noqa: E402

from kvpersist.demo.chat import chat_completion, long_chat  # noqa: E402
from kvpersist.demo.model import generate_model  # noqa: E402
from kvpersist.demo.run import _identity_file  # noqa: E402
from kvpersist.stack.launch_plan import LaunchPlan, prepare_launch  # noqa: E402

SUMS = {"engine_ttft": "vllm:time_to_first_token_seconds_sum",
        "queue": "vllm:request_queue_time_seconds_sum",
        "prefill": "vllm:request_prefill_time_seconds_sum"}


def metric_sums(url: str) -> dict[str, float]:
    import requests

    text = requests.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for key, name in SUMS.items():
        m = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
        out[key] = float(m.group(1)) if m else float("nan")
    return out


def pids(plan: LaunchPlan) -> dict[str, int]:
    """The pids of vLLM's API server and each process under it (its engine core, its
    workers: named by their process titles) and of the cache server."""
    import psutil

    api = int(Path(plan.vllm_pid_file).read_text().split()[0])
    out = {"api": api, "server": int(Path(plan.server_pid_file).read_text().split()[0])}
    for child in psutil.Process(api).children(recursive=True):
        try:
            title = child.cmdline()[0] if child.cmdline() else child.name()
        except psutil.Error:
            continue
        if "python" in title or "VLLM" in title or "Engine" in title or "Worker" in title:
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", title.split("/")[-1])[:40]
            out[f"{name}-{child.pid}"] = child.pid
    return out


class Spy:
    """py-spy record of several processes around one request."""

    def __init__(self, outdir: Path | None, label: str, plan: LaunchPlan) -> None:
        self.procs: list[subprocess.Popen[bytes]] = []
        if outdir is None or shutil.which("py-spy") is None:
            return
        outdir.mkdir(parents=True, exist_ok=True)
        for what, pid in pids(plan).items():
            self.procs.append(subprocess.Popen(
                ["py-spy", "record", "-r", "500", "--idle", "--nonblocking", "-f", "raw",
                 "-o", str(outdir / f"{label}-{what}.txt"), "-p", str(pid)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        time.sleep(1.0)  # attached

    def stop(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGINT)
        for p in self.procs:
            p.wait(30)


def timed(plan: LaunchPlan, served: str, chat: list[dict[str, str]], spy: Spy | None = None,
          ) -> dict[str, Any]:
    before = metric_sums(plan.vllm_url)
    since = log_size(plan.server_log)
    r = chat_completion(plan.vllm_url, served, chat, max_tokens=24)
    if spy is not None:
        spy.stop()
    after = metric_sums(plan.vllm_url)
    rec: dict[str, Any] = {"client_ttft": round(r.ttft_s, 4)}
    for k in SUMS:
        rec[k] = round(after[k] - before[k], 4)
    rec["front_and_stream"] = round(rec["client_ttft"] - rec["engine_ttft"], 4)
    rec["engine_other"] = round(rec["engine_ttft"] - rec["queue"] - rec["prefill"], 4)
    rec["l1_l2_chunks"] = served_from(plan.server_log, since)
    rec["text"] = r.text
    return rec


def main() -> int:
    import requests

    ap = argparse.ArgumentParser()
    ap.add_argument("--restarts", type=int, default=4)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--pyspy", default="")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds between the launch's return and the first request")
    ap.add_argument("--variant", default="none",
                    help="none; loadN: before the first request, a completion of its first N "
                         "chunks (loaded from the server's L1 into vLLM), then vLLM's prefix "
                         "cache reset; malloc: glibc's mmap threshold fixed at 64 MiB in the "
                         "launched processes")
    ap.add_argument("--others", type=int, default=0,
                    help="other users whose openings come first in the warm set (stored in "
                         "the cold phase)")
    ap.add_argument("--reset-first", action="store_true",
                    help="reset vLLM's own prefix cache before the first request too (the "
                         "warm-up's load leaves its entry there)")
    args = ap.parse_args()

    wd = Path(args.workdir or tempfile.mkdtemp(prefix="kvp-first-"))
    wd.mkdir(parents=True, exist_ok=True)
    model = generate_model("demo", wd / "hub")
    config = _identity_file(wd, "demo")
    chat = long_chat(turns=12, words_per_turn=150, seed=4242)
    warm_file = wd / "warm.jsonl"
    others = [long_chat(turns=12, words_per_turn=150, seed=5000 + k) for k in range(args.others)]
    warm_file.write_text("".join(json.dumps({"messages": c[:-1]}) + "\n"
                                 for c in [*others, chat]))
    env = bench_env(wd / "cache", model, warm_file)
    (wd / "cache").mkdir(mode=0o700, exist_ok=True)
    plan = prepare_launch(config, environ=env).plan
    served = "cpu-demo"
    kvp(env, "launch", config)
    cold = chat_completion(plan.vllm_url, served, chat, max_tokens=24)
    for c in others:
        chat_completion(plan.vllm_url, served, c, max_tokens=2)
    time.sleep(2)
    kvp(env, "stop", config)
    print(f"cold {cold.ttft_s:.3f} s", flush=True)

    spydir = Path(args.pyspy) if args.pyspy else None
    out: list[dict[str, Any]] = []
    toks: list[int] = []
    for i in range(args.restarts):
        lenv = dict(env)
        if args.variant == "malloc":
            lenv["MALLOC_MMAP_THRESHOLD_"] = str(64 << 20)
        kvp(lenv, "launch", config)
        if args.variant.startswith("load"):
            n = int(args.variant[4:] or 8)
            if not toks:
                toks = requests.post(f"{plan.vllm_url}/tokenize", json={
                    "model": served, "messages": chat, "add_generation_prompt": True},
                    timeout=30).json()["tokens"]
            t0 = time.monotonic()
            requests.post(f"{plan.vllm_url}/v1/completions", json={
                "model": served, "prompt": toks[:n * 256 + 1], "max_tokens": 1,
                "temperature": 0}, timeout=60).raise_for_status()
            requests.post(f"{plan.vllm_url}/reset_prefix_cache", timeout=30).raise_for_status()
            print(f"  load{n}: {time.monotonic() - t0:.3f} s", flush=True)
        if args.settle:
            time.sleep(args.settle)
        rec: dict[str, Any] = {"restart": i + 1, "load1": load()}
        if args.reset_first:
            requests.post(f"{plan.vllm_url}/reset_prefix_cache", timeout=30).raise_for_status()
        rec["first"] = timed(plan, served, chat, Spy(spydir, f"r{i + 1}-first", plan)
                             if spydir else None)
        rec["steady"] = []
        for j in range(3):
            requests.post(f"{plan.vllm_url}/reset_prefix_cache", timeout=30).raise_for_status()
            spy = Spy(spydir, f"r{i + 1}-steady", plan) if spydir and j == 0 else None
            rec["steady"].append(timed(plan, served, chat, spy))
        kvp(env, "stop", config)
        f, s = rec["first"], rec["steady"]
        line = " ".join(f"{k} {f[k]:.3f}/{statistics.median(x[k] for x in s):.3f}"
                        for k in ("client_ttft", "front_and_stream", "queue", "prefill",
                                  "engine_other"))
        print(f"restart {i + 1} (load {rec['load1']}): first/steady {line}", flush=True)
        out.append(rec)
    if args.out:
        Path(args.out).write_text(json.dumps({"cold_ttft_s": cold.ttft_s, "restarts": out},
                                             indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
