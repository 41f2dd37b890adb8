#!/usr/bin/env python3
"""A restart that users do not notice (docs/benchmarks.md, "First chat after a restart").

    python bench/first_chat_restart.py [--rounds 8] [--dtypes bfloat16,float32]
        [--size tiny] [--no-bare] [--before DIR [--before-every N]] [--workdir DIR]
        [--out FILE]

Real vLLM (CPU build) and a real ``lmcache server`` on a generated demo model, one deployment
per KV dtype. Two returning users: **W**, whose opening (every message but the last
question) is the warm set (``KVP_WARMUP_FILE``), and **O**, outside the warm set; both chats
are computed and stored once, before the rounds. Each round runs, for every dtype (the
dtypes' order alternating between rounds), two variants whose order alternates too, each
from everything stopped, whole processes:

- ``kvpersist``: ``kvp-admin launch CONFIG`` (what ``kvp-admin restart`` runs after its stop:
  preflight, the crash-window check, both services, the prime, the canary, the warm-up), then
  W's chat (**W first**) and O's chat (**O first**); then, on the same running deployment,
  W's chat again (**W running**: vLLM's own prefix cache, what W saw before the restart) and,
  after ``/reset_prefix_cache``, O's chat (**O running**: served from the running cache
  server); ``kvp-admin stop``;
- ``bare``: the very argv and environment kvpersist renders for the two services, started by
  hand at once, vLLM polled every 0.1 s, then W's chat; SIGTERM to each, waited for;
- ``before`` (with ``--before DIR``, every ``--before-every`` rounds): the ``kvpersist``
  variant with the kvpersist of another checkout (DIR: its ``kvpersist`` package, e.g. the
  commit before a change), for the breakdown before and after in the same run.

Per request, besides the client's time to first token, vLLM's own split (the deltas of its
metrics around the request): ``engine`` (arrival in the engine to the first token),
``queue`` (the scheduler's wait, with the connector's lookup and the asynchronous KV load),
``prefill``, ``front`` (client TTFT − engine TTFT: HTTP, the chat template, the tokenizer,
the stream), ``vllm_hits`` (tokens from vLLM's own prefix cache), ``ext_hits`` (tokens from
the cache server), and the chunks the cache server found in L1 and L2 (its log).
Restart to first answer: from the start of the launch (or of the bare processes) to W's
first streamed token. Load (os.getloadavg) is recorded per variant. Every W answer (and every
O answer) must be the same text in a dtype.
"""

from __future__ import annotations

import argparse
import json
import os
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
sys.path.insert(0, str(REPO / "bench"))

from restart_downtime import (  # noqa: E402
    ServingPoll,
    _sigterm_to_exit,
    bare_processes,
    bench_env,
    kvp,
    log_size,
    served_from,
)

from kvpersist.demo.chat import chat_completion, long_chat  # noqa: E402
from kvpersist.demo.model import generate_model, identity_env_values  # noqa: E402
from kvpersist.stack.launch_plan import LaunchPlan, prepare_launch  # noqa: E402

METRICS = {"engine": "vllm:time_to_first_token_seconds_sum",
           "queue": "vllm:request_queue_time_seconds_sum",
           "prefill": "vllm:request_prefill_time_seconds_sum",
           "vllm_hits": "vllm:prefix_cache_hits_total",
           "ext_hits": "vllm:external_prefix_cache_hits_total"}


def metric_sums(url: str) -> dict[str, float]:
    import requests

    text = requests.get(f"{url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for key, name in METRICS.items():
        out[key] = sum(float(v) for v in re.findall(
            rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))
    return out


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def timed(plan: LaunchPlan, served: str, chat: list[dict[str, str]],
          t0: float | None = None) -> dict[str, Any]:
    """One streamed chat with vLLM's split around it."""
    before = metric_sums(plan.vllm_url)
    since = log_size(plan.server_log)
    r = chat_completion(plan.vllm_url, served, chat, max_tokens=16, min_tokens=16)
    after = metric_sums(plan.vllm_url)
    rec: dict[str, Any] = {"ttft": round(r.ttft_s, 4)}
    for k in METRICS:
        rec[k] = round(after[k] - before[k], 4)
    rec["front"] = round(rec["ttft"] - rec["engine"], 4)
    rec["l1_l2"] = served_from(plan.server_log, since)
    rec["text"] = r.text
    rec["prompt_tokens"] = r.prompt_tokens
    if t0 is not None:
        rec["to_first_token_s"] = round(time.monotonic() - t0 - (r.total_s - r.ttft_s), 3)
    return rec


def reset_prefix_cache(plan: LaunchPlan) -> None:
    import requests

    requests.post(f"{plan.vllm_url}/reset_prefix_cache", timeout=30).raise_for_status()


def kvp_at(code: Path, env: dict[str, str], *args: str
           ) -> tuple[subprocess.CompletedProcess[str], float]:
    """``kvp-admin ARGS`` whole process, importing the kvpersist package under ``code``."""
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "kvpersist.cli", *args],
                       env={**env, "PYTHONPATH": str(code)}, cwd=code, capture_output=True,
                       text=True, timeout=1200)
    took = time.monotonic() - t0
    if r.returncode != 0:
        raise SystemExit(f"kvp-admin {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r, took


def run_kvpersist(env: dict[str, str], config: str, plan: LaunchPlan, served: str,
                  w: list[dict[str, str]], o: list[dict[str, str]],
                  code: Path = REPO) -> dict[str, Any]:
    rec: dict[str, Any] = {"load": loadavg(), "code": str(code)}
    t0 = time.monotonic()
    poll = ServingPoll(plan, t0)
    launched, ready = kvp_at(code, env, "launch", config, "--json")
    rec["serving_s"] = round(poll.wait(5), 3)
    rec["ready_s"] = round(ready, 3)
    rec["w_first"] = timed(plan, served, w, t0)
    rec["o_first"] = timed(plan, served, o)
    rec["w_running"] = timed(plan, served, w)
    reset_prefix_cache(plan)
    rec["o_running"] = timed(plan, served, o)
    info = json.loads(launched.stdout)
    rec["prime"] = info.get("prime")
    rec["canary"] = info.get("canary")
    rec["warmup"] = info.get("warmup")
    try:
        state = json.loads(Path(plan.warmup_state_file).read_text())
        rec["warmup_loads"] = state.get("loads")
        rec["warmup_found"] = state.get("found_chunks")
    except (OSError, ValueError):
        rec["warmup_loads"] = None
    stopped, took = kvp_at(code, env, "stop", config, "--json")
    rec["stop_s"] = round(took, 3)
    return rec


def run_bare(plan: LaunchPlan, served: str, w: list[dict[str, str]],
             logs: Path) -> dict[str, Any]:
    rec: dict[str, Any] = {"load": loadavg()}
    t0 = time.monotonic()
    with bare_processes(plan, logs) as (srv, vl):
        rec["serving_s"] = round(ServingPoll(plan, t0).wait(900), 3)
        rec["w_first"] = timed(plan, served, w, t0)
        t = time.monotonic()
        _sigterm_to_exit(vl)
        _sigterm_to_exit(srv)
        rec["stop_s"] = round(time.monotonic() - t, 3)
    return rec


def tiny_config(wd: Path, size: str, dtype: str) -> str:
    """configs/cpu-demo's identity with the demo model ``size``'s values and ``dtype``."""
    src = REPO / "configs" / "cpu-demo" / "identity.env"
    values = identity_env_values(size)
    values.update({"KVP_KV_CACHE_DTYPE": dtype, "KVP_MODEL_DTYPE": dtype})
    lines = []
    for line in src.read_text().splitlines():
        key = line.split("=", 1)[0]
        lines.append(f"{key}={values[key]}" if key in values else line)
    cfg = wd / f"config-{size}-{dtype}"
    cfg.mkdir(parents=True, exist_ok=True)
    (cfg / "identity.env").write_text("\n".join(lines) + "\n")
    return str(cfg / "identity.env")


class Deployment:
    def __init__(self, wd: Path, size: str, dtype: str, model: Path,
                 w: list[dict[str, str]], o: list[dict[str, str]]) -> None:
        self.dtype = dtype
        self.wd = wd / dtype
        self.wd.mkdir(parents=True, exist_ok=True)
        self.config = tiny_config(self.wd, size, dtype)
        warm = self.wd / "warm.jsonl"
        warm.write_text(json.dumps({"messages": w[:-1]}) + "\n")
        self.env = bench_env(self.wd / "cache", model, warm)
        (self.wd / "cache").mkdir(mode=0o700, exist_ok=True)
        prepared = prepare_launch(self.config, environ=self.env)
        self.plan, self.served = prepared.plan, prepared.dep.settings.served_model_name
        self.logs = self.wd / "logs"
        self.logs.mkdir(exist_ok=True)
        self.w, self.o = w, o

    def cold(self) -> dict[str, Any]:
        """Once: both chats computed and stored."""
        kvp(self.env, "launch", self.config)
        w = chat_completion(self.plan.vllm_url, self.served, self.w, max_tokens=16,
                            min_tokens=16)
        o = chat_completion(self.plan.vllm_url, self.served, self.o, max_tokens=16,
                            min_tokens=16)
        time.sleep(2)
        kvp(self.env, "stop", self.config)
        return {"w_ttft": round(w.ttft_s, 4), "o_ttft": round(o.ttft_s, 4),
                "w_tokens": w.prompt_tokens, "o_tokens": o.prompt_tokens,
                "w_text": w.text, "o_text": o.text}


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def med(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    return {"median": round(statistics.median(xs), 4), "min": round(min(xs), 4),
            "max": round(max(xs), 4), "n": len(xs)}


def summarize(rounds: list[dict[str, Any]], dtype: str,
              variant: str = "kvpersist") -> dict[str, Any]:
    ks = [r[dtype][variant] for r in rounds if variant in r.get(dtype, {})]
    bs = [r[dtype] for r in rounds if "bare" in r.get(dtype, {})]
    out: dict[str, Any] = {"restarts": len(ks)}
    out["w_first_over_running"] = med([ratio(k["w_first"]["ttft"], k["w_running"]["ttft"])
                                       for k in ks])
    out["o_first_over_running"] = med([ratio(k["o_first"]["ttft"], k["o_running"]["ttft"])
                                       for k in ks])
    for req in ("w_first", "w_running", "o_first", "o_running"):
        out[req] = {f: med([k[req][f] for k in ks]) for f in
                    ("ttft", "front", "engine", "queue", "prefill", "vllm_hits", "ext_hits")}
    out["first_answer_over_bare"] = med([ratio(r[variant]["w_first"]["to_first_token_s"],
                                               r["bare"]["w_first"]["to_first_token_s"])
                                         for r in bs if variant in r])
    out["serving_over_bare"] = med([ratio(r[variant]["serving_s"], r["bare"]["serving_s"])
                                    for r in bs if variant in r])
    out["kvpersist_first_answer_s"] = med([k["w_first"]["to_first_token_s"] for k in ks])
    out["bare_first_answer_s"] = med([r["bare"]["w_first"]["to_first_token_s"] for r in bs])
    out["ready_minus_serving_s"] = med([k["ready_s"] - k["serving_s"] for k in ks])
    out["load1"] = med([k["load"][0] for k in ks] + [r["bare"]["load"][0] for r in bs])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--dtypes", default="bfloat16,float32")
    ap.add_argument("--size", default="tiny")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--no-bare", action="store_true")
    ap.add_argument("--before", default="", help="a checkout whose kvpersist runs the "
                    "'before' variant")
    ap.add_argument("--before-every", type=int, default=1)
    ap.add_argument("--workdir", default="")
    ap.add_argument("--skip-cold", action="store_true",
                    help="the workdir's deployments hold both chats already (an earlier run)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    before = Path(args.before).resolve() if args.before else None

    wd = Path(args.workdir or tempfile.mkdtemp(prefix="kvp-firstchat-"))
    wd.mkdir(parents=True, exist_ok=True)
    model = generate_model(args.size, wd / "hub")
    w = long_chat(turns=args.turns, words_per_turn=150, seed=4242)
    o = long_chat(turns=args.turns, words_per_turn=150, seed=7070)
    deps = {d: Deployment(wd, args.size, d, model, w, o) for d in args.dtypes.split(",")}
    result: dict[str, Any] = {"schema": "kvpersist.bench.first-chat-restart/1",
                              "size": args.size, "started": time.strftime(
                                  "%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "load_start": loadavg(), "cold": {}, "rounds": []}
    for d, dep in deps.items():
        if args.skip_cold:
            continue
        result["cold"][d] = dep.cold()
        print(f"{d} cold: W {result['cold'][d]['w_ttft']} s ({result['cold'][d]['w_tokens']} "
              f"tokens), O {result['cold'][d]['o_ttft']} s", flush=True)
    names = list(deps)
    for i in range(args.rounds):
        rnd: dict[str, Any] = {"round": i + 1}
        for d in (names if i % 2 == 0 else names[::-1]):
            dep = deps[d]
            order = ["kvpersist"] if args.no_bare else ["kvpersist", "bare"]
            if before is not None and i % args.before_every == 0:
                order.append("before")
            shift = (i // 2) % len(order)
            order = order[shift:] + order[:shift]
            rnd[d] = {"order": order}
            for v in order:
                try:
                    if v == "bare":
                        rnd[d][v] = run_bare(dep.plan, dep.served, dep.w, dep.logs)
                    else:
                        rnd[d][v] = run_kvpersist(dep.env, dep.config, dep.plan, dep.served,
                                                  dep.w, dep.o, before if v == "before"
                                                  else REPO)
                except BaseException:
                    subprocess.run([sys.executable, "-m", "kvpersist.cli", "stop",
                                    dep.config], env=dep.env, cwd=REPO, timeout=300)
                    raise
            k = rnd[d]["kvpersist"]
            if "before" in rnd[d]:
                bb = rnd[d]["before"]
                print(f"round {i + 1} {d} before: W first {bb['w_first']['ttft'] * 1000:.0f} ms"
                      f" (front {bb['w_first']['front'] * 1000:.0f}, queue "
                      f"{bb['w_first']['queue'] * 1000:.0f}, prefill "
                      f"{bb['w_first']['prefill'] * 1000:.0f}) / running "
                      f"{bb['w_running']['ttft'] * 1000:.0f} ms; O first "
                      f"{bb['o_first']['ttft'] * 1000:.0f} / running "
                      f"{bb['o_running']['ttft'] * 1000:.0f} ms; first answer "
                      f"{bb['w_first']['to_first_token_s']} s", flush=True)
            line = (f"round {i + 1} {d}: W first {k['w_first']['ttft'] * 1000:.0f} ms "
                    f"(front {k['w_first']['front'] * 1000:.0f}, queue "
                    f"{k['w_first']['queue'] * 1000:.0f}, prefill "
                    f"{k['w_first']['prefill'] * 1000:.0f}, vllm hits "
                    f"{k['w_first']['vllm_hits']:.0f}, ext {k['w_first']['ext_hits']:.0f}) / "
                    f"running {k['w_running']['ttft'] * 1000:.0f} ms; O first "
                    f"{k['o_first']['ttft'] * 1000:.0f} / running "
                    f"{k['o_running']['ttft'] * 1000:.0f} ms; ready {k['ready_s']} s serving "
                    f"{k['serving_s']} s first answer {k['w_first']['to_first_token_s']} s")
            if "bare" in rnd[d]:
                b = rnd[d]["bare"]
                line += (f"; bare serving {b['serving_s']} s first answer "
                         f"{b['w_first']['to_first_token_s']} s")
            print(line + f"; load {k['load']}", flush=True)
        result["rounds"].append(rnd)
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    result["load_end"] = loadavg()
    result["summary"] = {d: summarize(result["rounds"], d) for d in deps}
    if before is not None:
        result["before"] = str(before)
        result["summary_before"] = {d: summarize(result["rounds"], d, "before") for d in deps}
    texts_ok = True
    for d in deps:
        for who in ("w", "o"):
            texts = ({result["cold"][d][f"{who}_text"]} if d in result["cold"] else set())
            for r in result["rounds"]:
                for v in ("kvpersist", "bare", "before"):
                    rec = r[d].get(v)
                    if rec is None:
                        continue
                    for req in (f"{who}_first", f"{who}_running"):
                        if req in rec:
                            texts.add(rec[req]["text"])
            result["summary"][d][f"{who}_identical_texts"] = len(texts) == 1
            texts_ok &= len(texts) == 1
    print(json.dumps(result["summary"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0 if texts_ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
