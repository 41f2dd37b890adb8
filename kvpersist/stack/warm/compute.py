"""Compute the warm set's missing chunks with the deployment's own vLLM (I/O).

``kvp-admin warmup --compute-missing`` (and the launch's warm-up with
``KVP_WARMUP_COMPUTE=1``): after the warm-up's prefetch, an entry whose chunks were not all
found on any tier (the NVMe, the shared tier) is sent to the deployment's vLLM once, as the
very token ids the warm-up computed its keys from (``POST /v1/completions`` with the ids as
the prompt, one greedy token), so vLLM computes the prefill and LMCache stores every full
chunk under exactly the keys the warm-up pinned. The entry is then prefetched again to count
what is there now. On a fleet the first host computes and its server stores into the shared
tier too; the next host's prefetch finds them there and computes nothing.

Bounded by the warm-up's deadline (``--wait`` / KVP_WARMUP_WAIT): an entry that no longer
fits is not sent and is reported (``not_computed``); a request vLLM refuses or that fails
is reported too. Nothing here fails the warm-up or the launch: vLLM serves either way.

The requests carry ``"user": "kvpersist-warmup"`` (the OpenAI field vLLM accepts) and are
counted in the warm-up's own record (``computed_chunks``, ``compute_seconds``), never in
kvpersist's view of user traffic; vLLM's own request counters do include them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpersist.system.vllm_client import Unreachable, VllmClient

#: the ``user`` field of the warm-up's compute requests
COMPUTE_USER = "kvpersist-warmup"
#: tokens each compute request generates (the prefill is what it is for)
COMPUTE_MAX_TOKENS = 1
#: how often, and how long apart, the entry is prefetched again after it was computed
#: (LMCache stores the chunks a moment after vLLM answers)
RECOUNT_TRIES = 10
RECOUNT_PAUSE_S = 0.3


@dataclass(frozen=True)
class Computed:
    """One entry sent to vLLM: ``ok``, its wall time and one line of detail."""

    ok: bool
    seconds: float
    detail: str = ""


def compute_body(model: str, token_ids: Sequence[int]) -> dict[str, object]:
    """The compute request for served model ``model`` (pure): the ids as the prompt, one
    greedy token, marked as the warm-up's."""
    return {"model": model, "prompt": list(token_ids), "max_tokens": COMPUTE_MAX_TOKENS,
            "temperature": 0.0, "user": COMPUTE_USER}


def compute(vllm_url: str, model: str, token_ids: Sequence[int], *, deadline: float,
            clock: Callable[[], float] = time.monotonic) -> Computed:
    """Send ``token_ids`` to vLLM's ``/v1/completions`` and wait for its answer, at most
    until ``deadline`` (a ``clock`` value). Never raises."""
    t0 = clock()
    left = deadline - t0
    if left <= 0:
        return Computed(False, 0.0, "no time left in the warm-up's budget")
    try:
        r = VllmClient(vllm_url).completions(compute_body(model, token_ids), timeout=left)
    except Unreachable as exc:
        return Computed(False, clock() - t0, f"vLLM at {vllm_url} did not answer ({exc})")
    if r.status != 200:
        return Computed(False, clock() - t0, f"vLLM answered {r.status}: {r.text(200)!r}")
    return Computed(True, clock() - t0)
