#!/usr/bin/env python3
"""The shared tier over a real link: what each network fault adds to a request, how long
recovery takes, and LMCache's retrieve throughput against ``redis-benchmark`` on the same
link (docs/fleet.md, "The shared tier over a network"). One machine, one session; the
figures are paired (a baseline measured right before each fault, the two throughputs
alternated) and the load average is recorded beside them.

    python bench/network_faults.py [--rounds 3] [--out bench/results/network-faults.json]
    python bench/network_faults.py --table bench/results/network-faults.json   # docs' table

Topology and faults are the test suite's (tests/integration/_netns.py): host B's network
namespace joined by a veth pair to the store's, a TLS-only ``redis-server`` with the
deployments' least-privilege ACL user, stock ``lmcache server`` processes started by
``kvp-admin launch`` in the hosts' namespaces, LMCache's valkey adapter with kvpersist's
timeouts (or the ones given by ``--timeout``/``--connect-timeout``). Host A stores; host B
retrieves through LMCache's own MP client (tests/integration/_netdriver.py): the time of
one retrieve is the lookup (the server's prefetch from L1, its NVMe or the store) plus the
retrieve of what hit, i.e. what a vLLM request waits for before its prefill (no vLLM here:
the TTFT a fault adds to vLLM is this time plus vLLM's own work, which no fault changes).

Per round and fault: a sequence only the store holds and one in B's L1, retrieved once
without and once with the fault. Partition and store restart: the time B's requests wait
while the store is unreachable (1,024 and 8,192 tokens: one and four rounds of the
adapter's 8 workers), and the time from the heal (restart) until a fresh sequence hits from
the store again. Throughput: 8 MiB chunks (8 KV heads x 128 x 8 layers, bf16), B retrieving
sequences from the store against ``redis-benchmark -t get`` with values of the same size
and as many connections as the adapter has workers, over the same TLS link.
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvpersist.config.shared_tier import ACL_RULES  # noqa: E402
from kvpersist.demo.kvdriver import shape_spec  # noqa: E402
from tests.fullstack._stack import Stack, wait_until  # noqa: E402
from tests.integration._netdriver import NetDriver  # noqa: E402
from tests.integration._netns import STORE_IP, Net, make_net  # noqa: E402
from tests.integration._redis import ACL_USER, Redis, start_redis  # noqa: E402
from tests.integration.test_shared_tier import host  # noqa: E402

#: the tests' geometry: 4 chunks of 256 KiB per 1,024-token sequence
CHUNKS = 4
#: the throughput geometry: 4 MiB per 256-token chunk (8 KV heads x 128, 4 layers, bf16),
#: 16 chunks per 4,096-token sequence
BIG_SPEC = shape_spec(8, 128, 4)
BIG_CHUNK = 2 * 256 * 8 * 128 * 2 * 4
BIG_TOKENS = 4096
BIG_CHUNKS = BIG_TOKENS // 256


def load() -> float:
    return round(os.getloadavg()[0], 2)


class Seqs:
    def __init__(self, start: int, count: int) -> None:
        self._it = iter(range(start, start + count))

    def __call__(self) -> int:
        return next(self._it)


def setup(tmp: Path, url_extra: str) -> tuple[Net, Redis, Stack, Stack, str]:
    """The network, the store and hosts A and B launched; on a failure, everything it
    started is stopped and removed before the exception goes on."""
    net = make_net("a", "b")
    r: Redis | None = None
    stacks: list[Stack] = []
    try:
        r = start_redis(tmp / "store", tls=True, acl=ACL_RULES, host=STORE_IP,
                        wrap=net.store_wrap, maxmemory="4gb")
        for name in ("a", "b"):
            s = host(tmp, name, r)
            s.wrapper = net.hosts[name].wrap
            s.env["KVP_SERDE_KEY_FILE"] = str(tmp / "fleet-key" / "l2-master.key")
            s.env.update({"KVP_L1_SIZE_GB": "2", "KVP_L2_BUDGET": "8G"})
            if url_extra:
                s.env["KVP_SHARED_TIER"] = r.url + "&" + url_extra
            stacks.append(s)
        a, b = stacks
        ns = a.render()["namespace"]
        with ThreadPoolExecutor(2) as pool:
            futures = [pool.submit(s.launch, "--no-vllm", "--timeout", "300") for s in stacks]
        for f in futures:
            f.result()
    except BaseException:
        for s in stacks:
            s.cleanup()
        if r is not None:
            r.stop()
        net.close()
        raise
    return net, r, a, b, ns


def timed_retrieve(d: NetDriver, seq: int, want: list[str] | None) -> dict[str, Any]:
    got = d.retrieve(seq)
    if got["hit"] and want is not None and got["digests"] != want[:got["hit"]]:
        raise RuntimeError(f"sequence {seq}: other bytes than stored")
    return got


def fault_round(net: Net, d: NetDriver, stored: dict[int, list[str]], fresh: Seqs,
                apply: Callable[[], None], clear: Callable[[], None]) -> dict[str, float]:
    warm = fresh()
    timed_retrieve(d, warm, stored[warm])
    base_store = timed_retrieve(d, fresh(), None)
    base_l1 = timed_retrieve(d, warm, None)
    apply()
    try:
        seq = fresh()
        faulty = timed_retrieve(d, seq, stored[seq])
        faulty_l1 = timed_retrieve(d, warm, None)
    finally:
        clear()
    return {"store_added_s": faulty["s"] - base_store["s"], "store_hits": faulty["hit"],
            "l1_added_s": faulty_l1["s"] - base_l1["s"], "store_base_s": base_store["s"],
            "l1_base_s": base_l1["s"], "load": load()}


def outage_round(b: Stack, d: NetDriver, stored: dict[int, list[str]], fresh: Seqs,
                 down: Callable[[], None], up: Callable[[], None]) -> dict[str, float]:
    warm = fresh()
    timed_retrieve(d, warm, stored[warm])
    base = timed_retrieve(d, warm, None)["s"]
    down()
    t_down = time.monotonic()
    try:
        during = timed_retrieve(d, warm, None)["s"]
        missed = timed_retrieve(d, fresh(), None)["s"]
        t0 = time.monotonic()
        r = b.kvp("health", b.config, "--no-vllm", "--json", timeout=300)
        health_s = time.monotonic() - t0
        degraded = json.loads(r.stdout)["components"]["shared_tier"] == "degraded"
    finally:
        up()
    healed = time.monotonic()
    after = fresh()
    if not wait_until(lambda: timed_retrieve(d, after, stored[after])["hit"] == CHUNKS, 120,
                      interval=0.1):
        raise RuntimeError("no recovery within 120 s")
    return {"l1_added_s": during - base, "store_only_s": missed, "health_s": health_s,
            "health_degraded": degraded, "down_s": healed - t_down,
            "recovery_s": time.monotonic() - healed, "load": load()}


def long_partition(net: Net, b: Stack, ns: str, tokens: int) -> dict[str, float]:
    """One lookup of ``tokens`` tokens held in L1 while the store is partitioned away."""
    with NetDriver(net.hosts["b"].wrap, b.rpc, b.http, ns, num_tokens=tokens) as d:
        seq = 50_000 + tokens
        d.store(seq)
        time.sleep(2)
        base = d.retrieve(seq)["s"]
        net.partition("b")
        try:
            during = d.retrieve(seq)
        finally:
            net.heal("b")
        time.sleep(5)  # let the adapter reconnect before the next measurement
        return {"tokens": tokens, "chunks": during["total"], "l1_s": base,
                "partition_s": during["s"], "added_s": during["s"] - base,
                "hits": during["hit"], "load": load()}


PREFETCH = re.compile(r"Prefetch request completed \(L1\+L2\): \d+/\d+ retained keys "
                      r"\(\d+ L1, (\d+) L2\) in ([\d.]+) ms \(external_request_id="
                      r"kvp-retrieve-(\d+)-")


def prefetches(log: Path, seqs: range) -> tuple[int, float]:
    """Chunks loaded from the L2 tiers and milliseconds, summed over the last prefetch the
    server logged for each sequence in ``seqs``."""
    last: dict[int, tuple[int, float]] = {}
    for m in PREFETCH.finditer(log.read_text(errors="replace")):
        if int(m.group(3)) in seqs:
            last[int(m.group(3))] = (int(m.group(1)), float(m.group(2)))
    return sum(v[0] for v in last.values()), sum(v[1] for v in last.values())


def throughput(net: Net, r: Redis, a: Stack, b: Stack, ns: str, rounds: int,
               seqs: int) -> list[dict[str, Any]]:
    """LMCache's retrieve from the store against ``redis-benchmark`` GETs of values of the
    same size over the same link, alternated per round.

    Host A stores ``seqs`` sequences of 4,096 tokens (16 chunks of ``BIG_CHUNK`` bytes) per
    round; B, which never saw them, retrieves each (lookup, prefetch from the store through
    the adapter's workers, aesgcm decryption, the copy into the client's KV cache). Then
    ``redis-benchmark`` in B's namespace SETs one value of ``BIG_CHUNK`` bytes and GETs it
    with as many connections as the adapter has workers, over TLS, as the deployments'
    store is reached."""
    node = r.nodes[0]
    assert node.tls is not None
    workers = int(b.render()["shared_l2_adapter"]["num_workers"])
    bench = [*net.hosts["b"].wrap, "redis-benchmark", "-h", STORE_IP, "-p", str(node.port),
             "--tls", "--cacert", str(node.tls.ca), "--user", ACL_USER, "-a", r.password,
             "-c", str(workers), "-d", str(BIG_CHUNK), "--csv"]

    def redis_benchmark(*args: str) -> dict[str, float]:
        cp = subprocess.run([*bench, *args], capture_output=True, text=True, timeout=600)
        if cp.returncode != 0:
            raise RuntimeError(f"redis-benchmark {' '.join(args)}: {cp.stdout[-500:]}"
                               f"{cp.stderr.strip()}")
        return {row.split(",")[0].strip('"'): float(row.split(",")[1].strip('"'))
                for row in cp.stdout.splitlines()[1:] if row}

    # one value of the chunk's size under redis-benchmark's key, then GETs of it (the SETs
    # are not measured: every SET is fsynced to the AOF, as the deployments' store does)
    redis_benchmark("-t", "set", "-n", str(workers))
    out = []
    with NetDriver(net.hosts["a"].wrap, a.rpc, a.http, ns, num_tokens=BIG_TOKENS,
                   spec=BIG_SPEC) as da, \
            NetDriver(net.hosts["b"].wrap, b.rpc, b.http, ns, num_tokens=BIG_TOKENS,
                      spec=BIG_SPEC) as db:
        for rnd in range(rounds):
            first = 200_000 + rnd * 1000
            batch = range(first, first + seqs)
            want = len(r.scan_keys(f"{ns}@*")) + len(batch) * BIG_CHUNKS
            stored = {seq: da.store(seq) for seq in batch}
            if not wait_until(lambda w=want: len(r.scan_keys(f"{ns}@*")) >= w, 120):
                raise RuntimeError("A's sequences did not reach the store")
            took, got = 0.0, 0
            for seq in batch:
                res = timed_retrieve(db, seq, stored[seq])
                took += res["s"]
                got += res["hit"]
            lmc = got * BIG_CHUNK / took
            # the server's own account of the part redis-benchmark compares with: its
            # prefetch of the chunks from the store into L1 (the adapter's GETs, the aesgcm
            # decryption), without the transfer to the client
            l2, ms = prefetches(b.server_log, batch)
            rps = redis_benchmark("-t", "get", "-n", str(16 * workers))
            rb = rps["GET"] * BIG_CHUNK
            out.append({"round": rnd, "lmcache_chunks": got,
                        "lmcache_expected": len(stored) * BIG_CHUNKS, "lmcache_s": took,
                        "lmcache_mib_s": lmc / 2**20, "prefetch_chunks": l2,
                        "prefetch_s": ms / 1000,
                        "prefetch_mib_s": l2 * BIG_CHUNK / (ms / 1000) / 2**20 if ms else 0.0,
                        "prefetch_ratio": (l2 * BIG_CHUNK / (ms / 1000)) / rb if ms else 0.0,
                        "redis_benchmark_get_rps": rps["GET"],
                        "redis_benchmark_mib_s": rb / 2**20, "ratio": lmc / rb,
                        "load": load()})
            print(f"throughput round {rnd}: {json.dumps(out[-1])}", flush=True)
    return out


def table(results: dict[str, Any]) -> str:
    """The docs' table (docs/fleet.md, "The shared tier over a network") from a results
    file: medians over the rounds, milliseconds, the range in brackets."""
    def ms(rows: list[dict[str, Any]], key: str) -> str:
        xs = [x[key] * 1000 for x in rows]
        return f"{statistics.median(xs):.0f} ({min(xs):.0f} to {max(xs):.0f})"

    out = ["| fault on B's link | added to a retrieve from the store, ms | added to an L1 hit, "
           "ms | chunks hit (of 4 per round) | recovery after the heal, s |",
           "|---|---|---|---|---|"]
    for name, rows in results.get("faults", {}).items():
        if "store_added_s" in rows[0]:
            hits = ", ".join(str(x["store_hits"]) for x in rows)
            out.append(f"| {name} | {ms(rows, 'store_added_s')} | {ms(rows, 'l1_added_s')} | "
                       f"{hits} | - |")
        else:
            rec = [x["recovery_s"] for x in rows]
            out.append(f"| {name} | miss after {ms(rows, 'store_only_s')} | "
                       f"{ms(rows, 'l1_added_s')} | 0 | {statistics.median(rec):.1f} "
                       f"({min(rec):.1f} to {max(rec):.1f}) |")
    return "\n".join(out)


def main() -> int:
    if sys.argv[1:2] == ["--table"]:
        print(table(json.loads(Path(sys.argv[2]).read_text())))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--url-extra", default="", help="query options added to the store URL")
    ap.add_argument("--throughput-only", action="store_true",
                    help="skip the faults (the throughput comparison alone)")
    ap.add_argument("--throughput-seqs", type=int, default=3,
                    help="4,096-token sequences B retrieves per throughput round")
    ap.add_argument("--out", type=Path, default=REPO / "bench/results/network-faults.json")
    args = ap.parse_args()
    results: dict[str, Any] = {"rounds": args.rounds, "url_extra": args.url_extra,
                               "load_start": load(), "started": time.time()}
    with tempfile.TemporaryDirectory(prefix="kvp-netbench-") as t:
        tmp = Path(t)
        net, r, a, b, ns = setup(tmp, args.url_extra)
        try:
            results["adapter"] = b.render()["shared_l2_adapter"]
            results["adapter"].pop("serde", None)
            if not args.throughput_only:
                per_round = 4 * 3 + 2 * 3  # fresh sequences a round asks B for
                total = args.rounds * per_round + 10
                with NetDriver(net.hosts["a"].wrap, a.rpc, a.http, ns) as da:
                    stored = {seq: da.store(seq) for seq in range(1, total + 1)}
                wait_until(lambda: len(r.scan_keys(f"{ns}@*")) >= CHUNKS * total, 120)
                fresh = Seqs(1, total)
                faults: dict[str, tuple[Callable[[], None], Callable[[], None]]] = {
                    "delay 5 ms": (lambda: net.delay("b", 5), lambda: net.clear("b")),
                    "delay 50 ms": (lambda: net.delay("b", 50), lambda: net.clear("b")),
                    "loss 1 %": (lambda: net.loss("b", 1), lambda: net.clear("b")),
                    "loss 10 %": (lambda: net.loss("b", 10), lambda: net.clear("b")),
                }
                rows: dict[str, list[dict[str, Any]]] = {k: [] for k in
                                                         [*faults, "partition", "store restart"]}
                with NetDriver(net.hosts["b"].wrap, b.rpc, b.http, ns) as d:
                    for rnd in range(args.rounds):
                        for name, (apply, clear) in faults.items():
                            rows[name].append(fault_round(net, d, stored, fresh, apply, clear))
                        rows["partition"].append(outage_round(
                            b, d, stored, fresh, lambda: net.partition("b"),
                            lambda: net.heal("b")))
                        rows["store restart"].append(outage_round(
                            b, d, stored, fresh, r.kill, r.restart))
                        print(f"round {rnd}: " + json.dumps({k: v[-1] for k, v in rows.items()}),
                              flush=True)
                results["faults"] = rows
                results["summary"] = {k: {m: statistics.median(x[m] for x in v)
                                          for m in v[0] if isinstance(v[0][m], float)}
                                      for k, v in rows.items()}
                results["partition_by_size"] = [long_partition(net, b, ns, n)
                                                for n in (1024, 8192)]
                args.out.write_text(json.dumps(results, indent=1) + "\n")  # kept if the rest fails
            tp = throughput(net, r, a, b, ns, args.rounds, args.throughput_seqs)
            results["throughput"] = tp
            results.setdefault("summary", {})["throughput"] = {
                m: statistics.median(x[m] for x in tp)
                for m in ("lmcache_mib_s", "prefetch_mib_s", "redis_benchmark_mib_s", "ratio",
                          "prefetch_ratio")}
        finally:
            net.heal_all()
            for s in (a, b):
                s.cleanup()
            r.stop()
            net.close()
    results["load_end"] = load()
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results.get("summary"), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
