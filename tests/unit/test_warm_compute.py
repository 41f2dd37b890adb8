"""The warm-up's compute requests (kvpersist.stack.warm.compute): the body vLLM is sent, the
budget that keeps a request from being sent, and every way an answer fails, against a real
HTTP server on loopback (the success path with real vLLM: tests/fullstack/test_readiness_e2e.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from kvpersist.config.settings import DEPLOY_FIX, DEPLOYMENT_KEYS
from kvpersist.stack.warm import compute as warm_compute
from kvpersist.stack.warm.compute import COMPUTE_USER, compute, compute_body

from ..completions_stub import Stub, completions_stub


def test_the_body_is_the_token_ids_one_greedy_token_marked_as_the_warmups() -> None:
    body = compute_body("served", (1, 2, 3))
    assert body == {"model": "served", "prompt": [1, 2, 3], "max_tokens": 1,
                    "temperature": 0.0, "user": COMPUTE_USER}
    assert json.loads(json.dumps(body)) == body


def test_the_setting_is_a_boolean_off_by_default_and_documented() -> None:
    assert DEPLOYMENT_KEYS["KVP_WARMUP_COMPUTE"] == ("warmup_compute", "bool", "false")
    assert "KVP_WARMUP_COMPUTE" in DEPLOY_FIX


@pytest.fixture
def server() -> Iterator[Stub]:
    with completions_stub() as stub:
        yield stub


def test_an_answered_request_is_ok(server: Stub) -> None:
    url, handler = server
    run = compute(url, "m", [5, 6], deadline=time.monotonic() + 10)
    assert run.ok and run.detail == "" and run.seconds >= 0
    assert handler.seen == [{"path": "/v1/completions", "body": compute_body("m", [5, 6])}]


def test_a_refused_request_is_not_ok_and_says_why(server: Stub) -> None:
    url, handler = server
    handler.status = 400
    run = compute(url, "m", [5], deadline=time.monotonic() + 10)
    assert not run.ok and run.detail.startswith("vLLM answered 400") and "too long" in run.detail


def test_no_time_left_sends_nothing(server: Stub) -> None:
    url, handler = server
    run = compute(url, "m", [5], deadline=time.monotonic() - 1)
    assert not run.ok and "budget" in run.detail and handler.seen == []


def test_no_vllm_is_not_ok_and_never_raises() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run = compute(f"http://127.0.0.1:{port}", "m", [5], deadline=time.monotonic() + 5)
    assert not run.ok and "did not answer" in run.detail


def test_recount_pauses_are_bounded() -> None:
    assert warm_compute.RECOUNT_TRIES * warm_compute.RECOUNT_PAUSE_S <= 5
