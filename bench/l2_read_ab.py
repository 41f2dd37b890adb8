#!/usr/bin/env python3
"""A/B of the L2 read path: the server's L2 -> L1 prefetch vs a raw read of the same files
(docs/benchmarks.md, "L2 read path A/B").

    python bench/l2_read_ab.py [--rounds 5] [--seqs 16] [--variants a,b,...]
                               [--out bench/results/l2-read-ab.json]

Each variant gets its own cache root, filled once through LMCache's own MP client
(kvpersist/demo/kvdriver.py, the bench model's geometry: 3 MiB chunks at chunk size 256).
Then, for every round, the variants run one after the other in a rotated order (so none is
always first or last):

1. ``kvp-admin launch --no-vllm`` (a fresh server: empty L1);
2. page cache dropped (``echo 3 > /proc/sys/vm/drop_caches``), ``/proc/loadavg`` recorded;
3. (``preread`` variants) the hot-files pre-read of kvpersist/stack/preread.py, timed;
4. every sequence looked up once: the server prefetches its chunks L2 -> L1; the prefetch
   times come from the server's own log (``Prefetch request completed ... in X ms``);
5. ``kvp-admin stop``; page cache dropped again; ``cat FILES > /dev/null`` timed as a whole
   process: the raw read of exactly the files the server read, in the same round.

Reported per variant: medians and min-max over the rounds of the prefetch MB/s, the raw MB/s
and their ratio (computed per round), plus the load of each round. Every process started is
stopped; the cache roots are temp directories.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from persistence_bench import (  # noqa: E402
    BENCH_SPEC,
    drop_caches,
    env_for,
    kvp,
    make_configs,
    namespace,
    urls,
)

from kvpersist.demo.kvdriver import connect  # noqa: E402

#: label -> generic-config overrides (``section__key``) and deployment env overrides.
#: "default" is the repository's generic config as it stands. The results recorded in
#: bench/results/l2-read-ab*.json were taken when that was buffered reads (it is O_DIRECT
#: since): their "default" is today's "buffered", their "preread" today's "preread".
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "default": ({}, {}),
    "buffered": ({"l2__use_direct_io": False}, {}),
    "use_direct_io": ({"l2__use_direct_io": True}, {}),
    "shard_dirs": ({"l2__shard_dirs": True}, {}),
    "max_workers=2": ({"server__max_workers": 2}, {}),
    "chunk_size=512": ({"server__chunk_size": 512}, {}),
    "no serde": ({}, {"KVP_L2_SERDE": "none"}),
    "direct_io+workers=2": ({"l2__use_direct_io": True, "server__max_workers": 2}, {}),
    "preread": ({"l2__use_direct_io": False}, {}),
    "preread+direct_io": ({"l2__use_direct_io": True}, {}),
}
PREFETCH_RE = re.compile(r"retained keys \(\d+ L1, (\d+) L2\) in ([\d.]+) ms")


def layout(label: str) -> tuple[Any, ...]:
    """What decides the files a variant stores (names, layout, bytes): variants that agree
    share one fill."""
    generic, extra = VARIANTS[label]
    return (generic.get("l2__shard_dirs", False), generic.get("server__chunk_size", 256),
            extra.get("KVP_L2_SERDE", "aesgcm"))


def loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


class Variant:
    """One variant's cache root, filled once."""

    def __init__(self, tmp: Path, label: str, seqs: int, tokens: int,
                 like: Variant | None = None) -> None:
        generic, extra = VARIANTS[label]
        self.label = label
        self.dir = tmp / re.sub(r"[^a-z0-9]+", "-", label)
        self.dir.mkdir()
        self.env = env_for(self.dir, make_configs(self.dir, **generic), **extra)
        self.root = Path(self.env["KVP_CACHE_ROOT"])
        self.ns = namespace(self.env)
        self.seqs, self.tokens = seqs, tokens
        self.rpc, self.http = urls(self.env)
        self.log = self.root.parent / ".kvpersist" / self.root.name / "logs" / \
            "lmcache-server.log"
        if like is not None:  # same file names and bytes: copy the other variant's fill
            self.root.mkdir(mode=0o700)
            for p in like.root.rglob("*.bin"):
                dst = self.root / p.relative_to(like.root)
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(p, dst)
            self.log.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            self.log.touch()
            # the aesgcm master key too, or every copied file would fail its tag (a miss)
            key = like.log.parent.parent / "keys" / "l2-master.key"
            if key.exists():
                (self.log.parent.parent / "keys").mkdir(mode=0o700)
                shutil.copy2(key, self.log.parent.parent / "keys" / "l2-master.key")
        else:
            kvp(self.env, "launch", "cpu-demo", "--no-vllm")
            try:
                with connect(self.rpc, self.http, self.ns, num_tokens=tokens,
                             kvcache_shape_spec=BENCH_SPEC) as d:
                    for s in range(1, seqs + 1):
                        d.store(s)
            finally:
                kvp(self.env, "stop", "cpu-demo")  # SIGTERM: the server drains its queue
        self.files = sorted(str(p) for p in self.root.rglob("*.bin") if p.name.startswith(self.ns))
        self.nbytes = sum(os.stat(p).st_size for p in self.files)

    def round(self, preread: Callable[[Path, str], dict[str, Any]] | None) -> dict[str, Any]:
        kvp(self.env, "launch", "cpu-demo", "--no-vllm")
        offset = self.log.stat().st_size
        pre: dict[str, Any] | None = None
        try:
            dropped = drop_caches()
            load = loadavg()
            if preread is not None:
                pre = preread(self.root, self.ns)
            hits = 0
            with connect(self.rpc, self.http, self.ns, num_tokens=self.tokens,
                         kvcache_shape_spec=BENCH_SPEC) as d:
                t = time.perf_counter()
                for s in range(1, self.seqs + 1):
                    lk = d.lookup(s)
                    hits += lk.hit_chunks
                lookup_s = time.perf_counter() - t
        finally:
            kvp(self.env, "stop", "cpu-demo")
        with open(self.log, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        found = [(int(n), float(ms)) for n, ms in PREFETCH_RE.findall(text)]
        l2_chunks = sum(n for n, _ in found)
        prefetch_s = sum(ms for _, ms in found) / 1000
        drop_caches()
        raw_load = loadavg()
        t = time.perf_counter()
        subprocess.run(["cat", *self.files], stdout=subprocess.DEVNULL, check=True)
        raw_s = time.perf_counter() - t
        chunk_bytes = self.nbytes / len(self.files)
        prefetch_mb_s = l2_chunks * chunk_bytes / 1e6 / prefetch_s if prefetch_s else 0.0
        raw_mb_s = self.nbytes / 1e6 / raw_s
        out = {"variant": self.label, "load": load, "raw_load": raw_load,
               "page_cache_dropped": dropped, "l2_chunks": l2_chunks, "hit_chunks": hits,
               "files": len(self.files), "prefetch_s": round(prefetch_s, 4),
               "lookup_wall_s": round(lookup_s, 4), "raw_s": round(raw_s, 4),
               "prefetch_mb_s": round(prefetch_mb_s, 1), "raw_mb_s": round(raw_mb_s, 1),
               "ratio": round(prefetch_mb_s / raw_mb_s, 3)}
        if pre is not None:
            out["preread"] = pre
        return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def stat(key: str) -> dict[str, float]:
        xs = [float(r[key]) for r in rows]
        return {"median": round(statistics.median(xs), 3), "min": min(xs), "max": max(xs)}
    out = {k: stat(k) for k in ("prefetch_mb_s", "raw_mb_s", "ratio", "prefetch_s",
                                "lookup_wall_s")}
    out["load1"] = stat_load([r["load"][0] for r in rows])
    out["rounds"] = len(rows)
    out["all_chunks_from_l2"] = all(r["l2_chunks"] == r["files"] for r in rows)
    if rows and "preread" in rows[0]:
        out["preread_s"] = {k: stat_pre(rows, k) for k in ("issue_s", "resident_s")}
    return out


def stat_load(xs: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(xs), 2), "min": min(xs), "max": max(xs)}


def stat_pre(rows: list[dict[str, Any]], key: str) -> dict[str, float]:
    xs = [float(r["preread"][key]) for r in rows]
    return {"median": round(statistics.median(xs), 3), "min": min(xs), "max": max(xs)}


def run_preread(root: Path, ns: str) -> dict[str, Any]:
    """The pre-read as launch runs it (the whole namespace fits the cap here): ``issue_s`` is
    the time of the listing and the fadvise calls; ``resident_s`` adds reading every advised
    file once (``cat``), which waits for the kernel's in-flight reads: the time until the
    files are in memory, i.e. what must fit inside a model load."""
    from kvpersist.l2.tree import open_root
    from kvpersist.stack.preread import preread

    t = time.perf_counter()
    with open_root(root, purpose="pre-read") as handle:
        res = preread(handle, ns, cap_bytes=1 << 40)
    issue_s = time.perf_counter() - t
    subprocess.run(["cat", *(str(root / f) for f in res.files)], stdout=subprocess.DEVNULL,
                   check=True)
    return {"files": len(res.files), "bytes": res.bytes, "issue_s": round(issue_s, 4),
            "resident_s": round(time.perf_counter() - t, 4)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--variants", default="default,buffered,shard_dirs,max_workers=2,"
                    "chunk_size=512,no serde,preread")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    labels = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not drop_caches():
        print("cannot drop the page cache (need root): cold reads would not be cold",
              file=sys.stderr)
        return 2
    out: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "kernel": os.uname().release},
                           "seqs": args.seqs, "tokens": args.tokens, "rounds": args.rounds,
                           "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           "load_at_start": loadavg(), "runs": []}
    with tempfile.TemporaryDirectory(prefix="kvp-ab-", dir="/var/tmp") as d:
        tmp = Path(d)
        variants: list[Variant] = []
        for label in labels:
            t = time.perf_counter()
            like = next((o for o in variants if layout(o.label) == layout(label)), None)
            v = Variant(tmp, label, args.seqs, args.tokens, like)
            print(f"filled {label}: {len(v.files)} files, {v.nbytes / 1e6:.1f} MB in "
                  f"{time.perf_counter() - t:.0f} s", file=sys.stderr)
            variants.append(v)
        for r in range(args.rounds):
            order = variants[r % len(variants):] + variants[:r % len(variants)]
            for v in order:
                row = v.round(run_preread if v.label.startswith("preread") else None)
                row["round"] = r
                out["runs"].append(row)
                print(json.dumps(row), file=sys.stderr)
            if args.out:  # partial results survive an interrupted run
                Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        for v in variants:
            shutil.rmtree(v.root, ignore_errors=True)
    out["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    out["summary"] = {label: summarize([r for r in out["runs"] if r["variant"] == label])
                      for label in labels}
    text = json.dumps(out, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(json.dumps(out["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
