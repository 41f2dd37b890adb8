"""The canary's prompt (pure): a fixed conversation in the deployment's chat template, cut to
a few full cache chunks and a short tail.

The conversation is the same for every deployment (seeded words, no user data); vLLM's own
``/tokenize`` applies the deployment's chat template and tokenizer to it
(:mod:`kvpersist.stack.canary.probe`). The prompt sent is the first ``chunks`` full chunks of
those tokens followed by the conversation's last :data:`TAIL_TOKENS` tokens (the generation
prompt): LMCache stores whole chunks only, so exactly ``chunks`` chunks are stored and later
retrieved, and vLLM computes the tail and the generated steps on top of them.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

#: tokens after the full chunks: the conversation's end (shorter than any chunk)
TAIL_TOKENS = 8
#: the seed of the conversation's words (changing it changes every canary: a new reference)
SEED = 20261206
_WORDS = ("cache", "restart", "vector", "memory", "disk", "token", "layer", "value", "key",
          "model", "prefix", "chunk", "store", "answer", "check", "known", "route", "frame",
          "river", "stone", "light", "paper", "green", "seven", "north", "quiet", "bridge",
          "window", "garden", "number", "signal", "copper", "winter", "orange", "planet")


def conversation(words: int) -> list[dict[str, str]]:
    """The canary's messages: a system line and one user turn of ``words`` seeded words."""
    rng = random.Random(SEED)
    text = " ".join(rng.choice(_WORDS) for _ in range(words))
    return [{"role": "system", "content": "kvpersist canary: a known-answer probe."},
            {"role": "user", "content": text}]


def words_for(chunk_size: int, chunks: int) -> int:
    """Words enough for ``chunks`` chunks (at least one token per word, and a margin)."""
    return chunk_size * chunks + 4 * TAIL_TOKENS


def cut(tokens: Sequence[int], chunk_size: int, chunks: int) -> list[int] | None:
    """The prompt: the first ``chunks`` full chunks of ``tokens`` and its last
    :data:`TAIL_TOKENS`; None when ``tokens`` is too short for that."""
    head = chunk_size * chunks
    if len(tokens) < head + TAIL_TOKENS:
        return None
    return [*tokens[:head], *tokens[len(tokens) - TAIL_TOKENS:]]


__all__ = ["SEED", "TAIL_TOKENS", "conversation", "cut", "words_for"]
