#!/usr/bin/env python3
"""A long soak of production traffic with restarts, kills, prunes and verifies (issue 21).

    python bench/soak.py --minutes 60 [--users 8] [--turnover 2] [--seed 1] \\
        [--l1-gb 0.125] [--l2-budget 600M] [--workdir DIR] [--out bench/results/soak.json]

Real parts only: ``kvp-admin launch`` of a float32 copy of the cpu-demo deployment (vLLM's
CPU build + the real lmcache server) on the generated tiny model, relocated to a work
directory with free loopback ports. L1 and the L2 budget are smaller than the working set, so
LMCache's LRU evicts in L1 and L2 while prefetches and stores run.

Rounds of traffic (bench/traffic.py) follow one another until the time is up: every active
user sends their conversation again, extended by a new question, all within one second;
users leave after ``--rounds-per-user`` rounds and ``--turnover`` new users join each round,
so the working set keeps growing. Every request's reference is computed first, alone and
cold (its own ``cache_salt``); every output is compared with it.

Beside each storm, at random (seeded), one event: a restart of both, of vLLM only or of the
cache server only; ``kill -9`` of the server or of vLLM followed by ``kvp-admin launch``
(which starts what is missing); ``kvp-admin warmup``; or nothing. On timers, independent of
the rounds: ``kvp-admin prune --config CONFIG --to-budget --apply --force`` and ``kvp-admin
verify CONFIG --apply`` (a run that exits non-zero is counted as a failure). A sampler
thread measures the bytes under the cache root every 0.5 s.

The summary (printed as a table, written with every record to ``--out``): requests sent,
outputs compared, wrong outputs, errors by class and phase, restarts and kills by kind,
prunes and verifies run (files deleted, quarantined), LMCache's own L1 and L2 evictions (its
``/metrics`` counters, added up across server restarts), cached-token ratio per phase, the
disk high-water mark against its bound, and that no foreign file planted under the root was
touched. The bound is the budget + reserve, or, where a start of the server found the
namespace past its share - 256 MiB, the worst case that start announced (LMCache gets at
least 256 MiB of capacity, with a warning; docs/inventory.md): the summary counts such
starts (``launches_over_budget``). Exit 1 on a wrong output, a user never served, a foreign
file touched, the disk past its bound, or a vLLM that does not serve after an event (the
run ends there, its summary written with ``aborted``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.traffic import (  # noqa: E402
    Record,
    User,
    compare,
    conversation,
    float32_config,
    references,
    storm,
    user_history,
)
from kvpersist.config.values import parse_size_or_percent  # noqa: E402
from kvpersist.demo.model import generate_model  # noqa: E402

KVP = [sys.executable, "-m", "kvpersist.cli"]
EVENTS = ("none", "restart-both", "restart-vllm", "restart-server", "kill9-server",
          "kill9-vllm", "warmup")
FOREIGN = ("notes.txt", "backup.bin.keep", "kvp-not-a-chunk.bin")

#: the error classes a request may meet in a restart's window (each is sent again, and then
#: must get its reference answer)
RESTART_WINDOW_ERRORS = {"connect", "reset", "stream", "http-500", "finish-abort",
                         "finish-None"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Deployment:
    """One relocated deployment driven through ``kvp-admin`` (subprocesses)."""

    config: Path
    root: Path
    env: dict[str, str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.env['KVP_VLLM_PORT']}"

    @property
    def state_dir(self) -> Path:
        return self.root.parent / ".kvpersist" / self.root.name

    def pid_file(self, what: str) -> Path:
        return self.state_dir / "pids" / f"{self.config.name}.{what}.pid"

    def kvp(self, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*KVP, *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, cwd=REPO)

    def kvp_json(self, *args: str, timeout: float = 900) -> Any:
        r = self.kvp(*args, "--json", timeout=timeout)
        try:
            return json.loads(r.stdout)
        except json.JSONDecodeError:
            raise RuntimeError(f"kvp-admin {' '.join(args)}: exit {r.returncode}\n"
                               f"{r.stderr[-3000:]}") from None

    def budget_plan(self) -> dict[str, Any]:
        """What the last launch planned for L2 (the budget record in the state dir): the
        share, the capacity handed to the server and the worst case on disk it announced."""
        try:
            plan = json.loads((self.state_dir / "budget.json").read_text())["plan"]
        except (OSError, ValueError, KeyError):
            return {}
        return {"share": plan["share_bytes"], "own": plan["own_bytes"],
                "capacity": plan["l2_max_capacity_bytes"],
                "worst_case": plan["worst_case_bytes"],
                "within_budget": plan["within_budget"]}

    def kill9(self, what: str) -> int:
        pid = int(self.pid_file(what).read_text().split()[0])
        os.kill(pid, signal.SIGKILL)
        return pid


def make_deployment(work: Path, *, l1_gb: float, l2_budget: str, model: Path,
                    warm: Path) -> Deployment:
    cfg = float32_config(work / "configs" / "cpu-demo-fp32")
    root = work / "cache"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    # KVP_CACHE_ROOT relocates every config of the configs directory: with the repository's,
    # configs/cpu-demo would count as a second deployment of the root and halve the share
    env.update(KVP_CONFIG_DIR=str(cfg.parent), KVP_CACHE_ROOT=str(root),
               KVP_LMCACHE_PORT=str(free_port()),
               KVP_LMCACHE_HTTP_PORT=str(free_port()), KVP_VLLM_PORT=str(free_port()),
               KVP_MODEL_PATH=str(model), KVP_L1_SIZE_GB=str(l1_gb), KVP_L2_BUDGET=l2_budget,
               KVP_L2_RESERVE="1M", KVP_WARMUP_FILE=str(warm), LMCACHE_DISABLE_BANNER="1")
    return Deployment(cfg, root, env)


class DiskSampler:
    """Bytes (allocated) of every regular file under the root, every ``interval`` s."""

    def __init__(self, root: Path, interval: float = 0.5) -> None:
        self.root, self.interval = root, interval
        self.high = 0
        self.samples = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def measure(self) -> int:
        total = 0
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = [d for d in dirnames if d != ".kvpersist"]
            for name in filenames:
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
                except OSError:
                    continue
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.high = max(self.high, self.measure())
            self.samples += 1

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(10)


class Timer:
    """Run ``action`` every ``every`` seconds (with jitter) in a thread until stopped;
    count runs and failures, add up what each run reports (``action`` returns its exit status
    and a dict of counts)."""

    def __init__(self, name: str, every: float,
                 action: Callable[[], tuple[int, dict[str, int]]], rng: random.Random) -> None:
        self.name, self.runs = name, 0
        self.failures: list[str] = []
        self.counts: Counter[str] = Counter()
        self._stop = threading.Event()

        def run() -> None:
            while not self._stop.wait(every * rng.uniform(0.5, 1.5)):
                self.runs += 1
                try:
                    code, counts = action()
                except Exception as exc:  # noqa: BLE001 - counted, reported
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                    continue
                self.counts.update(counts)
                if code != 0:
                    self.failures.append(f"exit status {code}")

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(600)


class Evictions:
    """LMCache's own eviction counters (``lmcache_mp.l1_evicted`` and
    ``lmcache_mp.l2_evicted_objects``, unit chunks: ``lmcache_mp_l1_evicted_chunks_total`` and
    ``lmcache_mp_l2_evicted_objects_chunks_total`` on the server's ``/metrics``, read with
    ``prometheus_client``'s parser; absent until the first eviction), added up across server
    restarts: a value below the last one read means a new server, whose count starts at 0."""

    NAMES = {"lmcache_mp_l1_evicted_chunks": "l1", "lmcache_mp_l2_evicted_objects_chunks": "l2"}

    def __init__(self) -> None:
        self.total: Counter[str] = Counter()
        self._last: dict[str, float] = {}

    def read(self, dep: Deployment) -> None:
        import requests
        from prometheus_client.parser import text_string_to_metric_families

        url = f"http://127.0.0.1:{dep.env['KVP_LMCACHE_HTTP_PORT']}/metrics"
        try:
            text = requests.get(url, timeout=5).text
        except requests.RequestException:
            return  # the server is away (a restart): read again after the next round
        now: Counter[str] = Counter()
        for fam in text_string_to_metric_families(text):
            tier = self.NAMES.get(fam.name.removesuffix("_total"))
            if tier:
                now[tier] += sum(s.value for s in fam.samples if s.name.endswith("_total"))
        for tier, value in now.items():
            last = self._last.get(tier, 0.0)
            self.total[tier] += int(value - last if value >= last else value)
            self._last[tier] = value


def run_event(dep: Deployment, event: str) -> dict[str, Any]:
    """Do ``event`` to the running deployment; returns what happened (for the records)."""
    t0 = time.time()
    out: dict[str, Any] = {"event": event, "started": t0}
    if event.startswith("restart-"):
        only = event.removeprefix("restart-")
        args = ["restart", str(dep.config)] + ([] if only == "both" else ["--only", only])
        doc = dep.kvp_json(*args)
        out["restarted"] = doc.get("restarted")
    elif event.startswith("kill9-"):
        what = "lmcache" if event == "kill9-server" else "vllm"
        time.sleep(1.0)  # mid-storm
        out["killed"] = dep.kill9(what)
        time.sleep(1.0)
        doc = dep.kvp_json("launch", str(dep.config))
        out["started_again"] = doc.get("started")
        out["crash_window"] = (doc.get("crash_window") or {}).get("unclean")
    elif event == "warmup":
        doc = dep.kvp_json("warmup", str(dep.config), "--wait", "60")
        out["warmup"] = {k: doc.get(k) for k in ("state", "found", "requested")}
    out["seconds"] = round(time.time() - t0, 2)
    out["ended"] = time.time()
    if out.get("restarted") or out.get("started_again"):
        out["budget"] = dep.budget_plan()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--turnover", type=int, default=2)
    ap.add_argument("--rounds-per-user", type=int, default=6)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--words", type=int, default=150)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--l1-gb", type=float, default=0.125)
    ap.add_argument("--l2-budget", default="600M")
    ap.add_argument("--prune-every", type=float, default=30.0)
    ap.add_argument("--verify-every", type=float, default=45.0)
    ap.add_argument("--workdir", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rng = random.Random(args.seed)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="kvp-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    model = generate_model("tiny", work / "hub")
    users: dict[int, User] = {}
    active: list[int] = []
    for _ in range(args.users):
        uid = len(users)
        users[uid] = User(uid, 0, user_history(uid, args.seed, args.turns, args.words))
        active.append(uid)
    warm = work / "warm.jsonl"
    warm.write_text(json.dumps({"messages": users[0].opening()[:1]}) + "\n")
    dep = make_deployment(work, l1_gb=args.l1_gb, l2_budget=args.l2_budget, model=model,
                          warm=warm)
    limit = parse_size_or_percent(args.l2_budget)[0] or 0
    refs: dict[tuple[int, int], str] = {}
    records: list[Record] = []
    events: list[dict[str, Any]] = []
    round_no = 0
    started = time.monotonic()
    deadline = started + args.minutes * 60
    launch = dep.kvp_json("launch", str(dep.config))
    if launch.get("schema") == "kvpersist.error/1":
        print(json.dumps(launch, indent=2))
        return 2
    plans = [dep.budget_plan()]
    dep.root.mkdir(exist_ok=True)
    for name in FOREIGN:
        (dep.root / name).write_bytes(b"operator data\n")
    (dep.root / "operator-dir").mkdir(exist_ok=True)
    (dep.root / "operator-dir" / "keep.bin").write_bytes(b"keep\n")
    foreign_before = {p: p.stat().st_ino for p in dep.root.rglob("*")
                      if p.name in (*FOREIGN, "keep.bin")}
    sampler = DiskSampler(dep.root)
    evictions = Evictions()
    def prune() -> tuple[int, dict[str, int]]:
        r = dep.kvp("prune", "--config", str(dep.config), "--to-budget", "--apply", "--force",
                    "--json")
        doc = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
        return r.returncode, {"deleted_files": (doc.get("deleted") or {}).get("files", 0),
                              "deleted_bytes": (doc.get("deleted") or {}).get("bytes", 0)}

    def verify() -> tuple[int, dict[str, int]]:
        r = dep.kvp("verify", str(dep.config), "--apply", "--json")
        doc = json.loads(r.stdout) if r.stdout.strip().startswith("{") else {}
        return r.returncode, {"files": int(doc.get("files", 0) or 0),
                              "findings": len(doc.get("findings") or []),
                              "quarantined": len(doc.get("quarantined") or [])}

    timers = [Timer("prune --to-budget --apply", args.prune_every, prune, rng),
              Timer("verify --apply", args.verify_every, verify, rng)]
    aborted = ""
    try:
        while time.monotonic() < deadline:
            batch = [(uid, round_no, conversation(users[uid], round_no, refs))
                     for uid in active]
            try:
                refs.update(references(dep.url, "cpu-demo", batch))
            except RuntimeError as exc:  # vLLM does not serve after the last event
                aborted = f"round {round_no}: {exc}"
                print(f"[soak] ABORTED {aborted}", flush=True)
                break
            event = rng.choice(EVENTS)
            print(f"[soak] round {round_no}: {len(batch)} users, event {event}, "
                  f"{(deadline - time.monotonic()) / 60:.1f} min left", flush=True)
            done: dict[str, Any] = {}
            th = threading.Thread(target=lambda d=done, e=event: d.update(run_event(dep, e)),
                                  daemon=True)
            th.start()
            records += storm(dep.url, "cpu-demo", batch, phase=event, spread_s=1.0,
                             seed=args.seed + round_no, retry_until=time.monotonic() + 900)
            th.join(900)
            events.append({"round": round_no, **done})
            if done.get("budget"):
                plans.append(done["budget"])
            evictions.read(dep)
            # users who had their rounds leave; new ones join
            leaving = [u for u in active if round_no - users[u].joins + 1 >= args.rounds_per_user]
            active = [u for u in active if u not in leaving]
            for _ in range(max(args.turnover, args.users - len(active))):
                uid = len(users)
                users[uid] = User(uid, round_no + 1,
                                  user_history(uid, args.seed, args.turns, args.words))
                active.append(uid)
            round_no += 1
    finally:
        for t in timers:
            t.stop()
        sampler.stop()
        stop = dep.kvp("stop", str(dep.config))
    wrong = compare(records, refs)
    foreign_after = {p: p.stat().st_ino for p in foreign_before if p.exists()}
    touched = [str(p) for p in foreign_before if foreign_after.get(p) != foreign_before[p]]
    by_phase: dict[str, Counter[str]] = defaultdict(Counter)
    cached: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for r in records:
        by_phase[r.phase]["requests"] += 1
        if r.ok:
            by_phase[r.phase]["ok"] += 1
            cached[r.phase][0] += r.cached_tokens or 0
            cached[r.phase][1] += r.prompt_tokens or 0
        else:
            by_phase[r.phase][f"error:{r.error_class}"] += 1
    unserved = {(uid, rnd) for uid, rnd in refs} - {(r.uid, r.round) for r in records if r.ok}
    announced = max((int(p["worst_case"]) for p in plans if p), default=0)
    summary = {
        "minutes": round((time.monotonic() - started) / 60, 1), "rounds": round_no,
        "users": len(users), "requests": len(records),
        "outputs_compared": sum(1 for r in records if r.ok),
        "wrong_outputs": len(wrong), "unserved": len(unserved),
        "errors": dict(Counter(r.error_class for r in records if not r.ok)),
        "events": dict(Counter(e.get("event") for e in events)),
        "prunes": timers[0].runs, "prune_failures": timers[0].failures[:5],
        "pruned": dict(timers[0].counts),
        "verifies": timers[1].runs, "verify_failures": timers[1].failures[:5],
        "verified": dict(timers[1].counts),
        "phases": {p: {**c, "cached_ratio": round(cached[p][0] / cached[p][1], 3)
                       if cached[p][1] else None} for p, c in sorted(by_phase.items())},
        "lmcache_evicted": {"l1_chunks": evictions.total["l1"],
                            "l2_objects": evictions.total["l2"]},
        "disk_high_water_bytes": sampler.high, "disk_samples": sampler.samples,
        "budget_bytes": limit, "reserve_bytes": 1 << 20,
        # each start of the server sizes LMCache's capacity as share - own, at least 256 MiB
        # (kvpersist/l2/budget.py): a start that finds the namespace past share - 256 MiB
        # announces a worst case above the budget (a warning, until pruned)
        "launch_plans": len(plans),
        "launches_over_budget": sum(1 for p in plans if p and not p["within_budget"]),
        "announced_worst_bytes": announced,
        "foreign_touched": touched, "stop_exit": stop.returncode, "aborted": aborted,
    }
    print(json.dumps(summary, indent=2))
    for line in wrong[:20]:
        print("WRONG:", line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"summary": summary, "wrong": wrong,
                                        "events": events,
                                        "records": [asdict(r) for r in records]}, indent=1)
                            + "\n")
    if not args.workdir:
        shutil.rmtree(work, ignore_errors=True)
    bound = max(limit + (1 << 20), announced)
    # exit 1 on anything the soak exists to catch: a wrong or unserved answer, an error of a
    # kind the restart window does not explain (docs/persistence.md, "Production traffic":
    # each such request is sent again), a touched operator file, the disk past its bound, a
    # failed prune or verify, or no prune or verify at all
    odd = set(summary["errors"]) - RESTART_WINDOW_ERRORS
    bad = (wrong or unserved or touched or aborted or sampler.high > bound or odd
           or timers[0].failures or timers[1].failures
           or not (timers[0].runs and timers[1].runs))
    if odd:
        print("errors outside the restart window's kinds:", sorted(odd))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
