"""The warm set against real vLLM (CPU build) + a real lmcache server: the chunk files vLLM's
own server stores for the warm set's requests are exactly the pins ``kvp-admin warmup``
computed (so its token ids are vLLM's), and after restarting both every chunk is found on
disk and loaded into L1 before the first request."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests

from kvpersist.demo.chat import chat_completion

from ._stack import Stack, vllm_metric

pytestmark = pytest.mark.fullstack

SYSTEM = ("You are the operations assistant of a team that runs vLLM with a persistent KV "
          "cache on local NVMe. Answer precisely and name the document section you rely on. "
          * 10)
DOCUMENT = ("Shared handbook, chapter one: the namespace separates every deployment's chunk "
            "files; chapter two: the budget keeps the disk below its limit. " * 12)
MESSAGES = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": "Read the handbook first."}]


def test_vllm_stores_exactly_the_pinned_files_and_warmup_loads_them(tmp_path: Path,
                                                                    demo_model: Path) -> None:
    wf = tmp_path / "warm.jsonl"
    wf.write_text(json.dumps({"messages": MESSAGES}) + "\n"
                  + json.dumps({"prompt": DOCUMENT}) + "\n")
    s = Stack(tmp_path, model=demo_model, KVP_WARMUP_FILE=str(wf))
    try:
        ns = s.launch()["namespace"]
        # vLLM has registered its layout: an empty L2 is 0 found, exit 0
        r = s.kvp("warmup", s.config, "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        requested = out["requested_chunks"]
        assert requested >= 3 and out["found_chunks"] == 0
        pins = json.loads((s.root / ".kvpersist" / "pins" / f"{ns}.json").read_text())

        # the sessions' first requests, sent to vLLM's own OpenAI server
        chat_completion(s.vllm_url, "cpu-demo", MESSAGES, max_tokens=1)
        resp = requests.post(f"{s.vllm_url}/v1/completions", timeout=300, json={
            "model": "cpu-demo", "prompt": DOCUMENT, "max_tokens": 1, "temperature": 0.0})
        resp.raise_for_status()
        s.stop()
        assert {f.name for f in s.chunk_files(ns + "_")} == set(pins["files"])

        s.launch()
        r = s.kvp("warmup", s.config, "--json")
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert (out["found_chunks"], out["requested_chunks"]) == (requested, requested)
        assert out["tokens_cached"] and out["pins"]["reused"]
        log = s.server_log.read_text(errors="replace")
        loads = [int(n) for n in re.findall(r"Warm prefetch \w+ completed: (\d+)/\1 keys", log)]
        assert sum(loads) == requested, log[-3000:]
        # the session itself now hits what the warm-up loaded
        chat_completion(s.vllm_url, "cpu-demo", MESSAGES, max_tokens=1)
        assert vllm_metric(s.vllm_url, "vllm:external_prefix_cache_hits_total") >= 256
    finally:
        s.cleanup()
