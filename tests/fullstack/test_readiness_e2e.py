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
   the server resumes, every chunk is found and health says ``healthy``;
4. tenants, on the same running deployment: the same long chat sent with different
   ``cache_salt`` values finds nothing of another tenant's in vLLM's prefix cache, LMCache's
   L1 or the NVMe (each salt's chunk files are its own, ``...@<salt>.bin``), while the same
   tenant hits; a request without a salt and one with a salt share nothing either
   (docs/tenants.md, with the times to first token measured here).
5. ``shred`` of the namespace (refused while it is configured, unless ``--force``; the dry
   run destroys nothing): with the cache server stopped and vLLM serving on, the key goes
   first, then the namespace's files; the launch that follows starts only the server, with a
   new key, and a chat served from the cache before the shred now misses on every tier and
   gets the same tokens (docs/keys-and-shred.md).
6. ``warmup --compute-missing`` on the shredded namespace (its warm set on no tier): the
   deployment's vLLM computes every chunk of the warm set, LMCache stores exactly the pinned
   files, a second run computes nothing and finds all, and the warm set's chat is then served
   from the cache with the tokens of its cold answer (docs/warm-restart.md).

One vLLM start for all six (the suite's time).
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
from kvpersist.stack.warm import readiness
from kvpersist.system import procs

from ..conftest import REPO
from ._stack import KVP_ADMIN, Stack, vllm_metric, wait_until

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
    # the canary is off here: this module counts the namespace's files and requests and
    # freezes the cache server under the readiness step; the canary's own requests and its
    # files (docs/canary.md) are tested in test_canary_e2e.py and test_persistence_e2e.py
    s = Stack(tmp, model=demo_model, KVP_WARMUP_FILE=str(warm), KVP_WARMUP_WAIT="120",
              VLLM_SERVER_DEV_MODE="1",  # /reset_prefix_cache (the shred test)
              KVP_CANARY="false")
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
def _stopped(s: Stack) -> Iterator[None]:
    """The cache server frozen (SIGSTOP) and always resumed, then vLLM's connector out of its
    degraded mode: a heartbeat that timed out while the server was frozen put it there (no
    lookups, no stores: a request served then would count nothing on the server), the next
    one brings it back. A ping still pending at the resume ends within one interval, so the
    wait starts after two."""
    from kvpersist.stack.render import HEARTBEAT_INTERVAL_S

    os.kill(_server_pid(s), signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(_server_pid(s), signal.SIGCONT)
        time.sleep(2 * HEARTBEAT_INTERVAL_S + 0.5)
        assert wait_until(lambda: not s.connector_degraded(), 60, 0.2), s.vllm_log


def test_first_launch_warms_an_empty_l2_finds_nothing_and_is_healthy(stack: Stack) -> None:
    info = stack.launch()
    STATE["ns"] = info["namespace"]
    # vLLM primed before ready: a short chat, shorter than one vLLM block, a short completion
    # and the returning pair (a prompt, then it extended to one token short of a chunk with
    # its generated tokens): nothing stored
    prime = info["prime"]
    assert prime["ok"] and 0 < prime["prompt_tokens"] < 128, prime
    first, whole = prime["returning_tokens"]
    assert 0 < first < whole and whole + 2 == 256 - 1, prime
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
    STATE["warm_cold"] = cold
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
    with _stopped(stack):
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
    comps = dict(doc["components"])
    assert comps.pop("canary") == "skipped"  # KVP_CANARY=false in this module
    assert comps == {**{k: "ok" for k in comps}, "warmup": "degraded"}
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
                    and procs.check_pid_file(pid_file, readiness.WARMUP_MARKERS).running)

        assert wait_until(warmup_started, 120, 0.05), step.poll()
        seen: list[tuple[int, dict[str, Any]]] = []
        with _stopped(stack):
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


# -- 4. tenants: vLLM's per-request cache_salt through LMCache's MP connector -------------

#: lookup counters of the cache server's /metrics, labelled model_name and cache_salt
REQUESTED = "lmcache_mp_lookup_requested_tokens_total"
FOUND = "lmcache_mp_lookup_hit_tokens_total"
EXTERNAL = "vllm:external_prefix_cache_hits_total"  # tokens vLLM loaded through the connector
LOCAL = "vllm:prefix_cache_hits_total"  # tokens vLLM found in its own prefix cache
SERVED = "vllm:request_success_total"
ROUNDS = 4


def _tenant_chat(s: Stack, messages: list[dict[str, str]], salt: str | None) -> Any:
    """One greedy streamed chat completion, with ``cache_salt`` when ``salt`` is given (the
    OpenAI request field vLLM reads). Returns its ``output`` (the generated token ids: the
    tiny model's tokens may decode to no text), ``ttft_s`` (to the first streamed event,
    which vLLM sends with the first token) and ``prompt_tokens``."""
    from types import SimpleNamespace

    body: dict[str, Any] = {"model": "cpu-demo", "messages": messages, "max_tokens": 16,
                            "temperature": 0.0, "seed": 0, "stream": True,
                            "return_token_ids": True, "stream_options": {"include_usage": True}}
    if salt is not None:
        body["cache_salt"] = salt
    if "answered" not in STATE:  # the requests vLLM answered before (all counted by now)
        STATE["answered"] = vllm_metric(s.vllm_url, SERVED)
    t0 = time.monotonic()
    ttft, ids, usage = None, [], {}
    with requests.post(f"{s.vllm_url}/v1/chat/completions", json=body, stream=True,
                       timeout=300) as resp:
        resp.raise_for_status()
        for raw in resp.iter_lines():
            if not raw.startswith(b"data: ") or raw == b"data: [DONE]":
                continue
            event = json.loads(raw[len(b"data: "):])
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                ttft = ttft if ttft is not None else time.monotonic() - t0
                ids.extend(choice.get("token_ids") or [])
    STATE["answered"] += 1
    assert ttft is not None and ids and len(ids) == usage.get("completion_tokens"), (ids, usage)
    return SimpleNamespace(output=tuple(ids), ttft_s=ttft, prompt_tokens=usage["prompt_tokens"])


def _lookups(s: Stack, salt: str) -> tuple[float, float]:
    """(tokens looked up, tokens found) the cache server counted for the namespace and
    ``salt`` ("" for requests without one) since it started."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(f"{s.http}/metrics", timeout=10).text
    got = {REQUESTED: 0.0, FOUND: 0.0}
    for fam in text_string_to_metric_families(text):
        for x in fam.samples:
            if x.name in got and x.labels.get("model_name") == STATE["ns"] \
                    and x.labels.get("cache_salt") == salt:
                got[x.name] += x.value
    return got[REQUESTED], got[FOUND]


def _looked_up(s: Stack, salt: str, before: tuple[float, float]) -> tuple[float, float]:
    """The (looked up, found) tokens of ``salt`` added since ``before``, once the server has
    counted a lookup (its counters follow the request by a moment)."""
    assert wait_until(lambda: _lookups(s, salt)[0] > before[0], 30, 0.2), (salt, before)
    now = _lookups(s, salt)
    return now[0] - before[0], now[1] - before[1]


def _salted_files(s: Stack, salt: str) -> dict[str, str]:
    """The namespace's chunk files carrying ``salt`` ("" for none): chunk hash -> name."""
    out = {}
    for p in s.chunk_files(STATE["ns"] + "_"):
        head, _, rest = p.name[:-len(".bin")].partition("@")
        if rest == salt:
            out[head.rsplit("_", 1)[1]] = p.name
    return out


def _counters(s: Stack) -> tuple[float, float]:
    """vLLM's (connector, own prefix cache) hit tokens, once its counters include every
    request answered so far (they are updated as the engine steps)."""
    answered = STATE.get("answered", 0.0)
    assert wait_until(lambda: vllm_metric(s.vllm_url, SERVED) >= answered, 30, 0.2), answered
    return vllm_metric(s.vllm_url, EXTERNAL), vllm_metric(s.vllm_url, LOCAL)


def _two_tenants(s: Stack, r: int) -> tuple[float, float, float, float]:
    """Round ``r``: tenant A (a fresh salt) sends a fresh chat; then, in an order that
    alternates with ``r``, tenant B (another salt) sends the same chat and tenant C a cold
    chat (one never sent, as long); then A again. The assertions of the test below; the
    TTFTs of (A cold, B first, C cold, A again)."""
    import secrets

    chat, cold = (long_chat(turns=6, words_per_turn=150, seed=101 + 2 * r + i) for i in (0, 1))
    salt_a, salt_b = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
    a0 = _lookups(s, salt_a)
    a1 = _tenant_chat(s, chat, salt_a)
    full = a1.prompt_tokens // 256
    assert full >= 4, a1.prompt_tokens
    assert _looked_up(s, salt_a, a0) == (full * 256, 0)  # a fresh chat: cold
    assert wait_until(lambda: len(_salted_files(s, salt_a)) >= full, 60), \
        [p.name for p in s.chunk_files()][-12:]
    stored_a = _salted_files(s, salt_a)

    b0, (ext0, loc0) = _lookups(s, salt_b), _counters(s)
    if r % 2:
        c1 = _tenant_chat(s, cold, secrets.token_urlsafe(32))
    b1 = _tenant_chat(s, chat, salt_b)
    assert b1.output == a1.output and b1.prompt_tokens == a1.prompt_tokens
    assert _looked_up(s, salt_b, b0) == (full * 256, 0)  # no cross-tenant hit
    if not r % 2:
        c1 = _tenant_chat(s, cold, secrets.token_urlsafe(32))
    assert _counters(s) == (ext0, loc0), "vLLM reused a token across tenants"
    assert wait_until(lambda: _salted_files(s, salt_b).keys() == stored_a.keys(), 60), \
        (sorted(stored_a), sorted(_salted_files(s, salt_b)))
    for chunk_hash, name in _salted_files(s, salt_b).items():
        assert name == stored_a[chunk_hash].replace(f"@{salt_a}.bin", f"@{salt_b}.bin")

    a0, (ext0, loc0) = _lookups(s, salt_a), _counters(s)
    a2 = _tenant_chat(s, chat, salt_a)
    assert a2.output == a1.output
    assert _looked_up(s, salt_a, a0) == (full * 256, full * 256)  # the same tenant hits
    assert _counters(s)[1] - loc0 >= (full - 1) * 256  # ... in vLLM's own prefix cache too
    return a1.ttft_s, b1.ttft_s, c1.ttft_s, a2.ttft_s


def test_tenants_with_different_cache_salts_share_no_chunk_and_no_time(stack: Stack) -> None:
    """Two tenants send the same long chat with different ``cache_salt`` values, over
    ``ROUNDS`` fresh chats: tenant B's first request finds nothing of A's (LMCache's lookup
    counters for B's salt: 0 tokens found; vLLM: no token from its own prefix cache nor from
    the connector), B's chunks are files of their own (the same chunk hashes as A's, each name
    ending in ``@<B's salt>``), A again finds every full chunk, the generated tokens are the
    same. B's time to first token is compared with a cold request's beside it: recorded, not
    asserted (docs/tenants.md)."""
    import statistics

    figures = [_two_tenants(stack, r) for r in range(ROUNDS)]
    medians = [round(statistics.median(col), 3) for col in zip(*figures, strict=True)]
    print("\nTTFT s (A cold, B first, C cold, A again) per round:",
          [tuple(round(t, 3) for t in f) for f in figures], "medians:", medians)


def test_a_request_without_cache_salt_and_one_with_a_salt_share_nothing(stack: Stack) -> None:
    """Requests without ``cache_salt`` are one more tenant (the empty salt): the warm set's
    chat, whose chunks the warm-up loaded into L1 unsalted, misses with a salt and stores
    salted files; a salted tenant's chat misses without a salt, stores unsalted files (no
    ``@``) and then hits unsalted. The same generated tokens every time."""
    import secrets

    salt = secrets.token_urlsafe(32)
    unsalted_warm = set(_salted_files(stack, ""))
    assert len(unsalted_warm) >= STATE["requested"]
    s0, (ext0, loc0) = _lookups(stack, salt), _counters(stack)
    warm = _tenant_chat(stack, WARM, salt)
    full = warm.prompt_tokens // 256
    assert _looked_up(stack, salt, s0) == (full * 256, 0)
    assert _counters(stack) == (ext0, loc0)
    assert wait_until(lambda: len(_salted_files(stack, salt)) >= full, 60)
    # the same chunk hashes as the unsalted files, under names of their own
    assert len(set(_salted_files(stack, salt)) & unsalted_warm) >= full

    chat = long_chat(turns=6, words_per_turn=150, seed=131)
    had = len(_salted_files(stack, salt))
    salted = _tenant_chat(stack, chat, salt)
    full = salted.prompt_tokens // 256
    assert wait_until(lambda: len(_salted_files(stack, salt)) >= had + full, 60)
    before = set(_salted_files(stack, ""))
    u0, (ext0, loc0) = _lookups(stack, ""), _counters(stack)
    plain = _tenant_chat(stack, chat, None)
    assert plain.output == salted.output
    assert _looked_up(stack, "", u0) == (full * 256, 0)  # the salted chunks are not its own
    assert _counters(stack) == (ext0, loc0)
    assert wait_until(lambda: len(set(_salted_files(stack, "")) - before) >= full, 60)
    assert (set(_salted_files(stack, "")) - before) <= set(_salted_files(stack, salt))
    u0 = _lookups(stack, "")
    again = _tenant_chat(stack, chat, None)
    assert again.output == salted.output
    assert _looked_up(stack, "", u0) == (full * 256, full * 256)
    print(f"\nTTFT s: salted cold {salted.ttft_s:.3f}, unsalted first {plain.ttft_s:.3f}, "
          f"unsalted again {again.ttft_s:.3f}")


def test_shred_destroys_the_key_first_then_every_chunk_misses_with_the_same_output(
        stack: Stack) -> None:
    ns = STATE["ns"]
    chat = long_chat(turns=6, words_per_turn=150, seed=151)
    cold = _tenant_chat(stack, chat, None)
    full = cold.prompt_tokens // 256
    assert wait_until(lambda: len(_salted_files(stack, "")) >= full, 60)
    assert requests.post(f"{stack.vllm_url}/reset_prefix_cache", timeout=30).ok
    u0 = _lookups(stack, "")
    hit = _tenant_chat(stack, chat, None)
    assert hit.output == cold.output and _looked_up(stack, "", u0) == (full * 256, full * 256)
    [key] = stack.state_dir.glob(f"keys/{ns}/l2-master.key")
    old_key, files = key.read_bytes(), stack.chunk_files(ns + "_")
    shred = ("shred", "--namespace", ns, "--config", stack.config)
    refused = stack.kvp(*shred, "--apply", "--json")  # the deployment is configured here
    assert refused.returncode == 2 and key.exists(), (refused.stdout, refused.stderr)
    dry = stack.kvp_json(*shred, "--force")
    assert dry["exit_code"] == 0 and key.read_bytes() == old_key, dry
    assert stack.chunk_files(ns + "_") == files
    stack.kvp_json("stop", stack.config, "--only", "server")
    done = stack.kvp_json(*shred, "--force", "--apply")
    assert done["exit_code"] == 0, done
    steps = done["steps"]
    assert [x["step"] for x in steps] == ["keys", "tombstone", "data"], steps
    assert steps[0]["at_ns"] <= steps[1]["at_ns"] <= steps[2]["at_ns"], steps
    assert not key.exists() and stack.chunk_files(ns + "_") == []
    info = stack.launch()  # vLLM served on: only the server starts, with a new key
    assert info["started"] == ["server"], info
    assert key.exists() and key.read_bytes() != old_key
    assert info["warmup"].get("found_chunks", 0) == 0, info["warmup"]
    assert requests.post(f"{stack.vllm_url}/reset_prefix_cache", timeout=30).ok
    u0 = _lookups(stack, "")
    again = _tenant_chat(stack, chat, None)
    assert again.output == cold.output
    assert _looked_up(stack, "", u0) == (full * 256, 0)  # nothing of it on any tier


def test_warmup_compute_missing_computes_the_warm_set_with_vllm_before_serving(
        stack: Stack) -> None:
    ns = STATE["ns"]
    plain = stack.kvp_json("warmup", stack.config)  # after the shred: nothing on any tier
    assert plain["state"] == "done" and not plain["compute"], plain
    assert plain["found_chunks"] == 0 and plain["requested_chunks"] == STATE["requested"]
    served0 = vllm_metric(stack.vllm_url, SERVED)
    doc = stack.kvp_json("warmup", stack.config, "--compute-missing")
    assert doc["state"] == "done" and doc["compute"] and doc["not_computed"] == [], doc
    assert doc["computed_chunks"] == doc["found_chunks"] == STATE["requested"], doc
    entries = [e for e in doc["entries"] if e["chunks"]]
    assert all(e["computed_chunks"] == e["chunks"] for e in entries), entries
    # one request per entry with chunks, each answered
    assert wait_until(lambda: vllm_metric(stack.vllm_url, SERVED) >= served0 + len(entries),
                      30, 0.2)
    assert vllm_metric(stack.vllm_url, SERVED) == served0 + len(entries)
    pins = json.loads((stack.root / ".kvpersist" / "pins" / f"{ns}.json").read_text())
    pinned = {f.rsplit("/", 1)[-1] for f in pins["files"]}
    assert wait_until(lambda: pinned <= {p.name for p in stack.chunk_files(ns + "_")}, 60), \
        sorted(pinned - {p.name for p in stack.chunk_files(ns + "_")})
    again = stack.kvp_json("warmup", stack.config, "--compute-missing")
    assert again["computed_chunks"] == 0 and again["found_chunks"] == STATE["requested"], again
    # the warm set's chat, not in vLLM's own prefix cache: every full chunk from the cache
    assert requests.post(f"{stack.vllm_url}/reset_prefix_cache", timeout=30).ok
    cold = STATE["warm_cold"]
    u0 = _lookups(stack, "")
    served = chat_completion(stack.vllm_url, "cpu-demo", WARM, max_tokens=24)
    full = cold.prompt_tokens // 256
    assert served.text == cold.text and served.completion_tokens == cold.completion_tokens
    assert _looked_up(stack, "", u0) == (full * 256, full * 256)
