"""The warm-up's last step: one load from the cache server into vLLM, before ready (I/O).

After a restart, the first request that loads KV from the cache server into a freshly
started vLLM is slow, and the time scales with what it moves: measured on the CPU build
(``bench/first_request_probe.py``, docs/benchmarks.md "Restart downtime"), vLLM's own
metrics put the whole gap in the request's queue time, the cache server logged the first
retrieve of 8 chunks at 0.12-0.20 s against 0.014-0.016 s for the same retrieve later, and a
load of one chunk before it did not shorten it. So after the prefetch has put the warm set
into the server's memory, the warm-up sends vLLM the entry with the most chunks found (its
chunks' token ids and one more token, one greedy token back): vLLM looks it up, loads every
chunk through LMCache's connector, and the path is warm for the first user. Up to
:data:`LOADS` entries are loaded, most chunks first: each later load is faster still.

An entry the warm-up has just computed (``--compute-missing``) is not loaded: vLLM computed
it, so its prefix is in vLLM's own prefix cache and a load would move nothing.

Nothing is stored: every full chunk of the prompt is on the server already, the extra token
is less than a chunk, and one generated token needs no decode step. The entries' prefixes stay
in vLLM's own prefix cache until vLLM evicts it. The request carries the warm-up's ``user``
field (:data:`~kvpersist.stack.warm.compute.COMPUTE_USER`). It is bounded by the warm-up's
deadline and never fails the warm-up: a load that fails is a warning, vLLM serves either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpersist.stack.warm import compute as warm_compute

#: entries loaded at most: the second and third loads after a start are still slower than
#: later ones (0.036-0.043 s and 0.024-0.027 s against 0.015 s for 8 chunks); a load of an
#: entry already in vLLM's own prefix cache would load nothing, so each is another entry;
#: five were measured too and did not shorten the first user's request further
LOADS = 3

@dataclass(frozen=True)
class LoadPlan:
    """Which warm-set entry to load and the prompt that loads its found chunks (pure)."""

    line: int
    chunks: int
    prompt: list[int]


@dataclass(frozen=True)
class Loaded:
    """What the load did: the entry's line, its chunks, ``ok``, the wall time and why not."""

    line: int
    chunks: int
    ok: bool
    seconds: float
    detail: str = ""

    def to_dict(self) -> dict[str, object]:
        return {"line": self.line, "chunks": self.chunks, "ok": self.ok,
                "seconds": round(self.seconds, 3), "detail": self.detail}


def plan_loads(entries: Sequence[tuple[int, int]], token_ids: Sequence[Sequence[int]],
               chunk_size: int, *, most: int = LOADS) -> list[LoadPlan]:
    """The entries to load (pure): of ``entries`` ((line, chunks found) per warm-set entry,
    in the order of ``token_ids``), at most ``most`` with a chunk found, most chunks first
    (the warm set's order among equals). Each prompt is the token ids of the entry's found
    chunks and one token more (vLLM computes at least the last token of a prompt, so a
    prompt of whole chunks would leave its last chunk unloaded). Empty when no entry has a
    chunk found or ``chunk_size`` is not positive."""
    if chunk_size <= 0 or most <= 0:
        return []
    found: list[tuple[int, int, Sequence[int]]] = []
    for (line, n), ids in zip(entries, token_ids, strict=True):
        chunks = min(n, len(ids) // chunk_size)
        if chunks > 0:
            found.append((line, chunks, ids))
    found.sort(key=lambda f: -f[1])  # stable: the warm set's order among equals
    plans = []
    for line, chunks, ids in found[:most]:
        n = chunks * chunk_size
        extra = ids[n] if len(ids) > n else ids[n - 1]
        plans.append(LoadPlan(line, chunks, [*ids[:n], extra]))
    return plans


def load(vllm_url: str, model: str, plan: LoadPlan, *, deadline: float,
         clock: Callable[[], float] = time.monotonic) -> Loaded:
    """Send ``plan``'s prompt to vLLM and wait for its answer, at most until ``deadline`` (a
    ``clock`` value). Never raises."""
    run = warm_compute.compute(vllm_url, model, plan.prompt, deadline=deadline, clock=clock)
    return Loaded(plan.line, plan.chunks, run.ok, run.seconds, run.detail)


__all__ = ["LOADS", "LoadPlan", "Loaded", "load", "plan_loads"]
