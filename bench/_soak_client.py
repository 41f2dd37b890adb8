"""Store-burst client of bench/crash_soak.py (LMCache's own multiprocess client).

Started ahead of time (the lmcache import costs seconds); waits for one line on stdin,
``RPC HTTP MODEL_NAME FIRST_SEQ``, then stores sequences in a loop and prints one JSON line per
stored sequence: ``{"seq": n, "digests": [...]}``. It is killed with the server.
"""

from __future__ import annotations

import json
import sys

from kvpersist.demo.kvdriver import connect


def main() -> None:
    line = sys.stdin.readline().split()
    if len(line) != 4:
        return
    rpc, http, model, first = line[0], line[1], line[2], int(line[3])
    with connect(rpc, http, model) as d:
        seq = first
        while True:
            print(json.dumps({"seq": seq, "digests": d.store(seq)}), flush=True)
            seq += 1


if __name__ == "__main__":
    main()
