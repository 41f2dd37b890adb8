"""Persistence proven end to end: real vLLM (CPU build) + real lmcache server, through
``kvp-admin launch``/``stop``, on a generated tiny Llama (greedy decoding).

The tests run in file order and share one cache root: the cold run's files are what the
later tests hit, corrupt and separate by namespace. Between the cold run and the restart,
other weights at the same ``KVP_MODEL_PATH`` are refused by every way of starting the
namespace (no vLLM: each is refused before any process starts); the restart after the
original weights are restored is the one that hits from disk. vLLM starts 7 times in all.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from kvpersist.demo.chat import chat_completion, long_chat

from ..conftest import REPO
from ..integration._prometheus import monitoring, short_for_rules
from ._stack import Stack, l2_hits_in_log, vllm_metric, wait_until
from ._weights import refuse_changed_weights

pytestmark = pytest.mark.fullstack

CHAT = long_chat(turns=8, words_per_turn=150, seed=11)
HITS = "vllm:external_prefix_cache_hits_total"
#: the alert "cache server down while vLLM serves" (monitoring/kvpersist-rules.yml)
DEGRADED = "KvpersistCacheServerDown"
STATE: dict[str, Any] = {}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[Stack]:
    """The deployment, serving a copy of the demo model's hub cache (the weights test swaps
    the weights at its ``KVP_MODEL_PATH``; the session's demo model stays as it is)."""
    tmp = tmp_path_factory.mktemp("e2e")
    hub = demo_model.parents[2]  # <hub>/models--ORG--NAME/snapshots/<revision>
    shutil.copytree(hub, tmp / "hub", symlinks=True)
    s = Stack(tmp, model=tmp / "hub" / demo_model.relative_to(hub))
    try:
        yield s
    finally:
        s.cleanup()


def _chat(stack: Stack) -> Any:
    return chat_completion(stack.vllm_url, "cpu-demo", CHAT, max_tokens=24)


def test_cold_run_serves_and_stores_every_full_chunk(stack: Stack) -> None:
    info = stack.launch()
    ns = info["namespace"]
    # the canary's first run in bfloat16 (docs/canary.md): prompt and reference made, passed
    assert (info["canary"]["state"], info["canary"]["path"]) == ("passed", "computed")
    STATE["ns"] = ns
    cold = _chat(stack)
    assert cold.prompt_tokens and cold.prompt_tokens > 5 * 256, cold
    assert cold.text
    assert vllm_metric(stack.vllm_url, HITS) == 0
    h = stack.kvp("health", stack.config, "--json")
    assert h.returncode == 0, h.stdout
    stack.stop()
    files = stack.chunk_files(ns + "_01000100_")
    full_chunks = cold.prompt_tokens // 256
    assert len(files) >= full_chunks, [f.name for f in stack.chunk_files()]
    STATE["cold"] = cold.text
    STATE["cold_ttft"] = cold.ttft_s
    STATE["prompt_tokens"] = cold.prompt_tokens
    STATE["files"] = sorted(f.name for f in files)


def test_changed_weights_refused_before_anything_starts_then_restored(
        stack: Stack, monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first launch, other weights at the same ``KVP_MODEL_PATH`` are refused by
    every way of starting the namespace, before anything starts and without reading or
    deleting anything under the cache root; the original weights are then restored (the
    next test launches them and hits as before)."""
    refuse_changed_weights(stack, STATE["ns"], STATE["prompt_tokens"], monkeypatch)


def test_restart_both_hits_from_disk_with_identical_output(stack: Stack) -> None:
    manifest_file = stack.state_dir / "manifests" / f"{STATE['ns']}.json"
    record = json.loads(manifest_file.read_text())["weights"]
    full_chunks = STATE["prompt_tokens"] // 256
    info = stack.launch()
    # bfloat16: the new vLLM retrieves the canary from L2 through the new server, and passes
    assert (info["canary"]["state"], info["canary"]["path"], info["canary"]["tier"]) == \
        ("passed", "lmcache", "l2"), info["canary"]
    warm = _chat(stack)
    assert warm.text == STATE["cold"]
    hits = vllm_metric(stack.vllm_url, HITS)
    assert hits >= full_chunks * 256, hits
    assert max(l2_hits_in_log(stack.server_log)) >= full_chunks
    STATE["ttft"] = (STATE["cold_ttft"], warm.ttft_s)
    stack.stop()
    assert json.loads(manifest_file.read_text())["weights"] == record



def test_restart_with_a_warm_set_serves_the_first_request_from_l1(stack: Stack) -> None:
    """Issue 13's warm restart: a warm set holding the chat's opening (every message but the
    final question); after a restart of both, ``launch`` loads its chunks from the NVMe into
    L1 (the server logs the warm prefetch) and then once from L1 into vLLM (the warm-up's
    load: the first load into a fresh vLLM is the slow one) before it returns, storing
    nothing; the first request then finds the opening in vLLM's own prefix cache, reads
    nothing from L2, with the same output. TTFTs are recorded, not asserted (the ratios are
    in docs/benchmarks.md, "Warm restart" and "Restart downtime")."""
    from ._stack import vllm_metric

    warm = stack.tmp / "warm.jsonl"
    warm.write_text(json.dumps({"messages": CHAT[:-1]}) + "\n")
    stack.stop()
    stack.env["KVP_WARMUP_FILE"] = str(warm)
    try:
        files = {p.name for p in stack.chunk_files()}
        boot = stack.server_log.stat().st_size
        info = stack.launch()
        w = info["warmup"]
        full_chunks = len(STATE["files"])
        assert w["state"] == "done", w
        assert w["found_chunks"] == w["requested_chunks"] >= full_chunks - 1, w
        text = _log_since(stack.server_log, boot)
        loads = [int(n) for n in re.findall(r"Warm prefetch \w+ completed: (\d+)/\1 keys",
                                            text)]
        assert sum(loads) == w["requested_chunks"], text[-3000:]
        # the warm-up's load: vLLM looked the opening up and loaded every chunk from L1
        record = json.loads((stack.state_dir / "warmup.json").read_text())
        assert [(x["line"], x["chunks"], x["ok"]) for x in record["loads"]] == \
            [(1, w["requested_chunks"], True)], record
        looked_up = re.findall(r"retained keys \((\d+) L1, (\d+) L2\)[^\n]*"
                               r"external_request_id=[^,\s)]+", text)
        assert [(int(a), int(b)) for a, b in looked_up if int(a) + int(b)] == \
            [(w["requested_chunks"], 0)], text[-3000:]
        assert re.search(r"Retrieved \d+ tokens", text), text[-3000:]
        assert {p.name for p in stack.chunk_files()} == files  # the load stored nothing
        pins = json.loads((stack.root / ".kvpersist" / "pins" / f"{STATE['ns']}.json")
                          .read_text())
        pinned = {f.rsplit("/", 1)[-1] for f in pins["files"]}
        assert pinned and pinned <= set(STATE["files"]), (pinned, STATE["files"])
        before = stack.server_log.stat().st_size
        hits = vllm_metric(stack.vllm_url, "vllm:prefix_cache_hits_total")
        out = _chat(stack)
        assert out.text == STATE["cold"]
        reused = vllm_metric(stack.vllm_url, "vllm:prefix_cache_hits_total") - hits
        assert reused >= (w["requested_chunks"] - 1) * 256, reused
        served = re.findall(r"retained keys \((\d+) L1, (\d+) L2\)",
                            _log_since(stack.server_log, before))
        assert sum(int(b) for _, b in served) == 0, served  # nothing from L2
        STATE["ttft"] = (*STATE["ttft"], out.ttft_s)
    finally:
        stack.env.pop("KVP_WARMUP_FILE")


def _log_since(log: Path, offset: int) -> str:
    with log.open("rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")

def test_cache_server_down_vllm_keeps_serving_and_health_degraded(stack: Stack) -> None:
    """...and the degraded alert of monitoring/kvpersist-rules.yml (its ``for:`` cut to 2 s)
    fires in a real Prometheus fed by ``kvp-admin metrics`` through node_exporter, only once
    the cache server is down while vLLM serves."""
    ns = STATE["ns"]
    rules = short_for_rules(stack.tmp / "rules.yml", for_="2s")
    with monitoring(stack.tmp / "mon", rules=rules) as mon:
        def export() -> None:
            r = stack.kvp("metrics", stack.config, "--textfile", str(mon.textfile_dir),
                          timeout=120)
            assert r.returncode == 0, r.stderr

        series = f'{{config="{stack.config}",namespace="{ns}"}}'
        export()
        mon.wait_value(f"kvpersist_vllm_up{series}", lambda v: v == 1)
        assert mon.values(f"kvpersist_cache_server_up{series}") == [1]
        # evaluated on both up for longer than its `for:`, the alert is inactive
        seen_up = time.time()
        assert wait_until(lambda: mon.alert_rule(DEGRADED)["last_evaluation_s"]
                          > seen_up + 3, 15, 0.25)
        rule = mon.alert_rule(DEGRADED)
        assert rule["health"] == "ok" and rule["state"] == "inactive", rule
        assert mon.query(f'ALERTS{{alertname="{DEGRADED}"}}') == []

        st = stack.kvp_json("status", stack.config)
        pid = st["lmcache"]["pid"]
        os.kill(pid, signal.SIGKILL)
        assert wait_until(lambda: not psutil.pid_exists(pid)
                          or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 20)
        out = _chat(stack)
        assert out.text == STATE["cold"]
        h = stack.kvp("health", stack.config, "--json")
        report = json.loads(h.stdout)
        assert h.returncode == 1 and report["status"] == "degraded", report
        assert any(c["name"] == "vllm.persistence" and c["status"] == "degraded"
                   for c in report["checks"])

        export()
        firing = mon.wait_for(f'ALERTS{{alertname="{DEGRADED}",alertstate="firing"}}',
                              lambda r: len(r) == 1, timeout=30, what=f"{DEGRADED} firing")
        labels = firing[0]["metric"]
        assert (labels["config"], labels["namespace"]) == (stack.config, ns), labels
        assert labels["severity"] == "critical", labels
        assert mon.values(f"kvpersist_cache_server_up{series}") == [0]
        assert mon.values(f"kvpersist_vllm_up{series}") == [1]
        assert mon.values(f"kvpersist_deployment_health{series}") == [1]
    stopped = stack.stop()
    how = {s["what"]: s["how"] for s in stopped["stopped"]}
    assert how == {"vLLM": "terminated", "lmcache server": "stale"}, stopped


def test_kv_persist_hook_on_a_sample_recipe(stack: Stack) -> None:
    recipe = REPO / "scripts" / "examples" / "recipe-vllm-cpu.sh"
    import sys

    port = stack.env["KVP_VLLM_PORT"]
    model = stack.env["KVP_MODEL_PATH"]
    base_env = dict(stack.env, MODEL_DIR=model, PORT=port, PYTHON=sys.executable,
                    PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                    RECIPE_DRY_RUN="1")
    plain = subprocess.run(["bash", str(recipe)], env=base_env, capture_output=True,
                           check=True)
    assert plain.stdout.split(b"\0")[:-1] == [
        sys.executable.encode(), b"-m", b"vllm.entrypoints.openai.api_server",
        b"--model", model.encode(), b"--host", b"127.0.0.1", b"--port",
        port.encode(), b"--dtype", b"bfloat16", b"--enforce-eager", b"--max-model-len",
        b"4096", b"--block-size", b"128"]
    assert not stack.pid_file.exists()  # without KV_PERSIST nothing was started

    env = dict(base_env, KV_PERSIST="1", KVP_CONFIG=stack.config)
    env.pop("RECIPE_DRY_RUN")
    log = (stack.tmp / "recipe.log").open("wb")
    proc = subprocess.Popen(["bash", str(recipe)], env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        ok = wait_until(lambda: _ready(stack) or proc.poll() is not None, 600, 2)
        assert ok and proc.poll() is None, (stack.tmp / "recipe.log").read_text()[-3000:]
        # the hook's readiness step primes vLLM once it serves (no warm set here): ready
        warmup_log = stack.state_dir / "logs" / "warmup.log"
        assert wait_until(lambda: warmup_log.exists() and "vLLM primed by one short request"
                          in warmup_log.read_text(), 120, 0.5), \
            warmup_log.read_text() if warmup_log.exists() else "no warm-up log"
        out = _chat(stack)
        assert out.text == STATE["cold"]
        assert vllm_metric(stack.vllm_url, HITS) >= 5 * 256
        assert stack.pid_file.exists()  # the hook launched the cache server
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        stack.stop()


def _ready(stack: Stack) -> bool:
    import requests

    try:
        return requests.get(f"{stack.vllm_url}/v1/models", timeout=2).status_code == 200
    except requests.RequestException:
        return False


def test_corrupt_and_truncated_files_are_misses_and_output_stays_correct(stack: Stack) -> None:
    ns = STATE["ns"]
    files = stack.chunk_files(ns + "_01000100_")
    assert len(files) >= 5
    for f in files[:-1]:
        size = f.stat().st_size
        f.write_bytes(os.urandom(size))  # same size, random bytes
    files[-1].write_bytes(files[-1].read_bytes()[:10_000])  # truncated
    v = stack.kvp("verify", stack.config, "--json")
    found = json.loads(v.stdout)
    assert v.returncode == 1
    kinds = sorted(f["kind"] for f in found["findings"])
    assert kinds.count("auth") == len(files) - 1 and kinds.count("size") == 1, kinds

    stack.launch()
    out = _chat(stack)
    assert out.text == STATE["cold"]  # never wrong output
    assert vllm_metric(stack.vllm_url, HITS) == 0  # the damaged chunks were misses
    log = stack.server_log.read_text(errors="replace")
    assert "DESERIALIZE failed" in log or "failed" in log.lower()

    # online quarantine frees the deterministic names. The chunks are still in L1 (the
    # corrupt run stored them there; L2 skipped them since their files existed), so they
    # are written afresh once they leave L1: here, after a restart.
    a = stack.kvp("verify", stack.config, "--apply", "--json")
    assert a.returncode == 0, a.stdout
    assert len(json.loads(a.stdout)["quarantined"]) == len(files)
    stack.stop()
    stack.launch()
    again = _chat(stack)
    assert again.text == STATE["cold"]
    assert vllm_metric(stack.vllm_url, HITS) == 0  # quarantined: recomputed, stored afresh
    assert wait_until(lambda: len(stack.chunk_files(ns + "_01000100_")) >= len(files), 30)
    stack.stop()
    clean = stack.kvp("verify", stack.config, "--json")
    assert clean.returncode == 0, clean.stdout
    assert json.loads(clean.stdout)["authenticated"] >= len(files)


def _variant(stack: Stack, name: str, key: str, value: str) -> Stack:
    """The stack's deployment with one identity field changed (a config of its own)."""
    src = (REPO / "configs" / "cpu-demo" / "identity.env").read_text()
    lines = [ln if not ln.startswith(f"{key}=") else f"{key}={value}"
             for ln in src.splitlines()]
    other = stack.tmp / name
    other.mkdir()
    (other / "identity.env").write_text("\n".join(lines) + "\n")
    s2 = Stack.__new__(Stack)
    s2.__dict__.update(stack.__dict__)
    s2.config = str(other / "identity.env")
    return s2


def test_identity_that_does_not_describe_the_weights_is_refused(stack: Stack) -> None:
    """The weights at KVP_MODEL_PATH are a hub snapshot of revision b2e24ec…: another
    revision in the config is refused before anything starts."""
    s2 = _variant(stack, "cpu-demo-rev2", "KVP_MODEL_REVISION", "f" * 40)
    r = s2.kvp("launch", s2.config)
    assert r.returncode == 2, r.stderr
    assert "At 'KVP_MODEL_REVISION': config says " + "f" * 40 in r.stderr
    assert not (s2.state_dir / "pids" / "cpu-demo-rev2.lmcache.pid").exists()


def test_changed_identity_field_gets_no_hit(stack: Stack) -> None:
    s2 = _variant(stack, "cpu-demo-len", "KVP_MAX_MODEL_LEN", "4000")
    info = s2.launch()
    ns2 = info["namespace"]
    assert ns2 != STATE["ns"]
    try:
        out = _chat(s2)
        assert out.text == STATE["cold"]  # same weights, so same output, but computed
        assert vllm_metric(s2.vllm_url, HITS) == 0
    finally:
        s2.stop()
    assert s2.chunk_files(ns2 + "_")  # its own files
    assert stack.chunk_files(STATE["ns"] + "_")  # the first namespace's files untouched
