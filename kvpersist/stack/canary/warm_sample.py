"""The canary on the warm set: a sample of its entries served as users get them, against the
same entries recomputed under a fresh cache salt (``kvp-admin canary run --warm-sample N``;
``health --canary`` with ``KVP_CANARY_WARM_SAMPLE``).

The warm set's token ids come from the cache the warm-up keeps (nothing is tokenized here).
The entries are taken in turn, ``n`` per run, starting after the last entry the record says
was sampled, so that successive runs cover the whole warm set. Each entry costs two requests
of its whole length, and its reference stores the entry's chunks once more under a salt of
its own (LMCache's MP mode has no request that computes without storing): keep ``n`` small.
A sampled entry that fails fails the namespace's canary like the canary prompt does.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpersist.stack.canary import probe
from kvpersist.stack.canary.verdict import FAILED, PASSED, UNKNOWN, compare, served_path
from kvpersist.stack.locate import Location
from kvpersist.system.http_client import Unreachable

#: the most entries one run samples
MAX_SAMPLE = 16


@dataclass(frozen=True)
class SampleRun:
    """The sampled entries' verdicts (entry index -> verdict and path)."""

    state: str
    entries: tuple[dict[str, Any], ...] = ()
    detail: str = ""
    next_entry: int = 0
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "entries": list(self.entries), "detail": self.detail,
                "next_entry": self.next_entry, "seconds": round(self.seconds, 3)}


def pick(count: int, start: int, n: int) -> list[int]:
    """``n`` entry indexes of ``count`` from ``start``, wrapping (pure)."""
    if count <= 0 or n <= 0:
        return []
    return [(start + i) % count for i in range(min(n, count))]


def sample(loc: Location, ids: Sequence[Sequence[int]], *, n: int, start: int,
           timeout: float = probe.REQUEST_TIMEOUT_S) -> SampleRun:
    """Serve and recompute ``n`` entries of ``ids`` from ``start``; failed when one differs
    past the tolerance, unknown when one could not compare, else passed."""
    import time

    t0 = time.monotonic()
    client = loc.vllm(timeout)
    chosen = pick(len(ids), start, min(n, MAX_SAMPLE))
    out: list[dict[str, Any]] = []
    state = PASSED if chosen else UNKNOWN
    for i in chosen:
        tokens = list(ids[i])
        try:
            served = probe.ask(client, loc.served_model_name, tokens, timeout=timeout)
            ref = probe.ask(client, loc.served_model_name, tokens, timeout=timeout,
                            salt=f"kvp-canary-{uuid.uuid4().hex}")
            v = compare(ref.steps, served.steps, loc.canary_tolerance)
            path = served_path(served.vllm_cached, served.lmcache_extra,
                               len(tokens) // loc.canary_chunk_size * loc.canary_chunk_size)
        except (Unreachable, probe.ProbeError) as exc:
            out.append({"entry": i, "state": UNKNOWN, "detail": str(exc)[:200]})
            state = state if state == FAILED else UNKNOWN
            continue
        out.append({"entry": i, "tokens": len(tokens), "path": path, **v.to_dict()})
        if v.state == FAILED:
            state = FAILED
        elif v.state == UNKNOWN and state == PASSED:
            state = UNKNOWN
    detail = "" if state == PASSED else "; ".join(
        f"entry {e['entry']}: {e.get('why') or e.get('detail')}" for e in out
        if e["state"] != PASSED)
    if not chosen:
        detail = "no entries to sample"
    return SampleRun(state, tuple(out), detail[:400],
                     (chosen[-1] + 1) % len(ids) if chosen else 0, time.monotonic() - t0)


__all__ = ["MAX_SAMPLE", "SampleRun", "pick", "sample"]
