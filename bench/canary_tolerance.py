"""The canary's tolerance: vLLM's own spread of greedy logprobs on this stack, against what a
chunk of wrong KV does to them (docs/benchmarks.md "Canary tolerance").

For each KV dtype (bfloat16: configs/cpu-demo; float32: its float32 copy), one relocated
deployment on the demo's tiny generated model, vLLM's CPU build and a real lmcache server,
all through ``kvp-admin``; ``PROMPTS`` prompts of two full chunks and a tail (random token
ids, seeded), each asked for ``STEPS`` greedy tokens with the top ``TOP`` logprobs through the
canary's own request (``kvpersist.stack.canary.probe.ask``):

* ``recompute``: the same prompt under two fresh cache salts in one vLLM process (nothing
  cached: two full computations);
* ``vllm_prefix``: unsalted, the second time (vLLM's own prefix cache);
* ``lmcache_l1``: after ``restart --only vllm`` (a new vLLM; the cache server kept L1);
* ``lmcache_l2``: after a restart of both (a new vLLM and server: from the NVMe);
* ``recompute_new_process``: a fresh salt in that last process against the first reference;
* ``vllm_prefix_under_load``, ``recompute_under_load``: the same, unsalted and under a fresh
  salt, while ``LOAD_WORKERS`` threads keep other requests in flight (vLLM batches them
  together: in bfloat16 batching is what moves vLLM's answers);
* ``wrong_kv``: after a stop, each prompt's chunk files replaced by another prompt's
  (frames that authenticate, under the namespace's key, holding other tokens' KV), launch.

Every category is compared with the reference (the first salted run) by
``kvpersist.stack.canary.verdict``'s measure: the largest |logprob difference| over the
tokens in both top lists at each step, and the steps whose greedy token differs.

usage: python bench/canary_tolerance.py [--out FILE] [--dtype bfloat16|float32 ...]
(about 4 minutes per dtype on 2 cores). Prints and writes one JSON document.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.traffic import float32_config  # noqa: E402
from kvpersist.demo.model import generate_model  # noqa: E402
from kvpersist.stack.canary.probe import Asked, ask  # noqa: E402
from kvpersist.stack.canary.verdict import Step  # noqa: E402
from kvpersist.stack.warm.chunk_keys import chunk_files, key_scheme  # noqa: E402
from kvpersist.system.vllm_client import VllmClient  # noqa: E402
from tests.fullstack._stack import Stack  # noqa: E402

PROMPTS = 8
#: concurrent requests of other prompts while the ``*_under_load`` categories run
LOAD_WORKERS = 3
CHUNK = 256
TAIL = 8
VOCAB = (100, 8000)


def diff(ref: tuple[Step, ...], obs: tuple[Step, ...]) -> dict[str, Any]:
    """How far ``obs`` is from ``ref``: the largest |logprob difference| over the tokens in
    both top lists (steps up to the first greedy mismatch), a lower bound of it where the
    reference's token is missing from the served top list (its served logprob is then at most
    the smallest one listed), whether that happened, how many of the top tokens at step 0
    the two share, the mismatching step and the reference's lead at step 0."""
    worst, bound, absent, mismatches = 0.0, 0.0, False, []
    overlap = len(set(ref[0].top) & set(obs[0].top)) if ref and obs else 0
    for i, (r, o) in enumerate(zip(ref, obs, strict=False)):
        shared = set(r.top) & set(o.top)
        if shared:
            worst = max(worst, max(abs(r.top[t] - o.top[t]) for t in shared))
        if r.token not in o.top:
            absent = True
            bound = max(bound, r.top[r.token] - min(o.top.values()))
        if r.token != o.token:
            mismatches.append(i)
            break  # later steps continue other texts
    values = sorted(ref[0].top.values())
    return {"max_diff": max(worst, bound), "ref_token_absent": absent, "overlap0": overlap,
            "mismatch_steps": mismatches, "ref_margin0": values[-1] - values[-2]}


def run(dtype: str, tmp: Path, model: Path) -> dict[str, Any]:
    config = "cpu-demo" if dtype == "bfloat16" else str(float32_config(tmp / "cfg"))
    (tmp / "dep" / "cache").mkdir(parents=True, mode=0o700)
    s = Stack(tmp / "dep", config=config, model=model)
    rng = random.Random(7)
    prompts = [[rng.randrange(*VOCAB) for _ in range(2 * CHUNK + TAIL)] for _ in range(PROMPTS)]
    out: dict[str, Any] = {"dtype": dtype, "prompts": PROMPTS}
    cats: dict[str, list[dict[str, Any]]] = {}
    paths: dict[str, list[dict[str, Any]]] = {}

    def client() -> VllmClient:
        return VllmClient(s.vllm_url, 120.0)

    def one(cat: str, p: list[int], ref: tuple[Step, ...], salt: str = "") -> Asked:
        a = ask(client(), "cpu-demo", p, salt=salt)
        cats.setdefault(cat, []).append(diff(ref, a.steps))
        paths.setdefault(cat, []).append(a.to_dict())
        return a

    try:
        ns = s.launch("--no-warmup")["namespace"]
        refs = []
        for p in prompts:
            r = ask(client(), "cpu-demo", p, salt=uuid.uuid4().hex)
            refs.append(r.steps)
            one("recompute", p, r.steps, salt=uuid.uuid4().hex)
            one("stored", p, r.steps)
            one("vllm_prefix", p, r.steps)
        s.kvp_json("restart", s.config, "--only", "vllm", "--no-warmup")
        for p, r in zip(prompts, refs, strict=True):
            one("lmcache_l1", p, r)
        s.stop()
        s.launch("--no-warmup")
        for p, r in zip(prompts, refs, strict=True):
            one("lmcache_l2", p, r)
            one("recompute_new_process", p, r, salt=uuid.uuid4().hex)
        with _load(s.vllm_url, LOAD_WORKERS):
            for p, r in zip(prompts, refs, strict=True):
                one("vllm_prefix_under_load", p, r)
                one("recompute_under_load", p, r, salt=uuid.uuid4().hex)
        s.stop()
        render = s.render()
        scheme = key_scheme(render["lmcache_server_argv"])
        names = [chunk_files(scheme, ns, 1, p)[0] for p in prompts]
        originals = {}
        for i, files in enumerate(names):  # prompt i gets prompt i+1's chunks
            donor = names[(i + 1) % len(names)]
            for target in [*files, *donor]:
                originals[target] = (s.root / target).read_bytes()
        for i, files in enumerate(names):
            donor = names[(i + 1) % len(names)]
            for target, src in zip(files, donor, strict=True):
                planted = s.root / (target + ".planted~")
                planted.write_bytes(originals[src])
                planted.rename(s.root / target)
        s.launch("--no-warmup", "--no-canary") if _has_no_canary(s) else s.launch("--no-warmup")
        for p, r in zip(prompts, refs, strict=True):
            one("wrong_kv", p, r)
        s.stop()
    finally:
        s.cleanup()
    out["categories"] = {
        k: {"max_diff": max(d["max_diff"] for d in v),
            "min_max_diff": min(d["max_diff"] for d in v),
            "greedy_mismatches": sum(1 for d in v if d["mismatch_steps"]),
            "ref_token_absent": sum(1 for d in v if d["ref_token_absent"]),
            "top_overlap_step0": [min(d["overlap0"] for d in v),
                                  max(d["overlap0"] for d in v)],
            "runs": len(v),
            "lmcache_extra_tokens": sorted({p["lmcache_extra"] for p in paths[k]}),
            "vllm_cached_tokens": sorted({p["vllm_cached"] for p in paths[k]})}
        for k, v in cats.items()}
    out["ref_margin0_min"] = min(d["ref_margin0"] for d in cats["recompute"])
    return out


@contextlib.contextmanager
def _load(url: str, workers: int) -> Iterator[None]:
    """``workers`` threads sending other prompts (1,000 random tokens, 16 greedy tokens)
    back to back until the block ends: vLLM batches the canary's requests with them."""
    stop = threading.Event()

    def work(seed: int) -> None:
        rng = random.Random(seed)
        client = VllmClient(url, 300.0)
        while not stop.is_set():
            body = {"model": "cpu-demo", "max_tokens": 16, "temperature": 0.0,
                    "prompt": [rng.randrange(*VOCAB) for _ in range(1000)]}
            client.completions(body)

    threads = [threading.Thread(target=work, args=(100 + i,), daemon=True)
               for i in range(workers)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=300)


def _has_no_canary(s: Stack) -> bool:
    return "--no-canary" in s.kvp("launch", "--help").stdout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--dtype", action="append", choices=("bfloat16", "float32"))
    a = ap.parse_args()
    doc: dict[str, Any] = {"schema": "kvpersist.bench.canary-tolerance/1", "runs": []}
    with tempfile.TemporaryDirectory(prefix="kvp-canary-tol-") as tmp:
        model = generate_model("tiny", Path(tmp) / "models" / "tiny")
        for dtype in a.dtype or ["bfloat16", "float32"]:
            d = Path(tmp) / dtype
            d.mkdir()
            doc["runs"].append(run(dtype, d, model))
            shutil.rmtree(d / "dep", ignore_errors=True)
            print(json.dumps(doc["runs"][-1], indent=1), flush=True)
    text = json.dumps(doc, indent=1)
    if a.out:
        a.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
