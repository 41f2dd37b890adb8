"""The priming request (kvpersist.stack.warm.prime): its body, its one-line summary, and a vLLM
that does not answer. The request against a real vLLM runs in the full-stack readiness test
(tests/fullstack/test_readiness_e2e.py): it primes and stores nothing."""

from __future__ import annotations

import time
from dataclasses import replace

from kvpersist.config.loader import load_deployment
from kvpersist.stack.locate import locate
from kvpersist.stack.warm import prime
from kvpersist.system import procs


def test_the_body_is_one_short_greedy_streamed_chat_of_two_tokens() -> None:
    body = prime.prime_body("cpu-demo")
    assert body["model"] == "cpu-demo"
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["temperature"] == 0.0 and body["max_tokens"] == prime.PRIME_MAX_TOKENS == 2
    # far shorter than one LMCache chunk (256 tokens) or one vLLM CPU block (128): in any
    # tokenizer a word is at least one character
    words = " ".join(m["content"] for m in body["messages"])
    assert len(words) < 32, words
    body["messages"][0]["content"] = "changed"  # the body is a copy
    assert prime.PRIME_MESSAGES[0]["content"] == "Hello."


def test_the_completion_prime_is_a_short_greedy_text_prompt() -> None:
    body = prime.completion_prime_body("cpu-demo")
    assert body == {"model": "cpu-demo", "prompt": "Hello.", "max_tokens": 2,
                    "temperature": 0.0}
    assert len(body["prompt"]) < 32


def test_summaries_say_what_happened_and_what_it_costs() -> None:
    ok = prime.PrimeRun(True, 0.4321, "ok", 9, (189, 253))
    assert ok.summary() == ("vLLM primed by a short chat (9 prompt tokens), a short "
                            "completion, a returning prompt (189 then 253 tokens), nothing "
                            "stored, in 0.43 s")
    assert ok.to_dict() == {"ok": True, "seconds": 0.432, "detail": "ok", "prompt_tokens": 9,
                            "returning_tokens": [189, 253]}
    assert prime.PrimeRun(True, 0.1, "ok", 9).summary() == (
        "vLLM primed by a short chat (9 prompt tokens), a short completion, nothing stored, "
        "in 0.10 s")
    bad = prime.PrimeRun(False, 2.0, "HTTP 500")
    assert bad.summary().startswith("WARNING: the priming request failed after 2.0 s "
                                    "(HTTP 500)")
    assert "the first user pays its start-up cost" in bad.summary()


def test_the_returning_pair_stays_under_one_chunk_and_its_second_extends_its_first() -> None:
    for ids, chunk in (([9906, 13], 256), ([1], 256), ([5, 6, 7], 32), (list(range(300)), 256),
                       ([3, 4], 1024)):
        pair = prime.returning_prompts(ids, chunk)
        assert pair is not None
        first, whole = pair
        # with its generated tokens the whole prompt is one token short of a chunk: LMCache
        # stores whole chunks only, so nothing is stored
        assert len(whole) + prime.PRIME_MAX_TOKENS == chunk - 1
        assert whole[:len(first)] == first and 0 < len(first) < len(whole)
        assert len(first) == int(len(whole) * prime.RETURNING_PREFIX_SHARE)
        assert set(whole) <= set(ids)
    assert prime.returning_prompts([], 256) is None
    assert prime.returning_prompts([1, 2], prime.RETURNING_MIN_CHUNK - 1) is None
    assert prime.returning_body("m", [1, 2]) == {"model": "m", "prompt": [1, 2],
                                                 "max_tokens": 2, "temperature": 0.0}


def test_a_vllm_that_does_not_answer_is_a_failed_prime_not_an_error() -> None:
    dep = load_deployment("cpu-demo", {"KVP_CACHE_ROOT": "/tmp/kvp-prime-test",
                                       "KVP_MODEL_PATH": "/nonexistent"}, allow_unpinned=True)
    port = procs.free_port()  # bound by nobody: connection refused
    loc = replace(locate(dep), vllm_url=f"http://127.0.0.1:{port}")
    t0 = time.monotonic()
    run = prime.prime_vllm(loc, timeout=5)
    assert not run.ok and run.prompt_tokens is None
    assert run.detail.startswith("ConnectionError"), run.detail
    assert time.monotonic() - t0 < 5
