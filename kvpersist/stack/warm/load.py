"""The warm-up's last step: the warm set from the cache server into vLLM, before ready (I/O).

After a restart the warm set sits in the cache server's memory (the prefetch), but a user's
first request still pays the load into a freshly started vLLM, and the first run of each of
vLLM's paths it takes: measured on the CPU build (``bench/first_request_probe.py``,
docs/benchmarks.md "Restart downtime"), the first retrieves after a start are slow
(0.12-0.20 s for 8 chunks against 0.015 s later); and in some restarts a warm chat whose
prefix sat in vLLM's own prefix cache already spent 70-140 ms more than later in the chat
endpoint's front end (``bench/first_chat_restart.py``, docs/benchmarks.md "First chat after a
restart"), which a load through the token ids never runs.

So the warm-up ends by sending vLLM every warm-set entry it found chunks of, most chunks first,
as far as vLLM's KV cache holds them (:func:`plan_loads`: at most :data:`KV_SHARE` of its
tokens, so that the traffic that comes first still finds free blocks and does not evict the
warm set). An entry whose every full chunk was found goes to the endpoint its users take,
as it is (``messages`` to ``/v1/chat/completions`` with the deployment's chat template and
tools, ``prompt`` to ``/v1/completions``): the template, the tokenizer and the endpoint run on
a real conversation, and vLLM loads the chunks through LMCache's connector and computes the
tail (less than a chunk). An entry with chunks missing sends only its found chunks' token ids
and one token more (whole-entry requests would compute, and store, the missing chunks). One
greedy token back. The entries' prefixes then sit in vLLM's own prefix cache.

Nothing is stored: every full chunk of each prompt is on the server already, the rest is less
than a chunk, and one generated token needs no decode step. What evicts the warm set from vLLM:
vLLM reuses its least recently used free blocks when a request needs new ones, and the warm
set's blocks are freed after the loads, behind the blocks no request has used yet; so they
stay until the traffic before a warm user has taken more than the rest of the KV cache (or a
``/reset_prefix_cache``), and each hit makes them recent again.

An entry the warm-up has just computed (``--compute-missing``) is not loaded: vLLM computed
it, so its prefix is in vLLM's own prefix cache already. The requests carry the warm-up's
``user`` field (:data:`~kvpersist.stack.warm.compute.COMPUTE_USER`). They are bounded by the
warm-up's deadline and never fail the warm-up: a load that fails is a warning and ends the
loads; vLLM serves either way.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpersist.stack.warm import compute as warm_compute
from kvpersist.system.vllm_client import Unreachable, VllmClient

#: entries loaded at most when vLLM's KV cache size is not known (its metrics did not say):
#: the loads of the earlier releases
LOADS = 3
#: the share of vLLM's KV cache (in tokens) the warm set's loads may take: the rest stays
#: free for the traffic that comes before a warm user, so that it does not evict them
KV_SHARE = 0.5


@dataclass(frozen=True)
class LoadPlan:
    """Which warm-set entry to load and how (pure): ``prompt`` the token ids of its found
    chunks and one token more; ``body`` the entry itself (its ``messages`` with ``tools``
    and ``add_generation_prompt``, or its ``prompt``) when every full chunk was found, sent
    as its users send it; ``tokens`` what it takes of vLLM's KV cache."""

    line: int
    chunks: int
    prompt: list[int]
    body: Mapping[str, Any] | None = None
    tokens: int = 0

    @property
    def endpoint(self) -> str:
        if self.body is None:
            return "tokens"
        return "chat" if "messages" in self.body else "completions"


@dataclass(frozen=True)
class Loaded:
    """What the load did: the entry's line, its chunks, ``ok``, the wall time and why not."""

    line: int
    chunks: int
    ok: bool
    seconds: float
    detail: str = ""
    endpoint: str = "tokens"

    def to_dict(self) -> dict[str, object]:
        return {"line": self.line, "chunks": self.chunks, "ok": self.ok,
                "seconds": round(self.seconds, 3), "detail": self.detail,
                "endpoint": self.endpoint}


def plan_loads(entries: Sequence[tuple[int, int]], token_ids: Sequence[Sequence[int]],
               chunk_size: int, *, bodies: Sequence[Mapping[str, Any] | None] | None = None,
               kv_tokens: int | None = None, most: int | None = None) -> list[LoadPlan]:
    """The entries to load (pure): of ``entries`` ((line, chunks found) per warm-set entry,
    in the order of ``token_ids``), those with a chunk found, most chunks first (the warm
    set's order among equals), as long as their tokens fit in :data:`KV_SHARE` of
    ``kv_tokens`` (vLLM's KV cache; None: unknown, then at most :data:`LOADS` entries);
    ``most`` bounds the count too. An entry that does not fit is passed over, a smaller one
    after it may still fit.

    Each plan's ``prompt`` is the token ids of the entry's found chunks and one token more
    (vLLM computes at least the last token of a prompt, so a prompt of whole chunks would
    leave its last chunk unloaded); with ``bodies`` (the warm-set entries' objects, in the
    same order) an entry whose every full chunk was found carries its object as ``body``
    and takes all its tokens. Empty when no entry has a chunk found or ``chunk_size`` is not
    positive."""
    if chunk_size <= 0 or (most is not None and most <= 0):
        return []
    cap = most if most is not None else (LOADS if kv_tokens is None else len(entries))
    budget = None if kv_tokens is None else int(kv_tokens * KV_SHARE)
    found: list[tuple[int, int, int]] = []
    for i, ((line, n), ids) in enumerate(zip(entries, token_ids, strict=True)):
        chunks = min(n, len(ids) // chunk_size)
        if chunks > 0:
            found.append((line, chunks, i))
    found.sort(key=lambda f: -f[1])  # stable: the warm set's order among equals
    plans: list[LoadPlan] = []
    used = 0
    for line, chunks, i in found:
        if len(plans) >= cap:
            break
        ids = token_ids[i]
        n = chunks * chunk_size
        whole = bodies is not None and bodies[i] is not None and chunks == len(ids) // chunk_size
        tokens = len(ids) + 1 if whole else n + 1
        if budget is not None and used + tokens > budget:
            continue
        used += tokens
        extra = ids[n] if len(ids) > n else ids[n - 1]
        plans.append(LoadPlan(line, chunks, [*ids[:n], extra],
                              bodies[i] if whole and bodies is not None else None, tokens))
    return plans


def load_body(model: str, plan: LoadPlan) -> tuple[str, dict[str, Any]]:
    """The load's endpoint (``chat``, ``completions``) and request body (pure): the entry's
    own object, or its token ids as the prompt; one greedy token, the warm-up's ``user``."""
    common = {"model": model, "max_tokens": warm_compute.COMPUTE_MAX_TOKENS,
              "temperature": 0.0, "user": warm_compute.COMPUTE_USER}
    if plan.body is None:
        return "completions", {**common, "prompt": list(plan.prompt)}
    if "messages" in plan.body:
        body: dict[str, Any] = {"messages": plan.body["messages"]}
        for key in ("tools", "add_generation_prompt"):
            if key in plan.body:
                body[key] = plan.body[key]
        return "chat", {**common, **body}
    return "completions", {**common, "prompt": plan.body["prompt"]}


def load(vllm_url: str, model: str, plan: LoadPlan, *, deadline: float,
         clock: Callable[[], float] = time.monotonic) -> Loaded:
    """Send ``plan``'s request to vLLM and wait for its answer, at most until ``deadline``
    (a ``clock`` value). Never raises."""
    t0 = clock()
    left = deadline - t0

    def done(ok: bool, detail: str = "") -> Loaded:
        return Loaded(plan.line, plan.chunks, ok, clock() - t0, detail, plan.endpoint)

    if left <= 0:
        return done(False, "no time left in the warm-up's budget")
    endpoint, body = load_body(model, plan)
    client = VllmClient(vllm_url)
    try:
        r = (client.chat(body, timeout=left) if endpoint == "chat"
             else client.completions(body, timeout=left))
    except Unreachable as exc:
        return done(False, f"vLLM at {vllm_url} did not answer ({exc})")
    if r.status != 200:
        return done(False, f"vLLM answered {r.status}: {r.text(200)!r}")
    return done(True)


__all__ = ["KV_SHARE", "LOADS", "LoadPlan", "Loaded", "load", "load_body", "plan_loads"]
