"""Cost of ``kvp-admin scrub`` per file and per GB, against raw reads of the same files.

Writes ``--files`` aesgcm frames of the cpu-demo chunk size (528,384 bytes: what LMCache
writes for the tiny geometry, random plaintext, the deployment's HKDF key scheme) into a temp
cache root; a ``--dirty`` fraction of them carry random bytes after the frame (stale L1 bytes,
as LMCache leaves them), the rest zeros. Then, paired and alternating, ``--runs`` times each:

* ``cat FILES > /dev/null``: the raw read baseline (every byte of every file);
* ``tail -q -c 4067 FILES > /dev/null``: the same bytes the repeat scrub reads (each file's
  padding, its last 4,067 bytes; ``tail`` seeks in a regular file), one process: the
  baseline for the cadence;
* the first scrub (``scrub_root`` with ``apply``) of a fresh copy of the dirty tree: reads
  every dirty file whole, authenticates it, zeroes its padding, ``fsync``;
* the repeat scrub of the same tree, now clean: what the cadence costs when nothing is new
  (one file read whole to learn the frame length, then the padding of each file);
* the crash-window check as launch runs it (``verify_root`` with ``since_ns``): what the
  launch's scrub of the window adds, as a ratio.

The page cache is warm (no root to drop it here): CPU cost, the floor under any disk; the
first scrub's ``fsync`` goes to whatever filesystem holds the temp directory. Prints one JSON
document (``--out`` writes it too).

usage: python bench/scrub_cost.py [--files 1000] [--dirty 0.13] [--runs 3] [--out FILE]
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
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

NS = "kvp-" + "c0" * 16
PLAIN = 524288
SIZE = 528384


def make_tree(root: Path, n: int, dirty: float, master: bytes) -> list[Path]:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from kvpersist.l2.frames import derive_key
    from kvpersist.l2.layout import ChunkName

    aes = AESGCM(derive_key(master))
    files = []
    every = max(1, round(1 / dirty)) if dirty > 0 else 0
    for i in range(n):
        iv = os.urandom(12)
        blob = bytes([1]) + iv + aes.encrypt(iv, os.urandom(PLAIN), None)
        pad = SIZE - len(blob)
        tail = os.urandom(pad) if every and i % every == every - 1 else bytes(pad)
        p = root / ChunkName(NS, 0x01000100, 0, f"{i:064x}", None).filename()
        p.write_bytes(blob + tail)
        files.append(p)
    return files


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--dirty", type=float, default=0.13,
                    help="fraction of files with stale bytes after the frame")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    from kvpersist.l2.frames import frame_end
    from kvpersist.l2.scrub import ScrubResult, scrub_root
    from kvpersist.l2.tree import open_root
    from kvpersist.l2.verify.root import verify_root

    master = os.urandom(32)
    pad = SIZE - frame_end(PLAIN)
    with tempfile.TemporaryDirectory(prefix="kvp-scrubcost-") as tmp:
        pristine = Path(tmp) / "pristine"
        pristine.mkdir(mode=0o700)
        files = make_tree(pristine, a.files, a.dirty, master)
        work = Path(tmp) / "cache"
        names = [str(work / f.name) for f in files]
        gb = a.files * SIZE / 1e9
        last: dict[str, ScrubResult] = {}

        def fresh() -> None:
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(pristine, work)
            subprocess.run(["cat", *names], stdout=subprocess.DEVNULL, check=True)

        def cat() -> None:
            subprocess.run(["cat", *names], stdout=subprocess.DEVNULL, check=True)

        def tail_padding() -> None:
            subprocess.run(["tail", "-q", "-c", str(pad), *names], stdout=subprocess.DEVNULL,
                           check=True)

        def scrub(label: str) -> Callable[[], None]:
            def run() -> None:
                with open_root(work, purpose="scrub") as handle:
                    last[label] = scrub_root(handle, NS, master, apply=True)
            return run

        def check() -> None:
            with open_root(work, purpose="verify") as handle:
                r = verify_root(handle, NS, key=master, apply=True, rate_mb_s=None, since_ns=0)
            assert r.authenticated == a.files and not r.findings, r.findings

        runs: dict[str, list[float]] = {k: [] for k in (
            "cat", "tail_padding", "scrub_first", "scrub_repeat", "crash_check")}
        for _ in range(a.runs):
            fresh()
            runs["cat"].append(timed(cat))
            runs["scrub_first"].append(timed(scrub("first")))
            runs["scrub_repeat"].append(timed(scrub("repeat")))
            runs["tail_padding"].append(timed(tail_padding))
            runs["crash_check"].append(timed(check))
        first, repeat = last["first"], last["repeat"]
        assert first.scrubbed > 0 and repeat.scrubbed == 0 and repeat.clean == a.files
    med = {k: statistics.median(v) for k, v in runs.items()}
    doc = {"schema": "kvpersist.bench.scrub-cost/1", "files": a.files, "file_bytes": SIZE,
           "padding_bytes": pad, "gb": round(gb, 3), "dirty_files": first.dirty,
           "runs": runs, "median_s": {k: round(v, 4) for k, v in med.items()},
           "us_per_file": {k: round(v / a.files * 1e6, 1) for k, v in med.items()},
           "s_per_gb": {k: round(v / gb, 4) for k, v in med.items()},
           "bytes_read": {"scrub_first": first.bytes_read, "scrub_repeat": repeat.bytes_read},
           "scrub_first_over_cat": round(med["scrub_first"] / med["cat"], 2),
           "scrub_repeat_over_cat": round(med["scrub_repeat"] / med["cat"], 3),
           "scrub_repeat_over_tail_padding": round(med["scrub_repeat"] / med["tail_padding"], 3),
           "scrub_first_over_crash_check": round(med["scrub_first"] / med["crash_check"], 3),
           "page_cache": "warm", "nproc": os.cpu_count(),
           "load_avg_1m": round(os.getloadavg()[0], 2)}
    text = json.dumps(doc, indent=2, sort_keys=True)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
