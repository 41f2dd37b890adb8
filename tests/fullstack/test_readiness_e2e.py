"""Readiness end to end: real vLLM (CPU build) + real lmcache server + the real
``kvp-admin warmup``, through ``kvp-admin launch`` and the units' ``launch --warmup-only``.

One deployment with a warm set (a long chat's messages and a long shared document as a plain
prompt), in file order:

1. the first launch primes vLLM (one short request that stores nothing) and warms against an
   empty L2: 0 chunks found, done, health healthy;
2. the warm set is computed by vLLM's own server (the chat, and the document through
   ``/v1/completions``): the chunk files it stores are exactly the pins the warm-up computed
   with LMCache's key code from its token ids (so the ids are vLLM's); with the cache server
   stopped (SIGSTOP) the warm-up of ``launch --warmup-only`` times out: health degraded
   (component ``warmup``), vLLM answers;
3. the units' step again: while its warm-up is held up (the cache server SIGSTOPped under it,
   a real slow server), health says ``warming`` (exit 3) and the step has not returned; once
   the server resumes, every chunk is found and health says ``healthy``.

One vLLM start for the three (the suite's time).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import requests

from kvpersist.demo.chat import chat_completion, long_chat
from kvpersist.system import procs

from ..conftest import REPO
from ._stack import KVP_ADMIN, Stack, wait_until

pytestmark = pytest.mark.fullstack

WARM = long_chat(turns=4, words_per_turn=120, seed=29)
DOCUMENT = ("Shared handbook, chapter one: the namespace separates every deployment's chunk "
            "files; chapter two: the budget keeps the disk below its limit. " * 12)
STATE: dict[str, Any] = {}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("ready")
    warm = tmp / "warm.jsonl"
    warm.write_text(json.dumps({"messages": WARM}) + "\n"
                    + json.dumps({"prompt": DOCUMENT}) + "\n")
    s = Stack(tmp, model=demo_model, KVP_WARMUP_FILE=str(warm), KVP_WARMUP_WAIT="120")
    try:
        yield s
    finally:
        s.cleanup()


def _health(s: Stack) -> tuple[int, dict[str, Any]]:
    r = s.kvp("health", s.config, "--json", "--timeout", "1", timeout=120)
    return r.returncode, json.loads(r.stdout)


def _warmup_check(doc: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in doc["checks"] if c["name"] == "warmup")


def _server_pid(s: Stack) -> int:
    pid = procs.read_pid_file(s.pid_file)
    assert pid, s.pid_file
    return pid


@contextmanager
def _stopped(pid: int) -> Iterator[None]:
    """The cache server frozen (SIGSTOP) and always resumed."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_first_launch_warms_an_empty_l2_finds_nothing_and_is_healthy(stack: Stack) -> None:
    info = stack.launch()
    STATE["ns"] = info["namespace"]
    # vLLM primed before ready: one short request, shorter than one vLLM block, nothing stored
    prime = info["prime"]
    assert prime["ok"] and 0 < prime["prompt_tokens"] < 128, prime
    warm = info["warmup"]
    assert warm["state"] == "done", warm
    assert warm["requested_chunks"] >= 3 and warm["found_chunks"] == 0, warm
    assert stack.chunk_files(info["namespace"] + "_") == []
    code, doc = _health(stack)
    assert (code, doc["status"]) == (0, "healthy"), doc["checks"]
    assert doc["components"]["warmup"] == "ok"
    assert "0/" in _warmup_check(doc)["detail"]
    assert doc["warmup"]["record"]["state"] == "done"
    STATE["requested"] = warm["requested_chunks"]


def test_a_warmup_that_times_out_is_degraded_and_vllm_keeps_serving(stack: Stack) -> None:
    # compute the warm set: vLLM stores its chunks through the cache server onto the NVMe
    cold = chat_completion(stack.vllm_url, "cpu-demo", WARM, max_tokens=24)
    assert cold.completion_tokens and cold.prompt_tokens and cold.prompt_tokens > 256, cold
    doc = requests.post(f"{stack.vllm_url}/v1/completions", timeout=300, json={
        "model": "cpu-demo", "prompt": DOCUMENT, "max_tokens": 1, "temperature": 0.0})
    doc.raise_for_status()
    ns = STATE["ns"]
    assert wait_until(lambda: len(stack.chunk_files(ns + "_")) >= STATE["requested"], 60), \
        [p.name for p in stack.chunk_files()]
    pins = json.loads((stack.root / ".kvpersist" / "pins" / f"{ns}.json").read_text())
    assert {p.name for p in stack.chunk_files(ns + "_")} == \
        {f.rsplit("/", 1)[-1] for f in pins["files"]}
    env = dict(stack.env, KVP_WARMUP_WAIT="3")
    t0 = time.monotonic()
    with _stopped(_server_pid(stack)):
        r = subprocess.run([*KVP_ADMIN, "launch", stack.config, "--warmup-only",
                            "--deadline", "300", "--json"], capture_output=True, text=True,
                           env=env, cwd=REPO, timeout=400)
    took = time.monotonic() - t0
    assert r.returncode == 0, r.stderr  # a failed warm-up never fails the step
    step = json.loads(r.stdout)
    warm = step["warmup"]
    assert warm["state"] == "failed" and warm["exit_code"] == 1, (warm, r.stderr)
    assert step["prime"] is not None, r.stderr  # vLLM served: the step primed it
    assert took < 3 + 90 + 30, took
    code, doc = _health(stack)
    assert (code, doc["status"]) == (1, "degraded"), doc["checks"]
    assert doc["components"] == {**{k: "ok" for k in doc["components"]}, "warmup": "degraded"}
    assert "warm-up failed" in _warmup_check(doc)["detail"]
    served = chat_completion(stack.vllm_url, "cpu-demo", WARM, max_tokens=24)
    assert served.completion_tokens and served.text == cold.text, served


def test_health_says_warming_while_the_warmup_runs_and_healthy_after(stack: Stack) -> None:
    """The units' step (``launch --warmup-only``, what ``ExecStartPost`` runs): held up by a
    frozen cache server, health says warming and the step has not returned (the unit is not
    active yet); once the server resumes, every chunk of the warm set is found."""
    pid_file = stack.state_dir / "pids" / f"{stack.config}.warmup.pid"
    t0 = time.time()
    step = subprocess.Popen([*KVP_ADMIN, "launch", stack.config, "--warmup-only",
                             "--deadline", "600", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=stack.env, cwd=REPO)
    try:
        # the step's warm-up has started: its pid file is this step's, naming a live process
        def warmup_started() -> bool:
            return (pid_file.exists() and pid_file.stat().st_mtime >= t0 - 1
                    and procs.check_pid_file(pid_file, ("kvpersist.stack.warmup",)).running)

        assert wait_until(warmup_started, 120, 0.05), step.poll()
        seen: list[tuple[int, dict[str, Any]]] = []
        with _stopped(_server_pid(stack)):
            assert wait_until(lambda: seen.append(_health(stack)) or
                              seen[-1][1]["status"] == "warming", 90, 0.5), \
                [d["checks"] for _, d in seen[-2:]]
            code, doc = seen[-1]
            assert code == 3
            assert doc["components"]["warmup"] == "warming"
            assert doc["warmup"]["record"]["state"] == "warming"
            assert doc["warmup"]["pid_state"] == "running"
            assert step.poll() is None  # not ready yet: the step waits for the warm-up
        out, err = step.communicate(timeout=400)
    finally:
        if step.poll() is None:
            step.kill()
            step.wait()
    assert step.returncode == 0, err
    warm = json.loads(out)["warmup"]
    assert warm["state"] == "done", (warm, err)
    assert json.loads(out)["prime"]["ok"], err
    assert warm["found_chunks"] == warm["requested_chunks"] == STATE["requested"], warm
    code, doc = _health(stack)
    assert (code, doc["status"]) == (0, "healthy"), doc["checks"]
    assert doc["components"]["warmup"] == "ok"
    detail = _warmup_check(doc)["detail"]
    assert f"{STATE['requested']}/{STATE['requested']} chunks found" in detail, detail
