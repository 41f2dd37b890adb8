"""The first request a freshly started vLLM serves, sent by kvpersist before it reports ready.

A vLLM that has just started answers its first chat request several times slower than the
same request a moment later (the chat template is compiled, the first batch is scheduled, the
sampler and the streaming path run for the first time). Without this step the first
returning user pays that, on top of the cache's own work. The prime is one streamed, greedy
chat completion of a few tokens, far shorter than one LMCache chunk, so that nothing is stored
(LMCache stores whole chunks only) and nothing of a user's is evicted; it runs after vLLM
serves the namespace and before the warm set's warm-up, in ``kvp-admin launch`` and in the
readiness step of the units and the ``KV_PERSIST=1`` hook (``launch --warmup-only``).

A prime that fails never fails a launch: vLLM serves either way and the first user pays the
start-up cost; the launch says so.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

from kvpersist.stack.locate import Location
from kvpersist.system.untrusted import UnreadableFile, parse_json
from kvpersist.system.vllm_client import Unreachable

#: the prime's messages: a few tokens with the chat template, whatever the tokenizer
PRIME_MESSAGES = ({"role": "user", "content": "Hello."},)
#: tokens the prime asks vLLM to generate (two: the first token, then one decode step)
PRIME_MAX_TOKENS = 2
#: seconds the prime may take before it counts as failed
PRIME_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class PrimeRun:
    """What the prime did: ``ok``, its wall time, the prompt's token count as vLLM reported
    it (None: not reported) and one line of detail."""

    ok: bool
    seconds: float
    detail: str
    prompt_tokens: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "seconds": round(self.seconds, 3)}

    def summary(self) -> str:
        """One line for the launch's progress output (pure)."""
        if self.ok:
            return (f"vLLM primed by one short request ({self.prompt_tokens or '?'} prompt "
                    f"tokens, nothing stored) in {self.seconds:.2f} s")
        return (f"WARNING: the priming request failed after {self.seconds:.1f} s "
                f"({self.detail}); vLLM serves, the first user pays its start-up cost")


def prime_body(model: str) -> dict[str, Any]:
    """The prime's request body for served model ``model`` (pure)."""
    return {"model": model, "messages": [dict(m) for m in PRIME_MESSAGES],
            "max_tokens": PRIME_MAX_TOKENS, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}


def prime_vllm(loc: Location, *, timeout: float = PRIME_TIMEOUT_S) -> PrimeRun:
    """Send the prime to ``loc``'s vLLM (``/v1/chat/completions``, streamed) and read the
    stream to its end. Never raises: a failure (no answer, an error status or event, a
    timeout) is a PrimeRun with ``ok`` False."""
    t0 = time.monotonic()
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


__all__ = ["PRIME_MAX_TOKENS", "PRIME_MESSAGES", "PRIME_TIMEOUT_S", "PrimeRun", "prime_body",
           "prime_vllm"]
