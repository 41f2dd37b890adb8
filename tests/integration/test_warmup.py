"""``kvp-admin warmup`` against a real ``lmcache server`` started by ``kvp-admin launch``.

The KV layout is registered and chunks are stored by LMCache's own MP client stack on CPU
tensors (``kvpersist.demo.kvdriver``: what vLLM's workers send, under the deployment's
namespace, two TP ranks); the warm set is tokenized by vLLM's own renderer on the generated
tiny demo model. Nothing is mocked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvpersist.demo.kvdriver import connect

from ..conftest import REPO
from ..fullstack._stack import Stack

pytestmark = pytest.mark.integration

SYSTEM = ("You are the operations assistant of a team that runs vLLM with a persistent KV "
          "cache on local NVMe. Answer precisely and name the document section you rely on. "
          * 12)
DOCUMENT = ("Shared handbook, chapter one: the namespace separates every deployment's chunk "
            "files; chapter two: the budget keeps the disk below its limit. " * 14)


def warm_lines() -> list[dict[str, Any]]:
    return [
        {"messages": [{"role": "system", "content": SYSTEM},
                      {"role": "user", "content": "Read the handbook first."}]},
        {"prompt": DOCUMENT},
        {"messages": [{"role": "user", "content": "Hi"}]},  # under one chunk: a noop
    ]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpersist.demo.model import generate_model

    return generate_model("tiny", tmp_path_factory.mktemp("models") / "tiny")


def tp2_config(tmp: Path, *, template_sha: str | None = None) -> Path:
    """configs/cpu-demo with TP 2 (a namespace of its own), optionally another digest."""
    text = (REPO / "configs" / "cpu-demo" / "identity.env").read_text()
    text = text.replace("KVP_TENSOR_PARALLEL_SIZE=1\n", "KVP_TENSOR_PARALLEL_SIZE=2\n")
    if template_sha is not None:
        text = re.sub(r"KVP_CHAT_TEMPLATE_SHA256=[0-9a-f]+\n",
                      f"KVP_CHAT_TEMPLATE_SHA256={template_sha}\n", text)
    path = tmp / "cfg" / "identity.env"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def warm(tmp_path: Path, model: Path) -> Iterator[Stack]:
    wf = tmp_path / "warm.jsonl"
    wf.write_text("\n".join(json.dumps(x) for x in warm_lines()) + "\n")
    s = Stack(tmp_path, config=str(tp2_config(tmp_path)), model=model,
              KVP_WARMUP_FILE=str(wf))
    try:
        yield s
    finally:
        s.cleanup()


def warmup(stack: Stack, *args: str) -> tuple[int, dict[str, Any], str]:
    r = stack.kvp("warmup", stack.config, "--json", *args)
    return r.returncode, (json.loads(r.stdout) if r.stdout.strip() else {}), r.stderr


def state(stack: Stack) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((stack.state_dir / "warmup.json").read_text())
    return doc


def pins_doc(stack: Stack, ns: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(
        (stack.root / ".kvpersist" / "pins" / f"{ns}.json").read_text())
    return doc


def cached_token_ids(stack: Stack, ns: str) -> list[list[int]]:
    (path,) = (stack.state_dir / "warmup").glob(f"{ns}.*.json")
    return [e["token_ids"] for e in json.loads(path.read_text())["entries"]]


def test_warmup_pins_prefetch_report_and_prune(warm: Stack) -> None:
    stack = warm
    ns = stack.render()["namespace"]
    stack.launch("--no-vllm")

    # no vLLM worker has registered a KV layout: 503 until --wait runs out -> exit 1
    code, out, err = warmup(stack, "--wait", "3")
    assert code == 1, err
    assert out["state"] == "failed" and "503" in out["error"]
    st = state(stack)
    assert st["state"] == "failed" and st["namespace"] == ns and st["finished"]
    assert (stack.state_dir / "warmup.json").stat().st_mode & 0o077 == 0

    # the token ids vLLM's renderer computed, cached under the state dir
    ids = cached_token_ids(stack, ns)
    chunks = [len(x) // 256 for x in ids]
    assert chunks[0] > 1 and chunks[1] >= 1 and chunks[2] == 0, chunks
    total = sum(chunks)
    # pins: LMCache's key code, every TP rank, names that kvpersist's layout parser reads
    pins = pins_doc(stack, ns)
    assert pins["world_size"] == 2 and pins["chunks"] == total
    assert len(pins["files"]) == 2 * total
    ranks = {f.split("_")[-3] for f in pins["files"]}
    assert ranks == {"02000200", "02010201"}

    with connect(stack.rpc, stack.http, ns, tp_size=2) as d:
        # a layout is registered, L2 is empty: 0 found, not an error
        code, out, err = warmup(stack)
        assert code == 0, err
        assert out["state"] == "done" and out["tokens_cached"] is True
        assert out["pins"]["reused"] is True  # same warm set: LMCache's keys not recomputed
        assert (out["requested_chunks"], out["found_chunks"], out["bytes"]) == (total, 0, 0)
        assert [e["chunks"] for e in out["entries"]] == chunks
        # vLLM's workers compute the warm set once (here: LMCache's client stores it)
        assert [d.store_tokens(x) for x in ids[:2]] == chunks[:2]
    stack.stop()  # the server flushes its store queue

    # the pinned files are exactly the files LMCache wrote for those tokens
    written = {f.name for f in stack.chunk_files(ns + "_")}
    assert written == set(pins["files"])

    # after a restart: everything found on disk and loaded L2 -> L1
    stack.launch("--no-vllm")
    with connect(stack.rpc, stack.http, ns, tp_size=2) as d:
        code, out, err = warmup(stack)
        assert code == 0, err
        assert (out["requested_chunks"], out["found_chunks"]) == (total, total)
        assert [(e["found_keys"], e["total_keys"]) for e in out["entries"]] == \
            [(2 * c, 2 * c) for c in chunks]
        assert out["bytes"] == sum((stack.root / f).stat().st_size for f in pins["files"])
        st = state(stack)
        assert st["state"] == "done" and st["found_chunks"] == st["requested_chunks"] == total
        log = stack.server_log.read_text(errors="replace")
        for c in chunks[:2]:  # the server's own account of each load
            assert re.search(rf"Warm prefetch \w+ completed: {2 * c}/{2 * c} keys loaded into L1",
                             log), log[-3000:]
        # other sessions' chunks, not pinned
        for seq in (1, 2, 3):
            d.store(seq)
    stack.stop()
    others = {f.name for f in stack.chunk_files(ns + "_")} - set(pins["files"])
    assert len(others) == 24  # 3 sequences x 4 chunks x 2 ranks

    report = stack.kvp_json("report", "--root", str(stack.root), "--config", stack.config)
    (row,) = [r for r in report["namespaces"] if r["namespace"] == ns]
    pinned_bytes = sum((stack.root / f).stat().st_size for f in pins["files"])
    assert row["warm_pins"]["files"] == 2 * total and row["warm_pins"]["bytes"] == pinned_bytes
    assert row["warm_pins"]["missing"] == 0 and row["files"] == 2 * total + 24
    text = stack.kvp("report", "--root", str(stack.root), "--config", stack.config).stdout
    assert "WARM PINS" in text

    # a budget far below what is on disk: --to-budget deletes the others, never the pins
    stack.env["KVP_L2_BUDGET"] = "1M"
    pruned = stack.kvp_json("prune", "--root", str(stack.root), "--config", stack.config,
                            "--to-budget", "--force", "--apply")
    assert pruned["deleted"]["files"] == 24 and pruned["skipped"]["pinned"] == 2 * total
    assert {f.name for f in stack.chunk_files(ns + "_")} == set(pins["files"])

    # naming the namespace deletes its pins too, and says so
    r = stack.kvp("prune", "--root", str(stack.root), "--config", stack.config,
                  "--namespace", ns, "--force", "--apply")
    assert r.returncode == 0, r.stderr
    assert f"deleted {2 * total} warm-set pinned files too" in r.stdout
    assert stack.chunk_files(ns + "_") == []


def test_a_template_that_does_not_match_the_identity_is_refused(tmp_path: Path,
                                                                model: Path) -> None:
    wf = tmp_path / "warm.jsonl"
    wf.write_text(json.dumps(warm_lines()[0]) + "\n")
    stack = Stack(tmp_path, config=str(tp2_config(tmp_path, template_sha="ab" * 32)),
                  model=model, KVP_WARMUP_FILE=str(wf))
    stack.root.mkdir()
    r = stack.kvp("warmup", stack.config, "--wait", "1")
    assert r.returncode == 2, r.stderr
    assert f"{wf}:1" in r.stderr and "KVP_CHAT_TEMPLATE_SHA256" in r.stderr
    assert state(stack)["state"] == "failed"
    assert not (stack.state_dir / "warmup").exists()  # no token ids cached
    assert not (stack.root / ".kvpersist" / "pins").exists()
