"""Subprocess body for the fault tests: store sequences in a loop and print what was stored.

usage: python -m tests.integration._store_burst RPC HTTP MODEL_NAME FIRST_SEQ
Prints one JSON line per stored sequence: {"seq": n, "digests": [...]}.
"""

from __future__ import annotations

import json
import sys

from kvpersist.demo.kvdriver import connect


def main() -> None:
    rpc, http, model, first = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    with connect(rpc, http, model) as d:
        seq = first
        while True:
            digests = d.store(seq)
            print(json.dumps({"seq": seq, "digests": digests}), flush=True)
            seq += 1


if __name__ == "__main__":
    main()
