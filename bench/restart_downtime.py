#!/usr/bin/env python3
"""Restart downtime as users feel it (docs/benchmarks.md, "Restart downtime").

    python bench/restart_downtime.py [--rounds 3] [--size demo] [--out FILE]

Real vLLM (CPU build) and a real ``lmcache server`` on a generated demo model, with a warm set
holding ``--others`` other users' openings first, then a returning user's chat (every message
but the last question): the warm-up's loads into vLLM (at most three entries) take the other
users', so the returning user's request goes through LMCache's path as any user's would, not
through vLLM's own prefix cache. Once, before the rounds: ``kvp-admin launch``, the user's
chat (cold: it is computed and stored) and the others', ``kvp-admin stop``. Then paired
rounds, the order of the two variants alternating between rounds, each from everything
stopped to the returning user's first streamed token:

- ``kvpersist``: ``kvp-admin launch CONFIG`` (whole process: preflight, the crash-window
  check, the cache server, vLLM, the priming request, the warm-up), then the chat. "serving"
  is when vLLM first answers ``/health`` and lists the namespace (polled every 0.1 s beside
  the launch), "ready" when the launch returns;
- ``bare``: the very argv and environment kvpersist renders for the cache server and vLLM,
  started by hand at once (the best order: vLLM's load is the long pole), vLLM polled the
  same way, then the chat: what the same processes cost without kvpersist.

After the kvpersist variant's first request, the steady-state reference: vLLM's own prefix
cache reset (``/reset_prefix_cache``, vLLM's development endpoints, VLLM_SERVER_DEV_MODE=1)
and the same request again, served from the running cache server's L1 by a warm vLLM, three
times. Stops: ``kvp-admin stop`` (whole process) against SIGTERM to the bare vLLM API server
then the bare server, each to its exit. Load (/proc/loadavg) is recorded per variant. The
output texts of every first request must be identical. Per request of the kvpersist variant,
the chunks the cache server found in L1 and in L2 (its log's prefetch lines).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvpersist.demo.chat import chat_completion, long_chat  # noqa: E402
from kvpersist.demo.model import generate_model  # noqa: E402
from kvpersist.demo.run import _identity_file  # noqa: E402
from kvpersist.stack.launch_plan import LaunchPlan, prepare_launch  # noqa: E402
from kvpersist.stack.processes import vllm_ready  # noqa: E402
from kvpersist.system import procs  # noqa: E402

PY = sys.executable
KVP = [PY, "-m", "kvpersist.cli"]
POLL_S = 0.1
#: the cache server's line for one request's prefetch: chunks it found in L1 and in L2
PREFETCH_RE = re.compile(r"retained keys \((\d+) L1, (\d+) L2\)")


def served_from(log: str, since: int) -> list[tuple[int, int]]:
    """(L1, L2) chunk counts of each prefetch the server logged after byte ``since``."""
    try:
        with open(log, "rb") as f:
            f.seek(since)
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return [(int(a), int(b)) for a, b in PREFETCH_RE.findall(text)]


def log_size(log: str) -> int:
    try:
        return os.path.getsize(log)
    except OSError:
        return 0


def load() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def kvp(env: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    t0 = time.monotonic()
    r = subprocess.run([*KVP, *args], env=env, cwd=REPO, capture_output=True, text=True,
                       timeout=1200)
    took = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"kvp-admin {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r, took


class ServingPoll:
    """A thread that polls vLLM's readiness from ``t0`` until it serves (or ``stop``)."""

    def __init__(self, plan: LaunchPlan, t0: float) -> None:
        self.at: float | None = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(plan, t0), daemon=True)
        self.thread.start()

    def _run(self, plan: LaunchPlan, t0: float) -> None:
        while not self.done.is_set():
            if vllm_ready(plan, 1.0):
                self.at = time.monotonic() - t0
                return
            time.sleep(POLL_S)

    def wait(self, timeout: float) -> float:
        self.thread.join(timeout)
        self.done.set()
        if self.at is None:
            raise SystemExit("vLLM did not serve in time")
        return self.at


def first_token(plan: LaunchPlan, served: str, chat: list[dict[str, str]],
                t0: float) -> dict[str, Any]:
    since = log_size(plan.server_log)
    r = chat_completion(plan.vllm_url, served, chat, max_tokens=24)
    return {"request_ttft_s": round(r.ttft_s, 4), "text": r.text,
            "prompt_tokens": r.prompt_tokens,
            "to_first_token_s": round(time.monotonic() - t0 - (r.total_s - r.ttft_s), 3),
            "l1_l2_chunks": served_from(plan.server_log, since)}


def steady(plan: LaunchPlan, served: str, chat: list[dict[str, str]], n: int = 3) -> list[float]:
    import requests

    out = []
    for _ in range(n):
        requests.post(f"{plan.vllm_url}/reset_prefix_cache", timeout=30).raise_for_status()
        out.append(round(chat_completion(plan.vllm_url, served, chat, max_tokens=24).ttft_s, 4))
    return out


def run_kvpersist(env: dict[str, str], config: str, plan: LaunchPlan, served: str,
                  chat: list[dict[str, str]]) -> dict[str, Any]:
    la = load()
    t0 = time.monotonic()
    poll = ServingPoll(plan, t0)
    launched, ready = kvp(env, "launch", config, "--json")
    serving = poll.wait(5)
    rec: dict[str, Any] = {"load1": la, "serving_s": round(serving, 3),
                           "ready_s": round(ready, 3)}
    rec.update(first_token(plan, served, chat, t0))
    info = json.loads(launched.stdout)
    rec["prime"] = info.get("prime")
    rec["warmup"] = info.get("warmup")
    try:
        rec["warmup_loads"] = json.loads(Path(plan.warmup_state_file).read_text()).get("loads")
    except (OSError, ValueError):
        rec["warmup_loads"] = None
    since = log_size(plan.server_log)
    rec["steady_ttft_s"] = steady(plan, served, chat)
    rec["steady_l1_l2_chunks"] = served_from(plan.server_log, since)
    stopped, took = kvp(env, "stop", config, "--json")
    rec["stop_s"] = round(took, 3)
    rec["stopped"] = [{"what": s["what"], "how": s["how"], "seconds": s["seconds"]}
                      for s in json.loads(stopped.stdout)["stopped"]]
    return rec


def _sigterm_to_exit(proc: subprocess.Popen[bytes], timeout: float = 60) -> float:
    import psutil

    kids = psutil.Process(proc.pid).children(recursive=True)
    t = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout)
    psutil.wait_procs(kids, timeout=timeout)
    return round(time.monotonic() - t, 3)


@contextlib.contextmanager
def bare_processes(plan: LaunchPlan, logs: Path, prefix: str = "bare-"
                   ) -> Iterator[tuple[subprocess.Popen[bytes], subprocess.Popen[bytes]]]:
    """A bare start: the cache server and vLLM spawned with the argv, environment and
    working directories ``kvp-admin launch`` would use, and nothing else (no preflight,
    prime, canary or warm-up); their output appended to ``logs/PREFIX{server,vllm}.log``.
    Yields (server, vLLM); whatever is still running at the end is killed (SIGKILL)."""
    with open(logs / f"{prefix}server.log", "ab") as slog, \
            open(logs / f"{prefix}vllm.log", "ab") as vlog:
        srv = subprocess.Popen(plan.server_argv, env=plan.server_env, cwd=plan.state_dir,
                               stdout=slog, stderr=subprocess.STDOUT, start_new_session=True)
        vl = subprocess.Popen(plan.vllm_argv, env=plan.vllm_env, cwd=plan.model_link_dir,
                              stdout=vlog, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield srv, vl
    finally:
        for p in (vl, srv):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def run_bare(plan: LaunchPlan, served: str, chat: list[dict[str, str]],
             logs: Path) -> dict[str, Any]:
    la = load()
    t0 = time.monotonic()
    with bare_processes(plan, logs) as (srv, vl):
        serving = ServingPoll(plan, t0).wait(900)
        rec: dict[str, Any] = {"load1": la, "serving_s": round(serving, 3)}
        rec.update(first_token(plan, served, chat, t0))
        t = time.monotonic()
        rec["sigterm_to_exit_s"] = {"vllm": _sigterm_to_exit(vl), "server": _sigterm_to_exit(srv)}
        rec["stop_s"] = round(time.monotonic() - t, 3)
    return rec


def bench_env(root: Path | str, model: Path | str, warm_file: Path | str) -> dict[str, str]:
    """The benchmarks' environment: this one without KVP_ keys, then the deployment's cache
    root, model, free loopback ports, a 1 GB L1, the warm set, and vLLM's development endpoints
    (``/reset_prefix_cache``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    env.update({
        "KVP_CACHE_ROOT": str(root), "KVP_MODEL_PATH": str(model),
        "KVP_LMCACHE_PORT": str(procs.free_port()),
        "KVP_LMCACHE_HTTP_PORT": str(procs.free_port()),
        "KVP_VLLM_PORT": str(procs.free_port()), "KVP_L1_SIZE_GB": "1",
        "KVP_WARMUP_FILE": str(warm_file), "LMCACHE_DISABLE_BANNER": "1",
        "VLLM_SERVER_DEV_MODE": "1",
    })
    return env


def med(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3),
            "max": round(max(xs), 3)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--size", default="demo")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--out", default="")
    ap.add_argument("--workdir", default="")
    ap.add_argument("--others", type=int, default=3)
    args = ap.parse_args()

    wd = Path(args.workdir or tempfile.mkdtemp(prefix="kvp-downtime-"))
    wd.mkdir(parents=True, exist_ok=True)
    model = generate_model(args.size, wd / "hub")
    config = _identity_file(wd, args.size)
    chat = long_chat(turns=args.turns, words_per_turn=150, seed=4242)
    warm_file = wd / "warm.jsonl"
    others = [long_chat(turns=args.turns, words_per_turn=150, seed=5000 + k)
              for k in range(args.others)]
    warm_file.write_text("".join(json.dumps({"messages": c[:-1]}) + "\n"
                                 for c in [*others, chat]))
    env = bench_env(wd / "cache", model, warm_file)
    (wd / "cache").mkdir(mode=0o700, exist_ok=True)
    prepared = prepare_launch(config, environ=env)
    plan, served = prepared.plan, prepared.dep.settings.served_model_name
    logs = wd / "logs"
    logs.mkdir(exist_ok=True)

    # once: the cold chat, computed and stored on disk
    kvp(env, "launch", config)
    cold = chat_completion(plan.vllm_url, served, chat, max_tokens=24)
    for c in others:
        chat_completion(plan.vllm_url, served, c, max_tokens=2)
    time.sleep(2)
    kvp(env, "stop", config)
    print(f"cold: TTFT {cold.ttft_s:.3f} s, {cold.prompt_tokens} prompt tokens", flush=True)

    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        order = ["kvpersist", "bare"] if i % 2 == 0 else ["bare", "kvpersist"]
        rnd: dict[str, Any] = {"round": i + 1, "order": order}
        for v in order:
            rnd[v] = (run_kvpersist(env, config, plan, served, chat) if v == "kvpersist"
                      else run_bare(plan, served, chat, logs))
            r = rnd[v]
            print(f"round {i + 1} {v}: serving {r['serving_s']} s, first token "
                  f"{r['to_first_token_s']} s (request {r['request_ttft_s']} s), stop "
                  f"{r['stop_s']} s", flush=True)
        k, b = rnd["kvpersist"], rnd["bare"]
        rnd["ratios"] = {"serving": round(k["serving_s"] / b["serving_s"], 3),
                         "first_token": round(k["to_first_token_s"] / b["to_first_token_s"], 3),
                         "first_request_to_steady": round(
                             k["request_ttft_s"] / statistics.median(k["steady_ttft_s"]), 3),
                         "stop": round(k["stop_s"] / b["stop_s"], 3)}
        rounds.append(rnd)

    def col(v: str, key: str) -> list[float]:
        return [float(r[v][key]) for r in rounds]

    texts = {r[v]["text"] for r in rounds for v in ("kvpersist", "bare")} | {cold.text}
    summary = {
        "schema": "kvpersist.bench.restart-downtime/1", "size": args.size,
        "others": args.others,
        "rounds": args.rounds, "prompt_tokens": cold.prompt_tokens,
        "cold_ttft_s": round(cold.ttft_s, 4),
        "kvpersist": {k: med(col("kvpersist", k)) for k in
                      ("serving_s", "ready_s", "to_first_token_s", "request_ttft_s", "stop_s")},
        "bare": {k: med(col("bare", k)) for k in
                 ("serving_s", "to_first_token_s", "request_ttft_s", "stop_s")},
        "steady_ttft_s": med([t for r in rounds for t in r["kvpersist"]["steady_ttft_s"]]),
        "prime_s": med([r["kvpersist"]["prime"]["seconds"] for r in rounds
                        if r["kvpersist"].get("prime")]),
        "ratios": {k: med([r["ratios"][k] for r in rounds]) for k in rounds[0]["ratios"]},
        "identical_texts": len(texts) == 1,
        "detail": rounds,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "detail"}, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if summary["identical_texts"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
