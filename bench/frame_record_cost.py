"""Cost of the frame record (issue 38, item 4): bytes per chunk on disk, and the time of the
launch's check per 100,000 chunk files, against the crash-window check without it.

Builds a temp cache root of ``--files`` chunk files of one namespace, named as LMCache names
them (32-byte chunk hashes, no salt), ``--window`` of them real aesgcm frames of the cpu-demo
chunk size (528,384 bytes, the deployment's HKDF key scheme) modified "now", the rest sparse
files of the same size whose first 13 bytes are a real frame header (version, random IV),
modified an hour ago (a metadata-only tree: the record's check reads headers, never a frame).
Then, in one process, page cache warm (no root to drop it here: CPU and metadata cost):

* ``learn``: the check of a clean-stop launch on a root without a record (every file's 13
  first bytes read, the record written): what the first launch after an upgrade costs, once;
* ``steady``: the same check with the record in place and nothing changed (a stat walk and
  the comparison; nothing read, nothing written): every clean-stop launch; paired and
  alternating with ``walk_only``, the same call without a record (verify's walk of the
  namespace's files, which the check needs at least), and their ratio of medians;
* ``decode``/``encode``: the record of ``--files`` names read from bytes and written to bytes
  (no I/O);
* ``one_changed``: one file's ctime moved (``os.utime``): one header read, the record written
  again (it is written whole);
* paired and alternating, ``--runs`` times each, the crash-window check as launch runs it
  after an unclean stop (``verify_root`` with ``since_ns``, apply; the window's files
  authenticated) without the record (``crash_no_record``, the baseline) and with it (load,
  check, save: ``crash_with_record``); their ratio of medians.

Prints one JSON document (``--out`` writes it too).

usage: python bench/frame_record_cost.py [--files 100000] [--window 1000] [--runs 5] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

NS = "kvp-" + "f3" * 16
PLAIN = 524288
SIZE = 528384


def make_tree(root: Path, n: int, window: int, master: bytes) -> list[Path]:
    """``n`` chunk files, the last ``window`` of them real frames modified now."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    from kvpersist.l2.frames import derive_key
    from kvpersist.l2.layout import ChunkName

    aes = AESGCM(derive_key(master))
    old = time.time() - 3600
    files = []
    for i in range(n):
        p = root / ChunkName(NS, 0x01000100, 0, os.urandom(32).hex()).filename()
        iv = os.urandom(12)
        if i >= n - window:
            blob = bytes([1]) + iv + aes.encrypt(iv, os.urandom(PLAIN), None)
            p.write_bytes(blob + bytes(SIZE - len(blob)))
        else:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, bytes([1]) + iv)
                os.ftruncate(fd, SIZE)
            finally:
                os.close(fd)
            os.utime(p, (old, old))
        files.append(p)
    return files


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=100_000)
    ap.add_argument("--window", type=int, default=1000)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    from kvpersist.l2.tree import open_root
    from kvpersist.l2.verify import frame_store
    from kvpersist.l2.verify.root import EMPTY_WINDOW, verify_root

    master = os.urandom(32)
    per = 100_000 / a.files
    with tempfile.TemporaryDirectory(prefix="kvp-frcost-", dir=os.environ.get("TMPDIR")) as tmp:
        root = Path(tmp) / "cache"
        root.mkdir(mode=0o700)
        t0 = time.perf_counter()
        files = make_tree(root, a.files, a.window, master)
        built = time.perf_counter() - t0
        record_file = root / ".kvpersist" / "frames" / f"{NS}.frames"
        since = time.time_ns() - 60 * 10**9  # the window: the real frames, written "now"
        last: dict[str, object] = {}

        def launch_check() -> None:
            """The check of a clean-stop launch (crash_window.check's record-only run)."""
            with open_root(root, purpose="verify") as r:
                rec, warning = frame_store.load(r, NS)
                assert not warning, warning
                v = verify_root(r, NS, key=None, apply=True, rate_mb_s=None,
                                since_ns=EMPTY_WINDOW, record=rec)
                assert v.frames is not None and not v.findings, v.findings
                v.frames.record_bytes, unwritten = frame_store.save(r, rec)
                assert not unwritten, unwritten
                last["frames"] = v.frames

        def crash(record: bool) -> Callable[[], None]:
            def run() -> None:
                with open_root(root, purpose="verify") as r:
                    rec = frame_store.load(r, NS)[0] if record else None
                    v = verify_root(r, NS, key=master, apply=True, rate_mb_s=None,
                                    since_ns=since, record=rec)
                    assert v.authenticated == a.window and not v.findings, v.findings
                    if rec is not None:
                        frame_store.save(r, rec)
            return run

        learn = []
        for _ in range(3):  # the first launch after an upgrade, three times (record removed)
            record_file.unlink(missing_ok=True)
            learn.append(timed(launch_check))
        learned = last["frames"]
        record_bytes = record_file.stat().st_size
        def walk_only() -> None:
            with open_root(root, purpose="verify") as r:
                verify_root(r, NS, key=None, apply=True, rate_mb_s=None,
                            since_ns=EMPTY_WINDOW)

        steady: list[float] = []
        walk: list[float] = []
        for i in range(a.runs):
            for with_record in ([True, False] if i % 2 == 0 else [False, True]):
                (steady if with_record else walk).append(
                    timed(launch_check if with_record else walk_only))
        assert last["frames"].read == 0  # type: ignore[attr-defined]
        from kvpersist.l2.verify import frame_record as fr

        data = record_file.read_bytes()
        decode = [timed(lambda: fr.decode(data, NS)) for _ in range(a.runs)]
        rec = fr.decode(data, NS)
        encode = [timed(lambda: fr.encode(rec)) for _ in range(a.runs)]
        one = []
        for i in range(a.runs):
            os.utime(files[i], (time.time() - 3600,) * 2)  # its ctime moves
            one.append(timed(launch_check))
        crash(True)()  # the record learns the window's files as authenticated
        runs: dict[str, list[float]] = {"crash_no_record": [], "crash_with_record": []}
        for i in range(a.runs):
            order = [False, True] if i % 2 == 0 else [True, False]
            for with_record in order:
                key = "crash_with_record" if with_record else "crash_no_record"
                runs[key].append(timed(crash(with_record)))
    med = {k: statistics.median(v) for k, v in runs.items()}
    empty = 8 + 2 + 1 + len(NS) + 8 + 16
    doc = {
        "schema": "kvpersist.bench.frame-record-cost/1",
        "files": a.files, "window_files": a.window, "file_bytes": SIZE,
        "tree_built_s": round(built, 1),
        "record_bytes": record_bytes,
        "record_bytes_per_chunk": round((record_bytes - empty) / a.files, 2),
        "learned": {k: getattr(learned, k) for k in ("files", "read", "new", "unchanged")},
        "learn_s": [round(x, 3) for x in learn],
        "steady_s": [round(x, 3) for x in steady],
        "walk_only_s": [round(x, 3) for x in walk],
        "steady_over_walk_only": round(statistics.median(steady) / statistics.median(walk), 3),
        "decode_s": round(statistics.median(decode), 3),
        "encode_s": round(statistics.median(encode), 3),
        "one_changed_s": [round(x, 3) for x in one],
        "per_100k_files_s": {
            "learn": round(statistics.median(learn) * per, 3),
            "steady": round(statistics.median(steady) * per, 3),
            "walk_only": round(statistics.median(walk) * per, 3),
            "one_changed": round(statistics.median(one) * per, 3),
        },
        "runs": {k: [round(x, 3) for x in v] for k, v in runs.items()},
        "median_s": {k: round(v, 3) for k, v in med.items()},
        "crash_with_over_without": round(med["crash_with_record"] / med["crash_no_record"], 3),
        "page_cache": "warm", "nproc": os.cpu_count(),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    text = json.dumps(doc, indent=2, sort_keys=True)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
