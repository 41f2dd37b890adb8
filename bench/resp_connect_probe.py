#!/usr/bin/env python3
"""What LMCache's RESP client does to a process when its store does not answer at the start.

LMCache 0.5.6's ``resp`` L2 adapter wraps a native client (``lmcache.lmcache_redis``) whose
constructor starts its worker threads; each worker connects to the store. This script builds
that client as the adapter does, in rounds, while the main thread opens, reads and closes a
small file in a loop (as the cache server's start reads its L2 master key), and counts the
opens that fail with ``EBADF``: a worker that closes a socket twice closes, the second time,
whatever the main thread has just opened under the same number. Two conditions, alternating
per round: the store's port with nobody listening ("down") and a real ``redis-server`` on
loopback ("up"). Then, for each condition, whether a request submitted after the store
answers ever completes (the client's workers reconnect or not).

With strace installed, ``strace -f -e trace=connect,close`` on one round shows the pair of
``close`` calls per worker (the second answered EBADF).

Usage: python bench/resp_connect_probe.py [--rounds 20] [--opens 2000] [--out FILE]
(``redis-server`` on PATH: scripts/setup.sh installs it.)
"""

from __future__ import annotations

import argparse
import errno
import json
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(port: int, where: str) -> subprocess.Popen[bytes]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not on PATH (scripts/setup.sh installs it)")
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", where,
                             "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit(f"redis-server on {port} did not answer")


def one_round(client_cls: Any, port: int, path: Path, opens: int) -> dict[str, int]:
    """Build the client, then open/read/close ``path`` ``opens`` times; count the EBADFs."""
    client = client_cls("127.0.0.1", port, 8, "", "")
    bad = other = 0
    for _ in range(opens):
        try:
            with open(path, "rb") as f:
                f.read()
        except OSError as exc:
            if exc.errno == errno.EBADF:
                bad += 1
            else:
                other += 1
    client.close()
    return {"ebadf": bad, "other_errors": other}


def completes_later(client_cls: Any, down: bool, where: str) -> bool:
    """Does a request submitted after the store answers complete within 3 s? (``down``:
    the client was built while nobody listened)."""
    port = free_port()
    proc = None if down else start_redis(port, where)
    client = client_cls("127.0.0.1", port, 8, "", "")
    time.sleep(0.5)
    if proc is None:
        proc = start_redis(port, where)
    try:
        client.submit_batch_exists(["kvp-probe"])
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            if client.drain_completions():
                return True
            time.sleep(0.05)
        return False
    finally:
        client.close()
        proc.kill()
        proc.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--opens", type=int, default=2000)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from lmcache.lmcache_redis import LMCacheRedisClient

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "key"
        path.write_bytes(b"k" * 32)
        counts: dict[str, dict[str, int]] = {c: {"rounds": 0, "ebadf": 0, "other_errors": 0,
                                                 "rounds_with_ebadf": 0}
                                             for c in ("down", "up")}
        up_port = free_port()
        redis = start_redis(up_port, tmp)
        try:
            for i in range(args.rounds):
                for cond in (("down", "up") if i % 2 == 0 else ("up", "down")):
                    port = free_port() if cond == "down" else up_port
                    r = one_round(LMCacheRedisClient, port, path, args.opens)
                    c = counts[cond]
                    c["rounds"] += 1
                    c["ebadf"] += r["ebadf"]
                    c["other_errors"] += r["other_errors"]
                    c["rounds_with_ebadf"] += r["ebadf"] > 0
        finally:
            redis.kill()
            redis.wait()
        later = {"down": completes_later(LMCacheRedisClient, True, tmp),
                 "up": completes_later(LMCacheRedisClient, False, tmp)}
    doc = {"opens_per_round": args.opens, "workers": 8, "counts": counts,
           "request_after_the_store_answers_completes": later}
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
