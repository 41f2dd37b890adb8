#!/usr/bin/env python3
"""Shared-tier throughput (docs/benchmarks.md, "## Shared tier"). One run, one machine;
ratios matter, not absolute numbers.

    python bench/shared_tier_bench.py [--seqs 8] [--adapters resp,valkey] [--out FILE]
    python bench/shared_tier_bench.py --policies [--rounds 5] [--seqs 6] [--out FILE]

For each adapter: a real redis-server (ACL user) and two deployments started by
``kvp-admin launch --no-vllm`` with different cache roots ("host A", "host B"):

1. store: host A stores N sequences through LMCache's MP client; the time until every chunk
   is on A's NVMe and on the shared tier (LMCache writes both tiers asynchronously);
2. local retrieve: A restarted (L1 empty): lookup + retrieve of every sequence from the NVMe;
3. shared retrieve: B (fresh cache root, same serde key) retrieves the same sequences, all
   from the shared tier.

``--policies`` compares LMCache's ``--l2-store-policy`` x ``--l2-prefetch-policy`` choices
on host B (docs/benchmarks.md, "Shared tier: store and prefetch policies"): per round a fresh
store, host A stores the sequences once, then for every variant, in an order rotated per
round so that the shared machine's load falls on all of them alike, a fresh host B started
with that variant retrieves them twice (first from the shared tier; then again), stores new
sequences of its own and retrieves those. The store's ``INFO commandstats`` (GET calls) says
which pass went to the shared tier. kvp-admin renders fixed policies; the bench substitutes
them in its own ``kvp-admin`` processes only (a ``sitecustomize`` on their PYTHONPATH) and
checks the server's command line.

Uses the test suite's helpers for redis and the deployment; every process is stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvpersist.demo.kvdriver import connect, shape_spec  # noqa: E402
from tests.fullstack._stack import Stack  # noqa: E402
from tests.integration._redis import start_redis  # noqa: E402
from tests.integration.test_shared_tier import host, share_key  # noqa: E402

#: 8 KV heads x head dim 128 x 8 layers, bf16: 8 MiB per 256-token chunk
SPEC = shape_spec(8, 128, 8)
CHUNK_BYTES = 2 * 256 * 8 * 128 * 2 * 8


def retrieve_all(s: Stack, ns: str, seqs: int, digests: dict[int, list[str]]) -> float:
    with connect(s.rpc, s.http, ns, kvcache_shape_spec=SPEC) as d:
        t0 = time.perf_counter()
        for seq in range(seqs):
            lk, got = d.lookup_and_retrieve(seq)
            if lk.hit_chunks != lk.total_chunks or got != digests[seq]:
                raise RuntimeError(f"sequence {seq}: {lk}, bytes equal: {got == digests[seq]}")
        return time.perf_counter() - t0


def run(adapter: str, seqs: int, tmp: Path) -> dict[str, Any]:
    r = start_redis(tmp / "store", maxmemory="4gb")
    url = r.url + ("?adapter=valkey" if adapter == "valkey" else "")
    a, b = host(tmp, "a", r), host(tmp, "b", r)
    for s in (a, b):
        s.env.update({"KVP_SHARED_TIER": url, "KVP_L1_SIZE_GB": "2", "KVP_L2_BUDGET": "8G"})
    try:
        ns = a.render()["namespace"]
        a.launch("--no-vllm")
        chunks = seqs * 4
        with connect(a.rpc, a.http, ns, kvcache_shape_spec=SPEC) as d:
            t0 = time.perf_counter()
            digests = {seq: d.store(seq) for seq in range(seqs)}
            t_l1 = time.perf_counter() - t0
            t_local = t_shared = None
            while time.perf_counter() - t0 < 600 and (t_local is None or t_shared is None):
                if t_local is None and len(a.chunk_files(ns + "_")) >= chunks:
                    t_local = time.perf_counter() - t0
                if t_shared is None and len(r.scan_keys(f"{ns}@*")) >= chunks:
                    t_shared = time.perf_counter() - t0
                time.sleep(0.05)
        a.stop()
        a.launch("--no-vllm")
        local = retrieve_all(a, ns, seqs, digests)
        a.stop()
        share_key(a, b)
        b.launch("--no-vllm")
        shared = retrieve_all(b, ns, seqs, digests)
        b.stop()
        mib = chunks * CHUNK_BYTES / 2**20
        return {"adapter": adapter, "chunks": chunks, "mib": mib,
                "store_to_l1_s": round(t_l1, 2),
                "store_on_nvme_s": round(t_local or -1, 2),
                "store_on_shared_s": round(t_shared or -1, 2),
                "retrieve_local_s": round(local, 2), "retrieve_shared_s": round(shared, 2),
                "retrieve_local_mib_s": round(mib / local, 1),
                "retrieve_shared_mib_s": round(mib / shared, 1),
                "shared_over_local_retrieve_time": round(shared / local, 2)}
    finally:
        a.cleanup()
        b.cleanup()
        r.stop()


POLICY_VARIANTS = (("default", "default"), ("default", "retain"),
                   ("skip_l1", "default"), ("skip_l1", "retain"))
_SITE = """import os
_p = os.environ.get("KVP_BENCH_POLICIES")
if _p:
    import kvpersist.stack.render as _r
    _r.SHARED_STORE_POLICY, _r.SHARED_PREFETCH_POLICY = _p.split(",")
"""


def _gets(r: Any) -> int:
    """GET calls the store has answered so far (INFO commandstats)."""
    for line in r.nodes[0].cli("info", "commandstats").splitlines():
        if line.startswith("cmdstat_get:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


def _server_policies(s: Stack) -> tuple[str, str]:
    pid = int(s.pid_file.read_text().split()[0])
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return (argv[argv.index("--l2-store-policy") + 1],
            argv[argv.index("--l2-prefetch-policy") + 1])


def _timed_retrieve(s: Stack, ns: str, seqs: list[int], digests: dict[int, list[str]],
                    r: Any) -> tuple[float, int]:
    """(seconds, store GET calls) of a lookup + retrieve of every sequence (full hits)."""
    gets = _gets(r)
    with connect(s.rpc, s.http, ns, kvcache_shape_spec=SPEC) as d:
        t0 = time.perf_counter()
        for seq in seqs:
            lk, got = d.lookup_and_retrieve(seq)
            if lk.hit_chunks != lk.total_chunks or got != digests[seq]:
                raise RuntimeError(f"sequence {seq}: {lk}, bytes equal: {got == digests[seq]}")
        took = time.perf_counter() - t0
    return took, _gets(r) - gets


def policy_round(rnd: int, seqs: int, tmp: Path, site: Path) -> list[dict[str, Any]]:
    r = start_redis(tmp / "store", maxmemory="4gb")
    a = host(tmp, "a", r)
    a.env.update({"KVP_L1_SIZE_GB": "2", "KVP_L2_BUDGET": "8G"})
    out: list[dict[str, Any]] = []
    try:
        ns = a.render()["namespace"]
        a.launch("--no-vllm")
        with connect(a.rpc, a.http, ns, kvcache_shape_spec=SPEC) as d:
            digests = {seq: d.store(seq) for seq in range(seqs)}
        deadline = time.monotonic() + 600
        while len(r.scan_keys(f"{ns}@*")) < seqs * 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        a.stop()
        shared = list(range(seqs))
        k = rnd % len(POLICY_VARIANTS)
        for i, (store_p, prefetch_p) in enumerate(POLICY_VARIANTS[k:] + POLICY_VARIANTS[:k]):
            b = host(tmp, f"b{i}", r)
            b.env.update({"KVP_L1_SIZE_GB": "2", "KVP_L2_BUDGET": "8G",
                          "KVP_BENCH_POLICIES": f"{store_p},{prefetch_p}",
                          "PYTHONPATH": str(site)})
            try:
                share_key(a, b)
                b.launch("--no-vllm")
                if _server_policies(b) != (store_p, prefetch_p):
                    raise RuntimeError(f"server runs {_server_policies(b)}")
                load = Path("/proc/loadavg").read_text().split()[0]
                first, first_gets = _timed_retrieve(b, ns, shared, digests, r)
                again, again_gets = _timed_retrieve(b, ns, shared, digests, r)
                own = [1000 * (rnd + 1) + 100 * i + j for j in range(max(1, seqs // 2))]
                before = len(r.scan_keys(f"{ns}@*"))
                with connect(b.rpc, b.http, ns, kvcache_shape_spec=SPEC) as d:
                    t0 = time.perf_counter()
                    digests.update({seq: d.store(seq) for seq in own})
                    t_l1 = time.perf_counter() - t0
                    t_both = None
                    while time.perf_counter() - t0 < 600 and t_both is None:
                        if (len(b.chunk_files(ns + "_")) >= len(own) * 4 and
                                len(r.scan_keys(f"{ns}@*")) >= before + len(own) * 4):
                            t_both = time.perf_counter() - t0
                        time.sleep(0.05)
                mine, mine_gets = _timed_retrieve(b, ns, own, digests, r)
                b.stop()
                mib = len(shared) * 4 * CHUNK_BYTES / 2**20
                own_mib = len(own) * 4 * CHUNK_BYTES / 2**20
                out.append({
                    "round": rnd + 1, "order": i + 1, "store_policy": store_p,
                    "prefetch_policy": prefetch_p, "load1": float(load),
                    "shared_mib": mib, "own_mib": own_mib,
                    "first_retrieve_s": round(first, 2), "first_gets": first_gets,
                    "again_retrieve_s": round(again, 2), "again_gets": again_gets,
                    "own_store_l1_s": round(t_l1, 2),
                    "own_store_both_tiers_s": round(t_both or -1, 2),
                    "own_retrieve_s": round(mine, 2), "own_gets": mine_gets})
                print(json.dumps(out[-1]), flush=True)
            finally:
                b.cleanup()
    finally:
        a.cleanup()
        r.stop()
    return out


SUMMARY_FIELDS = ("first_retrieve_s", "again_retrieve_s", "own_store_both_tiers_s",
                  "own_retrieve_s", "first_gets", "again_gets", "own_gets", "load1")


def summarize(results: list[dict[str, Any]]) -> str:
    """A markdown table of the policy runs: per variant, the median and (min-max) of every
    field over the rounds."""
    import statistics

    head = ["store / prefetch policy", "rounds", *SUMMARY_FIELDS]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for store_p, prefetch_p in POLICY_VARIANTS:
        runs = [x for x in results if (x.get("store_policy"), x.get("prefetch_policy"))
                == (store_p, prefetch_p)]
        if not runs:
            continue
        cells = [f"`{store_p}` / `{prefetch_p}`", str(len(runs))]
        for f in SUMMARY_FIELDS:
            vals = [float(x[f]) for x in runs]
            med = statistics.median(vals)
            cells.append(f"{med:g} ({min(vals):g}-{max(vals):g})")
        rows.append("| " + " | ".join(cells) + " |")
    # paired within each round (the same store, the same minutes of load): a variant's time
    # over the default's
    timed = ("first_retrieve_s", "again_retrieve_s", "own_store_both_tiers_s",
             "own_retrieve_s")
    base = {x["round"]: x for x in results
            if (x["store_policy"], x["prefetch_policy"]) == POLICY_VARIANTS[0]}
    rows += ["", "| variant / `default`,`default` in the same round | "
             + " | ".join(timed) + " |", "|---|" + "---|" * len(timed)]
    for variant in POLICY_VARIANTS[1:]:
        runs = [x for x in results if (x["store_policy"], x["prefetch_policy"]) == variant
                and x["round"] in base]
        if not runs:
            continue
        cells = [f"`{variant[0]}` / `{variant[1]}` ({len(runs)} rounds)"]
        for f in timed:
            ratios = [float(x[f]) / float(base[x["round"]][f]) for x in runs]
            cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-"
                         f"{max(ratios):.2f})")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def ttft(tmp: Path, turns: int) -> dict[str, Any]:
    """Time to first token on the ``bench`` demo model (~186M parameters, vLLM CPU build):
    cold prefill on A, A restarted (from its NVMe), fresh B (from the shared tier)."""
    from kvpersist.demo.chat import chat_completion, long_chat
    from kvpersist.demo.model import generate_model
    from kvpersist.demo.run import _identity_file

    model = generate_model("bench", tmp / "models")
    config = _identity_file(tmp, "bench")
    chat = long_chat(turns=turns, words_per_turn=150, seed=5)
    warmup = [{"role": "user", "content": "Hello."}]

    def first_token(s: Stack) -> Any:
        # a short unrelated request first keeps first-request overheads out (as in
        # persistence_bench.py)
        chat_completion(s.vllm_url, "cpu-demo", warmup, max_tokens=2)
        return chat_completion(s.vllm_url, "cpu-demo", chat, max_tokens=16)

    r = start_redis(tmp / "store", maxmemory="4gb")
    a, b = host(tmp, "a", r), host(tmp, "b", r)
    for s in (a, b):
        s.config = config
        s.env["KVP_MODEL_PATH"] = str(model)
    try:
        a.launch()
        cold = first_token(a)
        a.stop()
        a.launch()
        local = first_token(a)
        a.stop()
        share_key(a, b)
        b.launch()
        shared = first_token(b)
        b.stop()
        return {"prompt_tokens": cold.prompt_tokens, "cold_ttft_s": round(cold.ttft_s, 3),
                "a_restarted_nvme_ttft_s": round(local.ttft_s, 3),
                "b_fresh_shared_ttft_s": round(shared.ttft_s, 3),
                "shared_over_cold": round(shared.ttft_s / cold.ttft_s, 3),
                "shared_over_nvme": round(shared.ttft_s / local.ttft_s, 3),
                "identical": cold.text == local.text == shared.text}
    finally:
        a.cleanup()
        b.cleanup()
        r.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--adapters", default="resp,valkey")
    ap.add_argument("--ttft", action="store_true", help="also TTFT on the bench model")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--policies", action="store_true",
                    help="compare the L2 store/prefetch policies on host B instead")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--summary", default="", help="print the table of a --policies JSON")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    results: list[dict[str, Any]] = []
    if args.summary:
        print(summarize(json.loads(Path(args.summary).read_text())))
        return 0
    if args.policies:
        for rnd in range(args.rounds):
            with tempfile.TemporaryDirectory(prefix="kvp-shared-bench-") as tmp:
                Path(tmp).chmod(0o700)
                site = Path(tmp) / "site"
                site.mkdir()
                (site / "sitecustomize.py").write_text(_SITE)
                results += policy_round(rnd, args.seqs, Path(tmp), site)
            if args.out:  # after every round: a partial run keeps what it measured
                Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
        return 0
    if args.ttft:
        with tempfile.TemporaryDirectory(prefix="kvp-shared-bench-") as tmp:
            Path(tmp).chmod(0o700)
            results.append({"ttft": ttft(Path(tmp), args.turns)})
            print(json.dumps(results[-1]), flush=True)
    for adapter in [a for a in args.adapters.split(",") if a]:
        with tempfile.TemporaryDirectory(prefix="kvp-shared-bench-") as tmp:
            Path(tmp).chmod(0o700)
            results.append(run(adapter, args.seqs, Path(tmp)))
            print(json.dumps(results[-1]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
