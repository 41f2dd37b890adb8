"""KVP_ENGINE_ARGS against a real ``lmcache server`` started by ``kvp-admin launch``: setting it
moves the deployment to another namespace where nothing stored under the old one hits;
emptying it brings the old namespace (and its hits) back; spelling variants share one
namespace. The chunks are stored and looked up with LMCache's own multiprocess client stack
under the namespace kvp-admin renders (``kvpersist.demo.kvdriver``), as vLLM's workers would."""

from __future__ import annotations

import hashlib
import json
import subprocess
from pathlib import Path

import pytest

from kvpersist.demo.kvdriver import connect

from ..conftest import REPO
from ..fullstack._stack import Stack

pytestmark = pytest.mark.integration

CPU_DEMO = (REPO / "configs" / "cpu-demo" / "identity.env").read_text()


def config(tmp: Path, name: str, engine_args: str) -> str:
    """cpu-demo with KVP_ENGINE_ARGS replaced (an identity key: from the file only)."""
    lines = [ln for ln in CPU_DEMO.split("\n") if not ln.startswith("KVP_ENGINE_ARGS=")]
    if engine_args:
        lines.append(f"KVP_ENGINE_ARGS='{engine_args}'")
    d = tmp / name
    d.mkdir()
    (d / "identity.env").write_text("\n".join(lines) + "\n")
    return str(d)


def jq_namespace(identity: dict[str, object]) -> str:
    out = subprocess.run(["jq", "-cjS", "."], input=json.dumps(identity, indent=3).encode(),
                         capture_output=True, check=True).stdout
    return "kvp-" + hashlib.sha256(out).hexdigest()[:32]


def test_engine_args_move_the_namespace_and_its_hits(stack: Stack) -> None:
    tmp = stack.tmp
    plain = config(tmp, "plain", "")
    eager = config(tmp, "eager", "--enforce-eager --hf-overrides.rope_theta=20000")
    # JSON in an env file: double quotes inside the single-quoted value, escaped for shlex
    respelled = config(tmp, "respelled", '--hf_overrides "{\\"rope_theta\\": 20000}" --enf')

    shown = {c: stack.kvp_json("identity", "show", c) for c in (plain, eager, respelled)}
    ns_plain, ns_eager = shown[plain]["namespace"], shown[eager]["namespace"]
    # empty: exactly the 14 fields, and the namespace is jq -cS of them, as before the key
    assert "engine_args" not in shown[plain]["identity"]
    assert len(shown[plain]["identity"]) == 14
    assert ns_plain == jq_namespace(shown[plain]["identity"])
    # set: one more field, another namespace (still jq -cS of the identity), whatever spelling
    assert shown[eager]["identity"]["engine_args"] == {"enforce_eager": "true",
                                                       "hf_overrides": '{"rope_theta":20000}'}
    assert ns_eager == jq_namespace(shown[eager]["identity"]) != ns_plain
    assert shown[respelled]["namespace"] == ns_eager
    # vLLM would run with exactly the canonical flags (rendered after kvpersist's own
    # arguments, before the extra arguments)
    argv = stack.kvp_json("render", eager)["vllm_argv"]
    assert argv[argv.index("--kv-transfer-config") + 2:] == [
        "--shutdown-timeout", "20", "--enforce-eager", '--hf-overrides={"rope_theta":20000}']

    # 1. without engine args: store two sequences, stop (L2 on disk)
    stack.config = plain
    stack.launch("--no-vllm")
    with connect(stack.rpc, stack.http, ns_plain) as d:
        stored = {seq: d.store(seq) for seq in (1, 2)}
    stack.stop()
    assert len(stack.chunk_files(ns_plain + "_")) == 8

    # 2. the same deployment with engine args: nothing of the old namespace hits
    stack.config = eager
    stack.launch("--no-vllm")
    with connect(stack.rpc, stack.http, ns_eager) as d:
        assert [d.lookup(seq).hit_chunks for seq in (1, 2)] == [0, 0]
        eager_stored = d.store(3)
    stack.stop()
    assert len(stack.chunk_files(ns_eager + "_")) == 4

    # 3. engine args emptied again: the old blocks hit, byte for byte; the new ones do not
    stack.config = plain
    stack.launch("--no-vllm")
    with connect(stack.rpc, stack.http, ns_plain) as d:
        for seq, digests in stored.items():
            lk, got = d.lookup_and_retrieve(seq)
            assert (lk.hit_chunks, lk.total_chunks) == (4, 4) and got == digests
        assert d.lookup(3).hit_chunks == 0
    stack.stop()

    # 4. another spelling of the same engine args: the same namespace, its blocks hit
    stack.config = respelled
    stack.launch("--no-vllm")
    with connect(stack.rpc, stack.http, ns_eager) as d:
        lk, got = d.lookup_and_retrieve(3)
        assert lk.hit_chunks == 4 and got == eager_stored
        assert d.lookup(1).hit_chunks == 0
    stack.stop()
