"""Cost of the crash-window check per GB, against raw reads of the same files.

Writes ``--files`` aesgcm frames of the cpu-demo chunk size (528,384 bytes: what LMCache writes
for the tiny geometry, random plaintext, the deployment's HKDF key scheme) into a temp cache
root, then runs, paired and alternating, ``--runs`` times each:

* ``cat FILES > /dev/null`` (the raw read baseline),
* ``openssl dgst -sha256 FILES`` (read + a cryptographic pass),
* the crash-window check as launch runs it (``verify_root`` with ``since_ns``, apply, no rate
  cap), every file in the window.

The page cache is warm for all three (no root to drop it here): the figures are CPU cost per
GB, the floor under any disk. Prints one JSON document (``--out`` writes it too).

usage: python bench/crash_check_cost.py [--files 1000] [--runs 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

NS = "kvp-" + "c0" * 16
PLAIN = 524288
SIZE = 528384


def make_tree(root: Path, n: int, master: bytes) -> list[Path]:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from kvpersist.l2.frames import _derive
    from kvpersist.l2.layout import ChunkName

    aes = AESGCM(_derive(master, "", 16))
    files = []
    for i in range(n):
        iv = os.urandom(12)
        blob = bytes([1]) + iv + aes.encrypt(iv, os.urandom(PLAIN), None)
        p = root / ChunkName(NS, 0x01000100, 0, f"{i:064x}", None).filename()
        p.write_bytes(blob + b"\0" * (SIZE - len(blob)))
        files.append(p)
    return files


def timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    from kvpersist.l2.tree import open_root
    from kvpersist.l2.verify.root import verify_root

    master = os.urandom(32)
    with tempfile.TemporaryDirectory(prefix="kvp-cwcost-") as tmp:
        root = Path(tmp) / "cache"
        root.mkdir(mode=0o700)
        files = make_tree(root, a.files, master)
        names = [str(f) for f in files]
        gb = a.files * SIZE / 1e9

        def cat() -> None:
            subprocess.run(["cat", *names], stdout=subprocess.DEVNULL, check=True)

        def dgst() -> None:
            subprocess.run(["openssl", "dgst", "-sha256", *names], stdout=subprocess.DEVNULL,
                           check=True)

        def check() -> None:
            with open_root(root, purpose="verify") as handle:
                r = verify_root(handle, NS, key=master, apply=True, rate_mb_s=None, since_ns=0)
            assert r.authenticated == a.files and not r.findings, r.findings

        cat()  # warm the page cache
        runs: dict[str, list[float]] = {"cat": [], "openssl_sha256": [], "crash_check": []}
        for _ in range(a.runs):
            runs["cat"].append(timed(cat))
            runs["openssl_sha256"].append(timed(dgst))
            runs["crash_check"].append(timed(check))
    med = {k: statistics.median(v) for k, v in runs.items()}
    doc = {"schema": "kvpersist.bench.crash-check-cost/1", "files": a.files,
           "file_bytes": SIZE, "gb": round(gb, 3), "runs": runs,
           "median_s": {k: round(v, 3) for k, v in med.items()},
           "s_per_gb": {k: round(v / gb, 3) for k, v in med.items()},
           "gb_per_s": {k: round(gb / v, 3) for k, v in med.items()},
           "check_over_cat": round(med["crash_check"] / med["cat"], 2),
           "check_over_openssl": round(med["crash_check"] / med["openssl_sha256"], 2),
           "page_cache": "warm", "nproc": os.cpu_count(),
           "load_avg_1m": round(os.getloadavg()[0], 2)}
    text = json.dumps(doc, indent=2, sort_keys=True)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
