"""LMCache's own MP client (:mod:`kvpersist.demo.kvdriver`) in a child process, so that it
can run inside another network namespace (``ip netns exec NS``) next to that host's cache
server, which binds the namespace's own loopback. The test talks to it over stdin/stdout,
one JSON object per line::

    {"op": "store", "seq": 1}          -> {"digests": [...], "s": 0.12}
    {"op": "retrieve", "seq": 1}       -> {"hit": 4, "total": 4, "digests": [...] | null,
                                           "s": 0.31}
    {"op": "clear", "seq": 0}          -> {"s": 0.01}   (the server's L1 emptied)

``s`` is the wall time of the operation in the client: for ``retrieve``, the lookup (the
server's prefetch from L1, its NVMe and the shared tier) plus the retrieve of what hit,
which is what a vLLM request waits for before its prefill. A retrieve takes the chunks that
hit as vLLM does (a prefix; it recomputes the rest): ``digests`` are theirs, or null when
nothing hit.

The bench client behind KVDriver gives up polling a lookup after about 2.5 s and reports 0
hits; this driver polls for up to ``LOOKUP_WAIT_S`` instead, so that the time measured is
the server's, not the client's patience (vLLM's scheduler waits for the lookup too).
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..childproc import JsonLineChild

#: how long a lookup is polled before the client gives up (the bench client's: ~2.5 s)
LOOKUP_WAIT_S = 120.0
POLL_S = 0.005


def serve(rpc: str, http: str, model: str, num_tokens: int, spec: str) -> None:
    import requests
    from lmcache.cli.commands.bench.server_bench import helpers

    from kvpersist.demo.kvdriver import DEMO_TINY_SPEC, connect

    helpers._poll_prefetch_status = functools.partial(  # type: ignore[assignment]
        helpers._poll_prefetch_status, max_polls=int(LOOKUP_WAIT_S / POLL_S),
        poll_interval=POLL_S)
    with connect(rpc, http, model, num_tokens=num_tokens,
                 kvcache_shape_spec=spec or DEMO_TINY_SPEC) as d:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            cmd = json.loads(line)
            t0 = time.perf_counter()
            out: dict[str, Any]
            if cmd["op"] == "store":
                out = {"digests": d.store(int(cmd["seq"]))}
            elif cmd["op"] == "retrieve":
                lk, got = d.lookup_and_retrieve(int(cmd["seq"]), prefix=True)
                out = {"hit": lk.hit_chunks, "total": lk.total_chunks, "digests": got}
            elif cmd["op"] == "clear":
                requests.post(f"{http}/cache/clear", timeout=30).raise_for_status()
                out = {}
            else:
                raise ValueError(f"unknown op {cmd['op']!r}")
            out["s"] = time.perf_counter() - t0
            print(json.dumps(out), flush=True)


class NetDriver(JsonLineChild):
    """The child process; ``with NetDriver(wrap, rpc, http, model) as d: d.retrieve(1)``.
    Each sequence holds ``num_tokens`` tokens (1,024: 4 chunks of 256); ``spec``: the KV
    shape (``kvdriver.shape_spec``; default the demo's, 256 KiB per chunk)."""

    def __init__(self, wrap: Sequence[str], rpc: str, http: str, model: str,
                 num_tokens: int = 1024, spec: str = "", wait: bool = True) -> None:
        super().__init__([*wrap, sys.executable, "-m", "tests.integration._netdriver", rpc,
                          http, model, str(num_tokens), spec])
        self._ready = False
        if wait:
            self.wait_ready()

    def wait_ready(self) -> NetDriver:
        """Wait until the child has connected (``wait=False`` starts several at once: each
        spends seconds importing LMCache and torch)."""
        if not self._ready:
            try:
                ready = self.read().get("ready")
            except BaseException:
                self.close()
                raise
            if not ready:
                self.close()
                raise RuntimeError("the driver did not connect")
            self._ready = True
        return self

    def call(self, op: str, seq: int) -> dict[str, Any]:
        return self.send({"op": op, "seq": seq})

    def store(self, seq: int) -> list[str]:
        return list(self.call("store", seq)["digests"])

    def retrieve(self, seq: int) -> dict[str, Any]:
        return self.call("retrieve", seq)

    def clear_l1(self) -> None:
        self.call("clear", 0)


if __name__ == "__main__":
    serve(*sys.argv[1:4], int(sys.argv[4]), sys.argv[5] if len(sys.argv) > 5 else "")
