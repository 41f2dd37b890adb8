"""The canary's requests to the deployment's vLLM (through :mod:`kvpersist.system.vllm_client`).

* :func:`prompt_tokens`: the canary conversation (:mod:`kvpersist.stack.canary.prompt`)
  through vLLM's ``/tokenize`` with the deployment's chat template, cut to whole chunks;
* :func:`ask`: one greedy completion of the prompt's token ids, ``steps`` tokens with their
  top logprobs (``return_tokens_as_token_ids``: ids, not text), optionally under a
  ``cache_salt`` (the reference: nothing cached under a fresh salt, in vLLM or LMCache), and
  ``kv_transfer_params.cached_token_stats`` so that LMCache's connector reports where the
  prompt came from: vLLM's prefix cache, LMCache, or computed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpersist.errors import KvpError
from kvpersist.stack.canary import prompt
from kvpersist.stack.canary.verdict import Step
from kvpersist.system.untrusted import UnreadableFile
from kvpersist.system.vllm_client import VllmClient, token_ids

#: generated steps compared, and the top logprobs asked for at each
STEPS = 4
TOP = 5
#: seconds one canary request may take (a busy vLLM that does not answer: unknown)
REQUEST_TIMEOUT_S = 120.0


class ProbeError(KvpError):
    """vLLM's answer cannot be used (an error status, no logprobs): the run is unknown."""


@dataclass(frozen=True)
class Asked:
    """One canary request's answer."""

    steps: tuple[Step, ...]
    seconds: float
    #: prompt tokens vLLM's own prefix cache held, and tokens LMCache supplied beyond them
    #: (the connector's ``cached_token_stats``; None: not reported)
    vllm_cached: int | None
    lmcache_extra: int | None
    prompt_tokens: int | None

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 3), "vllm_cached": self.vllm_cached,
                "lmcache_extra": self.lmcache_extra, "prompt_tokens": self.prompt_tokens}


def prompt_tokens(client: VllmClient, model: str, chunk_size: int, chunks: int,
                  timeout: float = REQUEST_TIMEOUT_S) -> list[int]:
    """The canary prompt's token ids for this deployment. Raises Unreachable, ProbeError."""
    words = prompt.words_for(chunk_size, chunks)
    for _ in range(4):
        body = {"model": model, "messages": prompt.conversation(words),
                "add_generation_prompt": True}
        reply = client.tokenize(body, timeout)
        tokens = token_ids(reply)
        if tokens is None:
            raise ProbeError(f"vLLM's /tokenize answered HTTP {reply.status}: "
                             f"{reply.text(200)}")
        cut = prompt.cut(tokens, chunk_size, chunks)
        if cut is not None:
            return cut
        words *= 2
    raise ProbeError(f"the canary conversation of {words // 2} words is shorter than "
                     f"{chunks} chunks of {chunk_size} tokens")


def _token_id(text: Any) -> int:
    """``token_id:123`` (``return_tokens_as_token_ids``) -> 123."""
    if not isinstance(text, str) or not text.startswith("token_id:"):
        raise ValueError(f"not a token id: {str(text)[:40]!r}")
    return int(text[len("token_id:"):])


def steps_of(doc: dict[str, Any]) -> tuple[Step, ...]:
    """The greedy steps of a completions answer with logprobs (pure). Raises ProbeError."""
    try:
        choice = doc["choices"][0]
        lp = choice["logprobs"]
        tokens, tops = lp["tokens"], lp["top_logprobs"]
        out = []
        for tok, top in zip(tokens, tops, strict=True):
            out.append(Step(_token_id(tok),
                            {_token_id(k): float(v) for k, v in dict(top).items()}))
        return tuple(out)
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ProbeError(f"vLLM's answer has no usable logprobs ({type(exc).__name__}: "
                         f"{str(exc)[:120]})") from None


def _int_or_none(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def ask(client: VllmClient, model: str, tokens: Sequence[int], *, salt: str = "",
        steps: int = STEPS, top: int = TOP, timeout: float = REQUEST_TIMEOUT_S) -> Asked:
    """One greedy completion of ``tokens`` (see the module docstring). Raises Unreachable,
    ProbeError."""
    body: dict[str, Any] = {
        "model": model, "prompt": list(tokens), "max_tokens": steps, "min_tokens": steps,
        "temperature": 0.0, "logprobs": top, "return_tokens_as_token_ids": True,
        "kv_transfer_params": {"cached_token_stats": True}}
    if salt:
        body["cache_salt"] = salt
    t0 = time.monotonic()
    reply = client.completions(body, timeout)
    seconds = time.monotonic() - t0
    try:
        doc = reply.json("vLLM's /v1/completions")
    except UnreadableFile as exc:
        raise ProbeError(str(exc)) from None
    if reply.status != 200 or not isinstance(doc, dict):
        raise ProbeError(f"vLLM's /v1/completions answered HTTP {reply.status}: "
                         f"{reply.text(200)}")
    got = steps_of(doc)
    params = doc.get("kv_transfer_params")
    stats = params.get("cached_token_stats") if isinstance(params, dict) else None
    stats = stats if isinstance(stats, dict) else {}
    usage_doc = doc.get("usage")
    usage: dict[str, Any] = usage_doc if isinstance(usage_doc, dict) else {}
    return Asked(got, seconds, _int_or_none(stats.get("num_vllm_cached_tokens")),
                 _int_or_none(stats.get("num_lmcache_extra_cached_tokens")),
                 _int_or_none(usage.get("prompt_tokens")))


__all__ = ["REQUEST_TIMEOUT_S", "STEPS", "TOP", "Asked", "ProbeError", "ask", "prompt_tokens",
           "steps_of"]
