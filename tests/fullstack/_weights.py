"""The weights fingerprint end to end (real lmcache server state, through the CLI), run by
the persistence module between its cold run and its restart (no vLLM start of its own):
other weights at the same ``KVP_MODEL_PATH`` are refused by every way of starting the
namespace, before anything starts and without reading or deleting anything under the cache
root; the original weights, restored, are the ones the restart serves and hits with.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvpersist.demo import model as dm

from ..conftest import REPO
from ._stack import Stack


def tree_state(root: Path) -> dict[str, tuple[int, ...]]:
    """Every entry under ``root``: (size, mtime_ns, atime_ns) of files, () for directories.
    atime moves when a file is read (relatime: a file not read since it was written)."""
    out: dict[str, tuple[int, ...]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[os.path.relpath(os.path.join(dirpath, d), root)] = ()
        for f in filenames:
            st = os.lstat(os.path.join(dirpath, f))
            out[os.path.relpath(os.path.join(dirpath, f), root)] = (
                st.st_size, st.st_mtime_ns, st.st_atime_ns)
    return out


def file_state(path: Path) -> tuple[int, int] | None:
    return (path.stat().st_size, path.stat().st_mtime_ns) if path.exists() else None


def generate_other_model(dest: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo generator's tiny model with another seed: other weights, same geometry."""
    with monkeypatch.context() as mp:
        mp.setitem(dm.SPECS, "tiny", dataclasses.replace(dm.SPECS["tiny"], seed=7))
        # the generator writes a hub cache (models--…/snapshots/<revision>/): copy the
        # snapshot's files, as the demo weights were copied
        snapshot = dm.generate_model("tiny", dest.with_name(dest.name + ".gen"))
    shutil.copytree(snapshot, dest)


def refuse_changed_weights(s: Stack, ns: str, prompt_tokens: int,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    """``s`` stopped after a first launch that served ``prompt_tokens`` in namespace ``ns``:
    its fingerprint is recorded; other weights are refused everywhere, nothing starts and
    nothing under the cache root or in the logs changes; the first weights are restored."""
    model = Path(s.env["KVP_MODEL_PATH"])
    # 1. the first launch recorded the fingerprint and cached the chunks
    manifest_file = s.state_dir / "manifests" / f"{ns}.json"
    manifest = manifest_file.read_text()
    record = json.loads(manifest)["weights"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(record["files"])
    chunks = s.chunk_files(ns + "_")
    assert len(chunks) >= prompt_tokens // 256

    # 2. other weights at the same KVP_MODEL_PATH
    aside = model.with_name(model.name + ".first")
    model.rename(aside)
    generate_other_model(model, monkeypatch)
    assert (model / "model.safetensors").read_bytes() != \
        (aside / "model.safetensors").read_bytes()
    l2_before = tree_state(s.root)
    logs = s.state_dir / "logs"
    logs_before = {p.name: file_state(p) for p in logs.iterdir()}
    refusal = f"changed since {ns} was first served"
    for args in (["--no-vllm"], [], ["--check"], ["--check", "--no-vllm"],
                 ["--foreground", "--no-vllm"]):
        r = s.kvp("launch", s.config, *args, timeout=300)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert refusal in r.stderr and "model.safetensors" in r.stderr, args
        assert "bump KVP_MODEL_REVISION, or restore them" in r.stderr
    w = s.kvp("weights", s.config, "--record")
    assert w.returncode == 1 and refusal in w.stderr, w.stderr
    hook = _hook(s, model)
    assert hook.returncode == 0, hook.stderr
    rc, argv = hook.stdout.split("\n", 1)
    assert rc == "rc=2" and refusal in hook.stderr, hook.stderr
    assert argv.split("\0")[:-1] == _recipe(model)  # the command left as it was

    # nothing started, nothing under the cache root read, written or deleted
    assert not s.pid_file.exists()
    assert not (s.state_dir / "pids" / "cpu-demo.vllm.pid").exists()
    assert {p.name: file_state(p) for p in logs.iterdir()} == logs_before
    assert tree_state(s.root) == l2_before
    assert manifest_file.read_text() == manifest

    # 3. the first weights restored: the same fingerprint, one stat per file
    shutil.rmtree(model)
    aside.rename(model)
    ok = s.kvp("weights", s.config, "--json")
    assert ok.returncode == 0 and json.loads(ok.stdout)["status"] == "same", ok.stdout
    assert json.loads(ok.stdout)["current"]["bytes_read"] == 0


def _recipe(model: Path) -> list[str]:
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--max-model-len", "4096"]


def _hook(s: Stack, model: Path) -> subprocess.CompletedProcess[str]:
    """The ``KV_PERSIST=1`` hook on a recipe's command; prints ``rc=N`` and the command."""
    admin = s.tmp / "kvp-admin"
    admin.write_text(f"#!/bin/bash\nexec {sys.executable} -m kvpersist.cli \"$@\"\n")
    admin.chmod(0o755)
    quoted = " ".join(f"'{a}'" for a in _recipe(model))
    script = f"""
source {REPO}/scripts/kv-persist-hook.sh
CMD=({quoted})
kvp_persist_apply CMD
echo "rc=$?"
printf '%s\\0' "${{CMD[@]}}"
"""
    env = dict(s.env, KV_PERSIST="1", KVP_CONFIG=s.config, KVP_ADMIN=str(admin),
               KVP_PYTHON=sys.executable, PYTHONPATH=str(REPO))
    return subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env,
                          cwd=s.tmp, timeout=300)
