"""The warm-up's loads into vLLM (kvpersist.stack.warm.load): which entries, the prompt that
loads exactly their found chunks, and the request sent (the success path with real vLLM and a
real cache server: tests/fullstack/test_persistence_e2e.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kvpersist.stack.warm.compute import COMPUTE_USER
from kvpersist.stack.warm.load import LOADS, LoadPlan, load, plan_loads

from ..completions_stub import Stub, completions_stub

CHUNK = 4


def ids(n: int, base: int = 0) -> list[int]:
    return list(range(base, base + n))


def test_the_prompt_is_the_found_chunks_and_one_more_token() -> None:
    [p] = plan_loads([(1, 2)], [ids(11)], CHUNK)
    assert p == LoadPlan(1, 2, ids(9))  # 2 chunks of 4, then token 8


def test_an_entry_of_whole_chunks_repeats_its_last_token() -> None:
    # a prompt of whole chunks would leave vLLM's last token, so its last chunk, unloaded
    [p] = plan_loads([(1, 3)], [ids(12)], CHUNK)
    assert p.prompt == [*ids(12), 11] and p.chunks == 3


def test_only_the_found_chunks_are_loaded_never_more_than_the_entry_has() -> None:
    [p] = plan_loads([(7, 1)], [ids(13)], CHUNK)
    assert (p.line, p.chunks, p.prompt) == (7, 1, ids(5))
    # a count past the entry's own chunks (a bad prefetch answer) is cut to them
    [q] = plan_loads([(7, 9)], [ids(13)], CHUNK)
    assert q.chunks == 3 and q.prompt == ids(13)


def test_most_chunks_first_then_the_warm_sets_order_at_most_loads() -> None:
    entries = [(1, 1), (2, 3), (3, 0), (4, 3), (5, 2), (6, 3)]
    plans = plan_loads(entries, [ids(16, 100 * i) for i in range(6)], CHUNK)
    assert LOADS == 3
    assert [(p.line, p.chunks) for p in plans] == [(2, 3), (4, 3), (6, 3)]
    assert plans[0].prompt == [*ids(12, 100), 112]
    assert [(p.line, p.chunks) for p in plan_loads(entries, [ids(16)] * 6, CHUNK, most=5)] \
        == [(2, 3), (4, 3), (6, 3), (5, 2), (1, 1)]


@pytest.mark.parametrize("entries,token_ids,chunk", [
    ([], [], CHUNK),                      # no warm set entries
    ([(1, 0), (2, 0)], [ids(9), ids(9)], CHUNK),  # nothing found
    ([(1, 2)], [ids(3)], CHUNK),          # under one chunk
    ([(1, 2)], [ids(9)], 0),              # no chunk size
])
def test_nothing_found_nothing_loaded(entries: list[tuple[int, int]],
                                      token_ids: list[list[int]], chunk: int) -> None:
    assert plan_loads(entries, token_ids, chunk) == []
    assert plan_loads([(1, 2)], [ids(9)], CHUNK, most=0) == []


@pytest.fixture
def vllm() -> Iterator[Stub]:
    with completions_stub() as stub:
        yield stub


def test_the_load_is_one_greedy_token_of_the_prompt_marked_as_the_warmups(
        vllm: Stub) -> None:
    url, handler = vllm
    plan = LoadPlan(3, 2, ids(9))
    done = load(url, "served", plan, deadline=time.monotonic() + 30)
    assert done.ok and (done.line, done.chunks) == (3, 2) and done.seconds >= 0
    assert handler.seen == [{"path": "/v1/completions", "body": {
        "model": "served", "prompt": ids(9), "max_tokens": 1, "temperature": 0.0,
        "user": COMPUTE_USER}}]
    assert done.to_dict() == {"line": 3, "chunks": 2, "ok": True,
                              "seconds": round(done.seconds, 3), "detail": ""}


def test_a_refused_or_late_load_is_reported_never_raised(
        vllm: Stub) -> None:
    url, handler = vllm
    handler.status = 400
    refused = load(url, "served", LoadPlan(1, 1, ids(5)), deadline=time.monotonic() + 30)
    assert not refused.ok and "400" in refused.detail
    late = load(url, "served", LoadPlan(1, 1, ids(5)), deadline=0.0, clock=lambda: 1.0)
    assert not late.ok and "budget" in late.detail and len(handler.seen) == 1
