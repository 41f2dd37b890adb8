"""The first request a freshly started vLLM serves, sent by kvpersist before it reports ready.

A vLLM that has just started answers its first chat request several times slower than the
same request a moment later (the chat template is compiled, the first batch is scheduled, the
sampler and the streaming path run for the first time). Without this step the first
returning user pays that, on top of the cache's own work. The prime is one streamed, greedy
chat completion of a few tokens through the deployment's chat template, then one greedy
completion of a short text prompt (the completion endpoint and its tokenizer path), then the
path of a returning user: a prompt of token ids just under one chunk, first its first three
quarters and then the whole, so that the second request finds the first in vLLM's prefix cache
and computes only the rest (a prefill after a prefix hit). Measured on the CPU build in
bfloat16 (``bench/first_chat_restart.py``, docs/benchmarks.md "First chat after a restart"):
without that pair, the first chat after a start whose prefix sat in vLLM's prefix cache spent
a median 21 ms in its prefill against 13 ms for the same chat later. Every prompt stays
shorter than one LMCache chunk with its generated tokens, so that nothing is stored (LMCache
stores whole chunks only) and nothing of a user's is evicted; the warm set's own
conversations follow at the end of the warm-up (:mod:`kvpersist.stack.warm.load`). It runs
after vLLM serves the namespace and before the warm set's warm-up, in ``kvp-admin launch``
and in the readiness step of the units and the ``KV_PERSIST=1`` hook (``launch
--warmup-only``).

A prime that fails never fails a launch: vLLM serves either way and the first user pays the
start-up cost; the launch says so.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from kvpersist.stack.locate import Location
from kvpersist.system.untrusted import UnreadableFile, parse_json
from kvpersist.system.vllm_client import Unreachable, token_ids

#: the prime's messages: a few tokens with the chat template, whatever the tokenizer
PRIME_MESSAGES = ({"role": "user", "content": "Hello."},)
#: tokens the prime asks vLLM to generate (two: the first token, then one decode step)
PRIME_MAX_TOKENS = 2
#: the completion prime's text prompt (a few tokens, whatever the tokenizer)
PRIME_PROMPT = "Hello."
#: seconds the prime may take before it counts as failed
PRIME_TIMEOUT_S = 60.0
#: the share of the returning prompt sent first (the prefix the second request finds)
RETURNING_PREFIX_SHARE = 0.75
#: the shortest chunk the returning pair is sent for (a prefix of at least one vLLM block)
RETURNING_MIN_CHUNK = 32


@dataclass(frozen=True)
class PrimeRun:
    """What the prime did: ``ok``, its wall time, the prompt's token count as vLLM reported
    it (None: not reported) and one line of detail."""

    ok: bool
    seconds: float
    detail: str
    prompt_tokens: int | None = None
    #: the returning pair's prefix and whole prompt in tokens (None: not sent)
    returning_tokens: tuple[int, int] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {**asdict(self), "seconds": round(self.seconds, 3)}
        d["returning_tokens"] = list(self.returning_tokens) if self.returning_tokens else None
        return d

    def summary(self) -> str:
        """One line for the launch's progress output (pure)."""
        if self.ok:
            pair = (f", a returning prompt ({self.returning_tokens[0]} then "
                    f"{self.returning_tokens[1]} tokens)" if self.returning_tokens else "")
            return (f"vLLM primed by a short chat ({self.prompt_tokens or '?'} prompt "
                    f"tokens), a short completion{pair}, nothing stored, in "
                    f"{self.seconds:.2f} s")
        return (f"WARNING: the priming request failed after {self.seconds:.1f} s "
                f"({self.detail}); vLLM serves, the first user pays its start-up cost")


def prime_body(model: str) -> dict[str, Any]:
    """The prime's request body for served model ``model`` (pure)."""
    return {"model": model, "messages": [dict(m) for m in PRIME_MESSAGES],
            "max_tokens": PRIME_MAX_TOKENS, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


def completion_prime_body(model: str) -> dict[str, Any]:
    """The completion prime's request body for served model ``model`` (pure)."""
    return {"model": model, "prompt": PRIME_PROMPT, "max_tokens": PRIME_MAX_TOKENS,
            "temperature": 0.0}


def returning_prompts(ids: list[int], chunk_size: int) -> tuple[list[int], list[int]] | None:
    """The returning pair from the token ids ``ids`` of a short text (pure): a prompt of
    ``ids`` repeated that, with :data:`PRIME_MAX_TOKENS` generated tokens, stays one token
    short of ``chunk_size``, and its first :data:`RETURNING_PREFIX_SHARE`. None when there is
    nothing to repeat or the chunk is shorter than :data:`RETURNING_MIN_CHUNK`."""
    if not ids or chunk_size < RETURNING_MIN_CHUNK:
        return None
    total = chunk_size - PRIME_MAX_TOKENS - 1
    whole = (ids * (total // len(ids) + 1))[:total]
    return whole[:int(total * RETURNING_PREFIX_SHARE)], whole


def returning_body(model: str, prompt: list[int]) -> dict[str, Any]:
    """A request of the returning pair for served model ``model`` (pure)."""
    return {"model": model, "prompt": prompt, "max_tokens": PRIME_MAX_TOKENS,
            "temperature": 0.0}


def prime_vllm(loc: Location, *, timeout: float = PRIME_TIMEOUT_S) -> PrimeRun:
    """Send the prime to ``loc``'s vLLM (``/v1/chat/completions``, streamed, read to its
    end; then ``/v1/completions``; then the returning pair, its token ids from ``/tokenize``),
    all within ``timeout``. Never raises: a failure (no answer, an error status or event, a
    timeout) is a PrimeRun with ``ok`` False."""
    t0 = time.monotonic()
    run = _prime_chat(loc, timeout, t0)
    if not run.ok:
        return run
    left = timeout - (time.monotonic() - t0)
    try:
        r = loc.vllm().completions(completion_prime_body(loc.served_model_name),
                                   timeout=max(left, 0.001))
    except Unreachable as exc:
        return PrimeRun(False, time.monotonic() - t0,
                        f"the completion prime: {str(exc)[:300]}", run.prompt_tokens)
    if r.status != 200:
        return PrimeRun(False, time.monotonic() - t0,
                        f"the completion prime: HTTP {r.status}", run.prompt_tokens)
    why, pair = _prime_returning(loc, t0 + timeout)
    return PrimeRun(not why, time.monotonic() - t0, why or "ok", run.prompt_tokens,
                    (len(pair[0]), len(pair[1])) if pair else None)


def _prime_returning(loc: Location, deadline: float
                     ) -> tuple[str, tuple[list[int], list[int]] | None]:
    """Send the returning pair; return why it failed ("" when it did not) and the pair."""
    client, model = loc.vllm(), loc.served_model_name
    try:
        r = client.tokenize({"model": model, "prompt": PRIME_PROMPT,
                             "add_special_tokens": False},
                            timeout=max(deadline - time.monotonic(), 0.001))
        if r.status != 200:
            return f"the returning prime's /tokenize: HTTP {r.status}", None
        ids = token_ids(r)
        if ids is None:
            return "the returning prime's /tokenize answer has no token ids", None
        pair = returning_prompts(ids, loc.canary_chunk_size)
        if pair is None:
            return "", None
        for prompt in pair:
            r = client.completions(returning_body(model, prompt),
                                   timeout=max(deadline - time.monotonic(), 0.001))
            if r.status != 200:
                return f"the returning prime: HTTP {r.status}", pair
    except Unreachable as exc:
        return f"the returning prime: {str(exc)[:300]}", None
    return "", pair


def _prime_chat(loc: Location, timeout: float, t0: float) -> PrimeRun:
    usage: dict[str, Any] = {}
    try:
        with loc.vllm().chat_stream(prime_body(loc.served_model_name),
                                    timeout=timeout) as (status, lines):
            if status != 200:
                return PrimeRun(False, time.monotonic() - t0, f"HTTP {status}")
            for raw in lines:
                if not raw.startswith(b"data: ") or raw == b"data: [DONE]":
                    continue
                try:
                    event = parse_json(raw[6:], "a streamed event")
                except UnreadableFile:
                    return PrimeRun(False, time.monotonic() - t0, "a streamed event is not JSON")
                if not isinstance(event, dict) or "error" in event:
                    return PrimeRun(False, time.monotonic() - t0,
                                    f"vLLM streamed an error: {str(event)[:200]}")
                if isinstance(event.get("usage"), dict):
                    usage = event["usage"]
    except Unreachable as exc:  # its message starts with what failed (ConnectionError...)
        return PrimeRun(False, time.monotonic() - t0, str(exc)[:300])
    except UnreadableFile as exc:
        return PrimeRun(False, time.monotonic() - t0,
                        f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}")
    tokens = usage.get("prompt_tokens")
    return PrimeRun(True, time.monotonic() - t0, "ok",
                    tokens if isinstance(tokens, int) and not isinstance(tokens, bool) else None)


__all__ = ["PRIME_MAX_TOKENS", "PRIME_MESSAGES", "PRIME_PROMPT", "PRIME_TIMEOUT_S",
           "RETURNING_MIN_CHUNK", "RETURNING_PREFIX_SHARE", "PrimeRun", "completion_prime_body",
           "prime_body", "prime_vllm", "returning_body", "returning_prompts"]
