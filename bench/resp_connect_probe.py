#!/usr/bin/env python3
"""What LMCache's RESP client does to a process when its store does not answer at the start.

LMCache 0.5.6's ``resp`` L2 adapter wraps a native client (``lmcache.lmcache_redis``) whose
constructor starts its worker threads; each worker connects to the store. This script builds
that client as the adapter does, in rounds, while the main thread opens, reads and closes a
small file in a loop (as the cache server's start reads its L2 master key), and counts the
opens that fail with ``EBADF``: a worker that closes a socket twice closes, the second time,
whatever the main thread has just opened under the same number. Two conditions, alternating
per round: the store's port with nobody listening ("down") and a real ``redis-server`` on
loopback with an ACL user ("up", the tests' own store helper). Then, for each condition,
whether a request submitted after the store answers ever completes (the client's workers
reconnect or not).

With strace installed, ``strace -f -e trace=connect,close`` on one round shows the pair of
``close`` calls per worker (the second answered EBADF).

Usage: python bench/resp_connect_probe.py [--rounds 20] [--opens 2000] [--out FILE]
(``redis-server``: scripts/setup.sh installs it.)
"""

from __future__ import annotations

import argparse
import errno
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kvpersist.system.procs import free_port  # noqa: E402
from tests.integration._redis import Redis, start_redis  # noqa: E402


def one_round(client_cls: Any, port: int, store: Redis | None, path: Path,
              opens: int) -> dict[str, int]:
    """Build the client, then open/read/close ``path`` ``opens`` times; count the EBADFs."""
    user, password = (store.user, store.password) if store else ("", "")
    client = client_cls("127.0.0.1", port, 8, user, password)
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


def completes_later(client_cls: Any, down: bool, where: Path) -> bool:
    """Does a request submitted after the store answers complete within 3 s? (``down``:
    the client was built while the store was killed, and the store restarted after.)"""
    store = start_redis(where)
    if down:
        store.kill()
    client = client_cls("127.0.0.1", store.nodes[0].port, 8, store.user, store.password)
    time.sleep(0.5)
    if down:
        store.restart()
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
        store.stop()


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
        store = start_redis(Path(tmp) / "store")
        try:
            for i in range(args.rounds):
                for cond in (("down", "up") if i % 2 == 0 else ("up", "down")):
                    up = cond == "up"
                    port = store.nodes[0].port if up else free_port()
                    r = one_round(LMCacheRedisClient, port, store if up else None, path,
                                  args.opens)
                    c = counts[cond]
                    c["rounds"] += 1
                    c["ebadf"] += r["ebadf"]
                    c["other_errors"] += r["other_errors"]
                    c["rounds_with_ebadf"] += r["ebadf"] > 0
        finally:
            store.stop()
        later = {"down": completes_later(LMCacheRedisClient, True, Path(tmp) / "later-down"),
                 "up": completes_later(LMCacheRedisClient, False, Path(tmp) / "later-up")}
    doc = {"opens_per_round": args.opens, "workers": 8, "counts": counts,
           "request_after_the_store_answers_completes": later}
    text = json.dumps(doc, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
