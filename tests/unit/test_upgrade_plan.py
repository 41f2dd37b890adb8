"""``kvp-admin upgrade plan``: the pure plan (field reasons, the same namespace, the steps and
their exact commands, the JSON schema) and the command on configs and a cache root built in
a temp directory (figures equal to ``kvp-admin report``'s, read-only, exit codes)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from kvpersist.config.identity import ALL_IDENTITY_KEYS
from kvpersist.config.warmset import file_digest, tokens_cache_name, tokens_document
from kvpersist.l2.layout import ChunkName
from kvpersist.l2.pins.usage import pin_document
from kvpersist.l2.upgrade_plan import (
    DIFFERENT,
    REASONS,
    SAME,
    SCHEMA,
    UNKNOWN_REASON,
    LocalData,
    SharedData,
    Side,
    UpgradeFacts,
    WarmFacts,
    plan_upgrade,
    reason,
)

from ..cli import kvp_in_process
from ..conftest import REPO
from ..l2_roots import write_pins_at
from .test_cli_startup import HEAVY, loaded_modules, matching

DEMO = REPO / "configs" / "cpu-demo" / "identity.env"
OLD_NS = "kvp-" + "0a" * 16
NEW_NS = "kvp-" + "0b" * 16


# --------------------------------------------------------------------------- the pure plan


def side(arg: str, ns: str, root: str = "/nvme/kvp", tier: str = "") -> Side:
    return Side(arg, arg, f"/etc/kvp/{arg}/identity.env", ns, root, tier)


def facts(**kw: Any) -> UpgradeFacts:
    base: dict[str, Any] = {
        "old": side("llama-old", OLD_NS), "new": side("llama-new", NEW_NS),
        "changes": (("vllm_build", "vllm==0.31.0", "vllm==0.32.0"),
                    ("kv_cache_dtype", "bfloat16", "fp8_e4m3")),
        "local": LocalData("/nvme/kvp", 10, 4096, 2, 800, "stale"),
    }
    base.update(kw)
    return UpgradeFacts(**base)


def commands(doc: dict[str, Any]) -> list[str | None]:
    return [s["command"] for s in doc["steps"]]


def test_every_identity_field_has_its_own_reason() -> None:
    assert set(ALL_IDENTITY_KEYS) <= set(REASONS)
    assert reason("vllm_build") == "vLLM version: KV layouts change between versions"
    assert reason("kv_cache_dtype") == "KV dtype: bytes per element differ"
    assert "the KV of different weights differs" in reason("model_revision")
    assert "key boundaries move" in reason("block_size")
    assert "per-rank KV split differs" in reason("tensor_parallel_size")
    assert reason("a_field_of_tomorrow") == UNKNOWN_REASON == "part of the compatibility identity"


def test_changes_carry_key_values_and_reason() -> None:
    doc = plan_upgrade(facts(changes=(("vllm_build", "vllm==0.31.0", "vllm==0.32.0"),
                                      ("new_field", 1, 2))))
    assert doc["schema"] == SCHEMA == "kvpersist.upgrade-plan/1"
    assert doc["changes"] == [
        {"field": "vllm_build", "env_key": "KVP_VLLM_BUILD", "old": "vllm==0.31.0",
         "new": "vllm==0.32.0", "reason": REASONS["vllm_build"]},
        {"field": "new_field", "env_key": "new_field", "old": 1, "new": 2,
         "reason": UNKNOWN_REASON}]
    assert doc["verdict"] == DIFFERENT and doc["same_namespace"] is False


def test_the_same_namespace_is_a_restart_only() -> None:
    same = side("llama", OLD_NS)
    doc = plan_upgrade(facts(old=same, new=same, changes=(), same_config=True))
    assert doc["same_namespace"] is True and doc["verdict"] == SAME
    assert SAME == "same namespace: the cache carries over, nothing to do"
    assert doc["stale"] is None and doc["changes"] == []
    assert commands(doc) == ["kvp-admin restart llama"]
    # two files with one namespace (a deployment setting changed): stop the one, launch the other
    doc = plan_upgrade(facts(old=side("a", OLD_NS), new=side("b", OLD_NS), changes=()))
    assert commands(doc) == ["kvp-admin stop a && kvp-admin launch b"]


def test_steps_and_their_exact_commands() -> None:
    doc = plan_upgrade(facts(warm=WarmFacts("/etc/kvp/warm.jsonl", 3)))
    assert [s["step"] for s in doc["steps"]] == list(range(1, 8))
    assert commands(doc) == [
        "kvp-admin stop llama-old",
        None,
        "KVP_WARMUP_COMPUTE=1 kvp-admin launch llama-new",
        "kvp-admin health llama-new",
        "kvp-admin report --config llama-new",
        f"kvp-admin prune --config llama-new --namespace {OLD_NS}",
        f"kvp-admin prune --config llama-new --namespace {OLD_NS} --apply",
    ]
    switch = doc["steps"][1]
    assert switch["what"] == "install/switch to NEW"
    assert switch["note"] == ("KVP_VLLM_BUILD vllm==0.31.0 -> vllm==0.32.0 (install NEW's "
                              "vLLM build); KVP_KV_CACHE_DTYPE bfloat16 -> fp8_e4m3")
    assert doc["stale"]["namespace"] == OLD_NS and doc["stale"]["local_files"] == 10


def test_without_a_warm_set_launch_is_plain_and_roots_and_tiers_are_named() -> None:
    tier = "127.0.0.1:6379"
    doc = plan_upgrade(facts(
        old=side("old dir/identity.env", OLD_NS, tier=tier),
        new=side("new", NEW_NS, root="/nvme/new", tier=tier),
        shared=SharedData(tier, 5, 500, ({"host_id": "h-1", "age_s": 3.0},)),
        same_tier=True))
    assert commands(doc)[2] == "kvp-admin launch new"
    assert commands(doc)[4:] == [
        "kvp-admin report --root /nvme/kvp --config new --tier all",
        f"kvp-admin prune --root /nvme/kvp --config new --namespace {OLD_NS} --tier all",
        f"kvp-admin prune --root /nvme/kvp --config new --namespace {OLD_NS} --tier all "
        "--apply"]
    assert commands(doc)[0] == "kvp-admin stop 'old dir/identity.env'"  # quoted for a shell
    assert doc["stale"]["serving_hosts"] == [{"host_id": "h-1", "age_s": 3.0}]
    assert doc["stale"]["shared_when"].startswith("once no host serves it: 1 host(s)")
    # NEW leaves OLD's shared tier: the keys are pruned through OLD (its namespace: --force)
    doc = plan_upgrade(facts(old=side("old", OLD_NS, tier=tier), shared=SharedData(tier, 5, 500)))
    assert commands(doc)[-2:] == [
        f"kvp-admin prune --tier shared --config old --namespace {OLD_NS} --force",
        f"kvp-admin prune --tier shared --config old --namespace {OLD_NS} --force --apply"]
    assert "--tier" not in str(commands(doc)[5])
    assert doc["stale"]["shared_when"] == "now: no host's fleet record names it"


def test_figures_from_the_report_documents() -> None:
    report = {"root": "/r", "namespaces": [
        {"prefix": "other", "files": 1, "bytes": 1},
        {"prefix": OLD_NS, "files": 7, "bytes": 70, "status": "stale",
         "warm_pins": {"files": 2, "bytes": 20, "missing": 0}}]}
    assert LocalData.from_report(report, OLD_NS) == LocalData("/r", 7, 70, 2, 20, "stale")
    assert LocalData.from_report(report, NEW_NS) == LocalData("/r", 0, 0, 0, 0, None)
    shared = {"tier": {"endpoint": "e:1"}, "namespaces": [
        {"namespace": OLD_NS, "keys": 3, "bytes": 30, "hosts": [{"host_id": "x"}]}]}
    assert SharedData.from_report(shared, OLD_NS) == SharedData("e:1", 3, 30, ({"host_id": "x"},))
    assert SharedData.from_report(shared, NEW_NS) == SharedData("e:1")


def test_the_document_is_json_with_every_section() -> None:
    doc = plan_upgrade(facts(warm=WarmFacts("/w.jsonl", 2, 600, 2, 2, 256, "cached"),
                             problems=("shared tier x: down",)))
    again = json.loads(json.dumps(doc))
    assert again == doc
    assert set(doc) == {"schema", "old", "new", "same_namespace", "verdict", "changes",
                        "old_data", "stale", "warm_set", "vllm", "steps", "problems", "notes"}
    assert doc["vllm"] is None  # the same vLLM release on both sides
    assert doc["warm_set"] == {"file": "/w.jsonl", "entries": 2, "tokens": 600, "chunks": 2,
                               "chunk_files": 4, "world_size": 2, "chunk_size": 256,
                               "note": "cached"}
    assert doc["old_data"]["local"] == {"root": "/nvme/kvp", "files": 10, "bytes": 4096,
                                        "pinned_files": 2, "pinned_bytes": 800,
                                        "report_status": "stale"}
    assert doc["problems"] == ["shared tier x: down"]


# --------------------------------------------------------------------------- the command


def write_config(d: Path, root: Path, **values: str) -> Path:
    """A copy of configs/cpu-demo on ``root`` with ``values`` (env keys) replaced or added."""
    d.mkdir(parents=True)
    values = {"KVP_CACHE_ROOT": str(root), **values}
    lines = []
    for line in DEMO.read_text().splitlines():
        key = line.split("=", 1)[0]
        lines.append(f"{key}='{values.pop(key)}'" if key in values else line)
    lines += [f"{k}='{v}'" for k, v in values.items()]
    (d / "identity.env").write_text("\n".join(lines) + "\n")
    return d / "identity.env"


def cli(*args: str) -> Any:
    return kvp_in_process(*args)


def namespace(config: Path) -> str:
    r = cli("identity", "namespace", str(config))
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def plant(root: Path, ns: str, sizes: list[int]) -> list[str]:
    root.mkdir(parents=True, exist_ok=True)
    names = []
    for i, size in enumerate(sizes):
        name = ChunkName(ns, 1 << 24 | 1 << 8, 0, f"{i:04x}" + "e" * 12, None).filename()
        (root / name).write_bytes(os.urandom(size))
        names.append(name)
    return names


def tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path, Path]:
    root = tmp_path / "cache"
    warm = tmp_path / "warm.jsonl"
    warm.write_text('{"prompt": "You are a helpful assistant."}\n'
                    '{"messages": [{"role": "user", "content": "hi"}]}\n')
    old = write_config(tmp_path / "old", root)
    new = write_config(tmp_path / "new", root, KVP_VLLM_BUILD="vllm==0.33.0",
                       KVP_BLOCK_SIZE="64", KVP_WARMUP_FILE=str(warm))
    return old, new, root


def test_plan_counts_what_report_counts_and_writes_nothing(pair: tuple[Path, Path, Path]) -> None:
    old, new, root = pair
    old_ns, new_ns = namespace(old), namespace(new)
    names = plant(root, old_ns, [1000, 2000, 3000])
    plant(root, new_ns, [55])
    write_pins_at(root, pin_document(old_ns, "f" * 64, names[:2], world_size=1, chunk_size=256,
                                     hash_algorithm="blake3", shard_dirs=False, chunks=2,
                                     created_ns=1))
    before = tree(root)
    r = cli("upgrade", "plan", str(old), str(new), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert tree(root) == before  # read-only
    assert doc["schema"] == SCHEMA
    assert doc["old"]["namespace"] == old_ns and doc["new"]["namespace"] == new_ns
    assert [c["field"] for c in doc["changes"]] == ["block_size", "vllm_build"]
    assert doc["changes"][1]["reason"] == REASONS["vllm_build"]
    rep = json.loads(cli("report", "--config", str(new), "--json").stdout)
    [row] = [x for x in rep["namespaces"] if x["prefix"] == old_ns]
    local = doc["old_data"]["local"]
    assert (local["files"], local["bytes"]) == (row["files"], row["bytes"]) == (3, 6000)
    assert (local["pinned_files"], local["pinned_bytes"]) == (
        row["warm_pins"]["files"], row["warm_pins"]["bytes"]) == (2, 3000)
    assert local["report_status"] == row["status"] == "stale"
    assert doc["old_data"]["shared"] is None
    assert doc["warm_set"]["entries"] == 2 and doc["warm_set"]["tokens"] is None
    assert "NEW's tokenizer" in doc["warm_set"]["note"]
    assert commands(doc)[0] == "bash scripts/setup.sh --vllm 0.33.0"
    assert commands(doc)[1] == f"kvp-admin stop {old}"
    assert commands(doc)[3] == f"KVP_WARMUP_COMPUTE=1 kvp-admin launch {new}"
    v = doc["vllm"]
    assert (v["old"], v["new"]) == ("0.32.0", "0.33.0") and v["supported"]["new"]
    assert v["serve"]["new"] == ["-m", "vllm.entrypoints.cli.main", "serve"]
    assert v["flag_counts"] == {"old": 318, "new": 322} and v["new_kv_flags"] == ["--monokernel"]
    assert commands(doc)[-1] == f"kvp-admin prune --config {new} --namespace {old_ns} --apply"
    # the dry run the plan names selects exactly the old namespace's files
    dry = json.loads(cli(*commands(doc)[-2].split()[1:], "--json").stdout)
    assert dry["deleted"] == {"files": 3, "bytes": 6000} and tree(root) == before

    text = cli("upgrade", "plan", str(old), str(new))
    assert text.returncode == 0, text.stderr
    assert REASONS["vllm_build"] in text.stdout and DIFFERENT in text.stdout
    assert "3 files, 5.9 KiB, 2 pinned (2.9 KiB)" in text.stdout
    assert f"kvp-admin prune --config {new} --namespace {old_ns} --apply" in text.stdout


def test_cached_token_ids_give_tokens_and_chunks(pair: tuple[Path, Path, Path]) -> None:
    from kvpersist.config.loader import load_deployment
    from kvpersist.stack.locate import locate

    old, new, _ = pair
    dep = load_deployment(str(new))
    assert dep.identity is not None
    warm = Path(dep.settings.warmup_file)
    sha = file_digest(warm.read_bytes())
    d = Path(locate(dep).warmup_tokens_dir)
    d.mkdir(parents=True)
    (d / tokens_cache_name(dep.namespace, sha)).write_text(json.dumps(tokens_document(
        dep.namespace, sha, dep.identity.chat_template_sha256,
        [list(range(600)), list(range(100))], [1, 2])))
    doc = json.loads(cli("upgrade", "plan", str(old), str(new), "--json").stdout)
    assert doc["warm_set"]["tokens"] == 700
    assert doc["warm_set"]["chunks"] == 600 // 256 == 2
    assert doc["warm_set"]["chunk_files"] == 2 and doc["warm_set"]["chunk_size"] == 256


def test_the_same_namespace(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    plant(root, "kvp-" + "00" * 16, [10])
    a = write_config(tmp_path / "a", root)
    b = write_config(tmp_path / "b", root, KVP_L1_SIZE_GB="2")  # a setting, not the identity
    doc = json.loads(cli("upgrade", "plan", str(a), str(b), "--json").stdout)
    assert doc["same_namespace"] is True and doc["verdict"] == SAME
    assert commands(doc) == [f"kvp-admin stop {a} && kvp-admin launch {b}"]
    r = cli("upgrade", "plan", str(a), str(a))
    assert r.returncode == 0 and SAME in r.stdout and f"kvp-admin restart {a}" in r.stdout


def test_bad_input_is_exit_2_one_line_and_nothing_written(tmp_path: Path) -> None:
    good = write_config(tmp_path / "good", tmp_path / "cache")
    r = cli("upgrade", "plan", str(good), str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == ""
    assert "nowhere" in r.stderr
    r = cli("upgrade", "plan", str(good), str(tmp_path / "nowhere"), "--json")
    assert r.returncode == 2 and json.loads(r.stdout)["schema"] == "kvpersist.error/1"
    unpinned = write_config(tmp_path / "unp", tmp_path / "cache", KVP_ALLOW_UNPINNED="true",
                            KVP_CHAT_TEMPLATE_SHA256="")
    r = cli("upgrade", "plan", str(good), str(unpinned))
    assert r.returncode == 2
    assert r.stderr.startswith("kvp-admin: NEW ") and "unpinned" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = cli("upgrade", "plan", str(good))
    assert r.returncode == 2 and "Missing argument 'NEW'" in r.stderr
    assert not (tmp_path / "cache").exists()  # the missing root is a note, never created


def test_a_missing_cache_root_is_a_note(tmp_path: Path) -> None:
    a = write_config(tmp_path / "a", tmp_path / "cache")
    b = write_config(tmp_path / "b", tmp_path / "cache", KVP_MAX_MODEL_LEN="2048")
    doc = json.loads(cli("upgrade", "plan", str(a), str(b), "--json").stdout)
    assert doc["old_data"]["local"]["files"] == 0 and doc["problems"] == []
    assert any("does not exist on this host" in n for n in doc["notes"])
    assert doc["changes"][0]["reason"] == REASONS["max_model_len"]


def test_plan_never_imports_lmcache_or_torch(pair: tuple[Path, Path, Path]) -> None:
    old, new, _ = pair
    code, modules = loaded_modules("upgrade", "plan", str(old), str(new), "--json")
    assert code == 0
    assert matching(modules, HEAVY) == []
