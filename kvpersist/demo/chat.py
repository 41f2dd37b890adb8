"""A deterministic long multi-turn chat, and a streaming client that times the first token.

``long_chat`` is pure. ``chat_completion`` does HTTP (through the vLLM client) against an
OpenAI-compatible ``/v1/chat/completions`` endpoint; every way it fails is a
:class:`~kvpersist.errors.DemoFailed`.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from kvpersist.errors import DemoFailed
from kvpersist.system.http_client import status_error
from kvpersist.system.untrusted import UnreadableFile, parse_json
from kvpersist.system.vllm_client import Unreachable, VllmClient

_TOPICS = (
    "the cache server", "the model weights", "the disk budget", "the restart order",
    "the chunk files", "the namespace", "the retention plan", "the prefill cost",
)
_WORDS = (  # noqa: SIM905
    "block chunk layer token restart persist storage request answer question engine kernel "
    "vector matrix compute cluster node process thread queue network latency throughput "
    "memory disk server model the of and to in is that for on with as at from by this "
    "have not but what all were when there can each about how out them then many some "
    "these would other into more two time could make first been people made over only way "
    "find use may water long little very after words called where most know get through"
).split()


def long_chat(turns: int = 8, words_per_turn: int = 150, seed: int = 7,
              final_question: str = "Summarise the whole discussion in one line.",
              ) -> list[dict[str, str]]:
    """Return a chat history (system + alternating user/assistant turns + a final user turn).

    Deterministic for a given (turns, words_per_turn, seed). About 1.3 tokens per word with
    the demo tokenizer, so the defaults give roughly 1,500-2,000 prompt tokens: several full
    256-token LMCache chunks.
    """
    rng = random.Random(seed)
    msgs: list[dict[str, str]] = [
        {"role": "system", "content": "You are the operations assistant of a KV-cache cluster."}
    ]
    for i in range(turns):
        role = "user" if i % 2 == 0 else "assistant"
        topic = rng.choice(_TOPICS)
        body = " ".join(rng.choice(_WORDS) for _ in range(words_per_turn))
        msgs.append({"role": role, "content": f"Turn {i + 1} about {topic}: {body}."})
    if msgs[-1]["role"] == "user":
        msgs.append({"role": "assistant", "content": "Noted."})
    msgs.append({"role": "user", "content": final_question})
    return msgs


@dataclass(frozen=True)
class ChatResult:
    """One streamed completion: its text, time to first token and total time (seconds)."""

    text: str
    ttft_s: float
    total_s: float
    prompt_tokens: int | None
    completion_tokens: int | None


def chat_completion(base_url: str, model: str, messages: list[dict[str, str]], *,
                    max_tokens: int = 32, timeout: float = 300.0,
                    min_tokens: int = 0) -> ChatResult:
    """POST a greedy, streamed chat completion; return text and timings.

    Given: the server's base URL (``http://host:port``), the served model name and messages;
    ``min_tokens`` (vLLM's sampling parameter: no end of sequence before that many tokens).
    Raises DemoFailed when the request fails (no answer, an HTTP error status, a timeout),
    the server streams an error, or a streamed event is not a JSON object.
    """
    what = f"chat completion at {base_url}"
    fix = (f"check that vLLM serves the model {model!r} at {base_url} (its log says why it "
           "failed)")
    try:
        return _stream(base_url, model, messages, max_tokens, timeout, what, fix, min_tokens)
    except Unreachable as exc:
        raise DemoFailed(what, str(exc)[:400], fix) from exc


def _stream(base_url: str, model: str, messages: list[dict[str, str]], max_tokens: int,
            timeout: float, what: str, fix: str, min_tokens: int = 0) -> ChatResult:
    """The request of :func:`chat_completion`. Raises DemoFailed for an error event or one
    that is not a JSON object or an error status, Unreachable when nothing answers."""
    body: dict[str, Any] = {
        "model": model, "messages": messages, "max_tokens": max_tokens,
        "temperature": 0.0, "seed": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if min_tokens:
        body["min_tokens"] = min_tokens
    t0 = time.monotonic()
    ttft: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] = {}
    with VllmClient(base_url).chat_stream(body, timeout=timeout) as (status, lines):
        if status != 200:
            raise DemoFailed(what, str(status_error(status, f"{base_url}/v1/chat/completions")),
                             fix)
        for raw in lines:
            if not raw or not raw.startswith(b"data: "):
                continue
            data = raw[len(b"data: "):]
            if data == b"[DONE]":
                break
            try:
                event = parse_json(data, "a streamed event")
            except UnreadableFile:
                event = None
            if not isinstance(event, dict):
                raise DemoFailed(what, f"a streamed event is not a JSON object: "
                                 f"{data[:120]!r}", fix)
            if "error" in event:
                error = " ".join(str(event["error"]).split())
                raise DemoFailed(what, f"the server answered with an error: {error[:300]}",
                                 fix)
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if ttft is None:
                        ttft = time.monotonic() - t0
                    parts.append(piece)
    total = time.monotonic() - t0
    return ChatResult(
        text="".join(parts),
        ttft_s=ttft if ttft is not None else total,
        total_s=total,
        prompt_tokens=usage.get("prompt_tokens"),
        completion_tokens=usage.get("completion_tokens"),
    )
