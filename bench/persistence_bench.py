#!/usr/bin/env python3
"""Persistence benchmarks (docs/benchmarks.md, "## Persistence"). One run, one machine;
ratios matter, not absolute numbers.

    python bench/persistence_bench.py [--out results.json] [--skip-ttft] [--quick]

Measures:
1. time to first token after restarting both services vs cold prefill, on the ``bench``
   demo model (~180M parameters) with a 2k-4k-token chat history (``kvp-admin demo`` code);
2. L2 retrieve throughput after a server restart vs reading the same files raw;
3. the cost of the aesgcm serde (store and retrieve) vs no serde;
4. use_direct_io, shard_dirs and server worker counts (store/retrieve throughput);
5. ``kvp-admin launch --no-vllm`` to healthy vs starting ``lmcache server`` by hand;
6. ``kvp-admin --help`` and ``kvp-admin report`` start-up time.

Everything runs on temp cache roots and free loopback ports; every process it starts is
stopped. Page cache: where /proc/sys/vm/drop_caches is writable it is dropped before the
cold reads (reported as ``page_cache_dropped``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvpersist.demo.kvdriver import connect, shape_spec  # noqa: E402
from kvpersist.system import procs  # noqa: E402

PY = sys.executable
KVP = [PY, "-m", "kvpersist.cli"]
#: the bench model's KV geometry: 12 layers, 4 KV heads, head dim 64, bf16 -> 3 MiB chunks
BENCH_SPEC = shape_spec(4, 64, 12, num_blocks=160)


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def make_configs(tmp: Path, **generic: Any) -> Path:
    """A config dir with cpu-demo and a generic config whose l2/server keys are overridden."""
    import yaml

    cdir = tmp / "configs"
    if cdir.exists():
        shutil.rmtree(cdir)
    shutil.copytree(REPO / "configs" / "cpu-demo", cdir / "cpu-demo")
    g = yaml.safe_load((REPO / "configs" / "generic" / "lmcache.yaml").read_text())
    for key, value in generic.items():
        section, name = key.split("__")
        g[section][name] = value
    (cdir / "generic").mkdir()
    (cdir / "generic" / "lmcache.yaml").write_text(yaml.safe_dump(g))
    return cdir


def env_for(tmp: Path, cdir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    env.update({
        "KVP_CONFIG_DIR": str(cdir),
        "KVP_CACHE_ROOT": str(tmp / "cache"),
        "KVP_LMCACHE_PORT": str(procs.free_port()),
        "KVP_LMCACHE_HTTP_PORT": str(procs.free_port()),
        "KVP_VLLM_PORT": str(procs.free_port()),
        "KVP_L1_SIZE_GB": "2",
        "KVP_L2_BUDGET": "8G",
        "KVP_L2_RESERVE": "1M",
    })
    env.update(extra)
    return env


def kvp(env: dict[str, str], *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([*KVP, *args], env=env, cwd=REPO, capture_output=True, text=True)
    if check and r.returncode != 0:
        raise RuntimeError(f"kvp-admin {' '.join(args)}: {r.stderr[-2000:]}")
    return r


def urls(env: dict[str, str]) -> tuple[str, str]:
    return (f"tcp://127.0.0.1:{env['KVP_LMCACHE_PORT']}",
            f"http://127.0.0.1:{env['KVP_LMCACHE_HTTP_PORT']}")


def namespace(env: dict[str, str]) -> str:
    return json.loads(kvp(env, "render", "cpu-demo", "--json").stdout)["namespace"]


def l2_roundtrip(tmp: Path, label: str, seqs: int, tokens: int, **generic: Any) -> dict[str, Any]:
    """Store ``seqs`` sequences, stop, start, retrieve them all from L2; then read the same
    files raw. Returns MB/s figures."""
    serde = generic.pop("serde", None)
    cdir = make_configs(tmp, **generic)
    extra = {"KVP_L2_SERDE": serde} if serde else {}
    env = env_for(tmp, cdir, **extra)
    root = Path(env["KVP_CACHE_ROOT"])
    if root.exists():
        shutil.rmtree(root)
    ns = namespace(env)
    rpc, http = urls(env)
    kvp(env, "launch", "cpu-demo", "--no-vllm")
    try:
        with connect(rpc, http, ns, num_tokens=tokens, kvcache_shape_spec=BENCH_SPEC) as d:
            t = time.perf_counter()
            digests = {s: d.store(s) for s in range(1, seqs + 1)}
            store_s = time.perf_counter() - t
    finally:
        kvp(env, "stop", "cpu-demo")  # SIGTERM: the server drains its store queue
    files = [p for p in root.rglob("*.bin") if p.name.startswith(ns)]
    nbytes = sum(p.stat().st_size for p in files)
    kvp(env, "launch", "cpu-demo", "--no-vllm")
    log = root.parent / ".kvpersist" / root.name / "logs" / "lmcache-server.log"
    offset = log.stat().st_size
    dropped = drop_caches()
    ok = 0
    try:
        with connect(rpc, http, ns, num_tokens=tokens, kvcache_shape_spec=BENCH_SPEC) as d:
            t = time.perf_counter()
            for s, want in digests.items():
                lk, got = d.lookup_and_retrieve(s)
                ok += int(got == want)
            retrieve_s = time.perf_counter() - t
    finally:
        kvp(env, "stop", "cpu-demo")
    # The server's own L2 -> L1 prefetch time (disk read + deserialize), from its log.
    import re

    with open(log, "rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    pre = [(int(n), float(ms)) for n, ms in
           re.findall(r"retained keys \(\d+ L1, (\d+) L2\) in ([\d.]+) ms", text)]
    l2_chunks = sum(n for n, _ in pre)
    l2_s = sum(ms for _, ms in pre) / 1000
    drop_caches()
    t = time.perf_counter()
    for p in files:
        with open(p, "rb") as f:
            while f.read(1 << 20):
                pass
    raw_s = time.perf_counter() - t
    shutil.rmtree(root)
    mb = nbytes / 1e6
    return {"label": label, "files": len(files), "mbytes": round(mb, 1),
            "store_mb_s": round(mb / store_s, 1), "retrieve_after_restart_mb_s":
            round(mb / retrieve_s, 1), "raw_read_mb_s": round(mb / raw_s, 1),
            "retrieve_vs_raw": round(raw_s / retrieve_s, 3),
            "l2_prefetch_mb_s": round(l2_chunks * nbytes / len(files) / 1e6 / l2_s, 1)
            if l2_s else None,
            "l2_prefetch_vs_raw": round((l2_chunks * nbytes / len(files) / l2_s)
                                        / (nbytes / raw_s), 3) if l2_s else None,
            "sequences_equal": ok,
            "sequences": seqs, "page_cache_dropped": dropped}


def launch_vs_hand(tmp: Path) -> dict[str, Any]:
    cdir = make_configs(tmp)
    env = env_for(tmp, cdir)
    t = time.perf_counter()
    kvp(env, "launch", "cpu-demo", "--no-vllm")
    launch_s = time.perf_counter() - t
    kvp(env, "stop", "cpu-demo")
    argv = json.loads(kvp(env, "render", "cpu-demo", "--json").stdout)["lmcache_server_argv"]
    argv[0] = str(Path(PY).parent / "lmcache")
    http = urls(env)[1]
    t = time.perf_counter()
    p = subprocess.Popen(argv, env=dict(env, LMCACHE_DISABLE_BANNER="1"),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import requests

    def ok() -> bool:
        try:
            return requests.get(f"{http}/healthcheck", timeout=1).status_code == 200
        except requests.RequestException:
            return False
    procs.wait_for(ok, 120, 0.1)
    hand_s = time.perf_counter() - t
    p.terminate()
    p.wait(timeout=60)
    return {"kvp_admin_launch_to_healthy_s": round(launch_s, 2),
            "lmcache_server_by_hand_to_healthy_s": round(hand_s, 2)}


def startup_times(tmp: Path) -> dict[str, Any]:
    cdir = make_configs(tmp)
    env = env_for(tmp, cdir)
    Path(env["KVP_CACHE_ROOT"]).mkdir(mode=0o700, exist_ok=True)

    def t(*args: str) -> float:
        xs = []
        for _ in range(5):
            t0 = time.perf_counter()
            subprocess.run([*KVP, *args], env=env, cwd=REPO, capture_output=True)
            xs.append(time.perf_counter() - t0)
        return round(statistics.median(xs), 3)
    return {"help_s": t("--help"),
            "report_s": t("report", "--root", env["KVP_CACHE_ROOT"], "--config", "cpu-demo")}


def ttft(tmp: Path, turns: int) -> dict[str, Any]:
    from kvpersist.demo.run import run_demo

    res = run_demo(tmp / "demo", size="bench", turns=turns, words_per_turn=150,
                   progress=lambda m: print(m, file=sys.stderr))
    d = res.to_dict()
    return {"prompt_tokens": res.cold.prompt_tokens, "cold_ttft_s": round(res.cold.ttft_s, 3),
            "warm_ttft_s": round(res.warm.ttft_s, 3), "ratio": round(res.ttft_ratio, 3),
            "tokens_from_disk": res.warm.tokens_from_disk, "identical": res.identical,
            "launch_s": [round(res.cold.launch_s, 1), round(res.warm.launch_s, 1)],
            "l2_chunks_hit": d["warm"]["l2_chunks_hit"]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--skip-ttft", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer sequences")
    ap.add_argument("--turns", type=int, default=16)
    args = ap.parse_args()
    seqs, tokens = (4, 2048) if args.quick else (8, 2048)
    out: dict[str, Any] = {"machine": {"cpus": os.cpu_count()}}
    with tempfile.TemporaryDirectory(prefix="kvp-bench-") as d:
        tmp = Path(d)
        out["startup"] = startup_times(tmp)
        print(json.dumps(out["startup"]), file=sys.stderr)
        out["launch"] = launch_vs_hand(tmp)
        print(json.dumps(out["launch"]), file=sys.stderr)
        variants = [
            ("aesgcm (default)", {}),
            ("no serde", {"serde": "none"}),
            ("use_direct_io", {"l2__use_direct_io": True}),
            ("shard_dirs", {"l2__shard_dirs": True}),
            ("max_workers 2", {"server__max_workers": 2}),
        ]
        out["l2"] = []
        for label, gen in variants:
            r = l2_roundtrip(tmp, label, seqs, tokens, **gen)
            print(json.dumps(r), file=sys.stderr)
            out["l2"].append(r)
        if not args.skip_ttft:
            out["ttft"] = ttft(tmp, args.turns)
            print(json.dumps(out["ttft"]), file=sys.stderr)
    text = json.dumps(out, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
