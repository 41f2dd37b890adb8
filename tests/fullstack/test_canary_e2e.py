"""The known-answer canary on the full stack (docs/canary.md): real vLLM (CPU build) and a real
lmcache server, float32 (the output oracle), through ``kvp-admin``.

One deployment, in order:

1. ``launch``: the canary's first run makes the prompt (the deployment's chat template,
   through vLLM) and the reference (a fresh cache salt), and stores the prompt's chunks;
   a user's chat, cold.
2. ``restart --only vllm``: a new vLLM retrieves the canary from the running server (path
   ``lmcache``); ``restart --only server``: vLLM keeps serving it from its own prefix cache;
   ``restart``: a new vLLM and a new server, from L2; ``health --canary`` runs it again.
3. Another chunk's KV is encrypted under the namespace's key with a fresh IV (with
   LMCache's own key derivation and the AES-GCM of ``cryptography``: a frame LMCache itself
   could have written, as in LMCache #4492, which neither ``verify`` nor the frame record
   can tell from a chunk stored again) and put under the name of the canary's first chunk;
   ``launch``: the canary fails, the launch exits 1, vLLM is started again without the
   cache connector; the user's chat is then recomputed and equals the cold answer; health
   (1), ``canary show``, metrics and ``render`` say why; ``verify`` finds nothing; a restart
   keeps serving recomputed.
4. The operator drops the namespace's chunks (``prune --namespace --apply --force``),
   ``canary reset --apply``, launches (with a warm set): the canary passes again, a new
   reference; ``canary run --warm-sample 1`` checks the warm set's entry too.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from bench.traffic import float32_config
from kvpersist.demo.chat import chat_completion, long_chat
from kvpersist.stack.warm.chunk_keys import chunk_files, key_scheme

from ._stack import Stack, vllm_metric

pytestmark = pytest.mark.fullstack

CHAT = long_chat(turns=6, words_per_turn=150, seed=5)
HITS = "vllm:external_prefix_cache_hits_total"
STATE: dict[str, Any] = {}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("canary")
    cfg = float32_config(tmp / "cpu-demo-fp32")
    (tmp / "cache").mkdir(mode=0o700)
    s = Stack(tmp, config=str(cfg), model=demo_model)
    try:
        yield s
    finally:
        s.cleanup()


def _chat(stack: Stack) -> Any:
    return chat_completion(stack.vllm_url, "cpu-demo", CHAT, max_tokens=24)


def _canary(doc: dict[str, Any]) -> dict[str, Any]:
    c = doc["canary"]
    assert c is not None, doc
    return c


def test_first_launch_makes_the_reference_and_passes(stack: Stack) -> None:
    info = stack.launch("--no-warmup")
    STATE["ns"] = info["namespace"]
    c = _canary(info)
    assert (c["state"], c["path"], c["reference_computed"]) == ("passed", "computed", True), c
    assert c["verdict"]["max_diff"] == 0.0 and c["verdict"]["compared"] == 4
    record = json.loads((stack.state_dir / "canary" / f"{STATE['ns']}.json").read_text())
    tokens = record["prompt"]["tokens"]
    assert len(tokens) == 2 * 256 + 8 and record["state"] == "passed"
    STATE["tokens"] = tokens
    cold = _chat(stack)
    assert cold.text and vllm_metric(stack.vllm_url, HITS) == 0
    STATE["cold"] = cold.text


@pytest.mark.parametrize(("only", "path", "tier"), [
    ("vllm", "lmcache", "l1"),     # a new vLLM, the server kept running: retrieved from it
    ("server", "vllm", "l2"),      # vLLM kept running: its own prefix cache holds the canary
])
def test_restart_of_one_process_passes(stack: Stack, only: str, path: str, tier: str) -> None:
    doc = stack.kvp_json("restart", stack.config, "--only", only, "--no-warmup")
    c = _canary(doc["launch"])
    assert (c["state"], c["path"], c["tier"], c["reference_computed"]) == \
        ("passed", path, tier, False), c
    assert c["verdict"]["max_diff"] == 0.0


def test_restart_of_both_retrieves_the_canary_from_l2_and_passes(stack: Stack) -> None:
    doc = stack.kvp_json("restart", stack.config, "--no-warmup")
    c = _canary(doc["launch"])
    assert (c["state"], c["path"], c["tier"]) == ("passed", "lmcache", "l2"), c
    h = stack.kvp("health", stack.config, "--canary", "--json")
    assert h.returncode == 0, h.stdout
    health = json.loads(h.stdout)
    assert health["canary"]["run"]["state"] == "passed"
    assert {c["name"]: c["status"] for c in health["checks"]}["canary"] == "ok"
    stack.stop()
    # the reference was stored under its one-time salt (docs/canary.md, "What it stores"):
    # KVP_CANARY_CHUNKS files, once; no later run recomputed it
    salted = [p.name for p in stack.chunk_files(STATE["ns"]) if "@kvp-canary-" in p.name]
    assert len(salted) == 2 and len({n.rsplit("@", 1)[1] for n in salted}) == 1, salted


def test_a_planted_wrong_chunk_fails_the_canary_and_the_namespace_is_recomputed(
        stack: Stack) -> None:
    ns = STATE["ns"]
    scheme = key_scheme(stack.render()["lmcache_server_argv"])
    canary_files, _ = chunk_files(scheme, ns, 1, STATE["tokens"])
    target = stack.root / canary_files[0]
    donor = next(p for p in stack.chunk_files(ns) if p.name not in canary_files)
    master = (stack.state_dir / "keys" / ns / "l2-master.key").read_bytes()
    reframe(donor, target, master)
    STATE["planted"] = (target.name, donor.name)

    r = stack.kvp("launch", stack.config, "--no-warmup", "--json")
    assert r.returncode == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    c = _canary(doc)
    assert (c["state"], c["path"], c["tier"]) == ("failed", "lmcache", "l2"), c
    assert "the canary failed" in r.stderr and doc["recompute"]
    assert doc["warmup"]["state"] == "skipped"
    # vLLM runs again, without the connector: the user's chat is recomputed, as cold
    again = _chat(stack)
    assert again.text == STATE["cold"]
    assert vllm_metric(stack.vllm_url, HITS) == 0
    assert "--kv-transfer-config" not in psutil.Process(doc["vllm"]["pid"]).cmdline()
    h = stack.kvp("health", stack.config, "--json")
    assert h.returncode == 1, h.stdout
    check = {c["name"]: c for c in json.loads(h.stdout)["checks"]}["canary"]
    assert check["status"] == "degraded" and "the canary failed" in check["detail"]
    show = stack.kvp("canary", "show", stack.config, "--json")
    assert show.returncode == 1 and json.loads(show.stdout)["state"] == "failed"
    metrics = stack.kvp("metrics", stack.config).stdout.splitlines()
    assert [line.rsplit(" ", 1)[1] for line in metrics
            if line.startswith("kvpersist_canary_state{")] == ["2.0"], metrics
    assert stack.render()["recompute"]
    report = stack.kvp_json("report", "--config", stack.config)
    [row] = [r for r in report["namespaces"] if r["namespace"] == ns]
    assert row["canary"]["state"] == "failed" and row["canary"]["failed_at"] == c["at"]
    # the namespace's files are kept (nothing deleted automatically)
    assert target.exists() and (stack.root / donor.name).exists()
    # a restart keeps the namespace recomputed until the reset
    doc = stack.kvp_json("restart", stack.config, "--only", "vllm", "--no-warmup")
    assert doc["launch"]["recompute"] and doc["launch"]["canary"] is None
    assert _chat(stack).text == STATE["cold"]


def test_the_namespace_dropped_and_reset_passes_again(stack: Stack) -> None:
    # verify sees nothing wrong: the planted frame authenticates and is no copy
    v = stack.kvp_json("verify", stack.config, check=False)
    assert STATE["planted"][0] not in {Path(f["path"]).name for f in v["findings"]}
    stack.stop()
    stack.kvp_json("prune", "--config", stack.config, "--namespace", STATE["ns"], "--apply",
                   "--force")
    assert not (stack.root / STATE["planted"][0]).exists()
    dry = stack.kvp_json("canary", "reset", stack.config)
    assert dry["applied"] is False and dry["was"]["state"] == "failed"
    assert stack.render()["recompute"]
    stack.kvp_json("canary", "reset", stack.config, "--apply")
    assert not stack.render()["recompute"]
    warm = stack.tmp / "warm.jsonl"
    warm.write_text(json.dumps({"messages": CHAT[:-1]}) + "\n")
    stack.env["KVP_WARMUP_FILE"] = str(warm)
    doc = stack.launch()  # with the warm-up: it caches the warm set's token ids
    c = _canary(doc)
    assert c["state"] == "passed" and c["reference_computed"] and not doc["recompute"]
    assert doc["warmup"]["state"] == "done", doc["warmup"]
    assert _chat(stack).text == STATE["cold"]
    # the warm set's entry, served (from vLLM's prefix cache or the server) and recomputed
    # under a fresh salt: within float32's tolerance (a prefix hit's attention is not the
    # full prefill's to the last bit: 9.5e-7 seen here)
    run = stack.kvp_json("canary", "run", stack.config, "--warm-sample", "1")
    assert run["state"] == "passed" and run["warm_sample"]["state"] == "passed", run
    [entry] = run["warm_sample"]["entries"]
    assert entry["entry"] == 0 and entry["max_diff"] <= 1e-3, entry
    assert entry["path"] != "computed", entry
    stack.stop()


def reframe(donor: Path, target: Path, master: bytes) -> None:
    """Put ``donor``'s KV under ``target``'s name as a new aesgcm frame (a fresh IV), the way
    LMCache's serde writes one: ``[1][iv][AES-GCM(key, iv, kv)]`` padded to 4 KiB, the key
    derived from the master key by LMCache's own HKDF key provider (no cache salt)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    from lmcache.v1.distributed.serde.key_provider import HkdfKeyProvider

    from kvpersist.l2.frames import decrypt

    key = HkdfKeyProvider(master, 16, b"lmcache-l2-aesgcm-v1").get_key("")
    kv = decrypt(donor.read_bytes(), key, None)
    assert kv is not None, "the donor does not authenticate"
    iv = os.urandom(12)
    frame = b"\x01" + iv + AESGCM(key).encrypt(iv, kv, None)
    tmp = target.with_name("planted~")
    tmp.write_bytes(frame + b"\0" * (-len(frame) % 4096))
    tmp.rename(target)
