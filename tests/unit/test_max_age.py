"""Maximum age (KVP_L2_MAX_AGE, ``prune --older-than`` / ``--max-age``) and the report's ages
and salts: the pure parts table-driven, then the scan and the executor on real directory
trees (files aged with ``os.utime``), then the CLI in this process."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from kvpersist.config.values import parse_max_age
from kvpersist.errors import ConfigError
from kvpersist.l2.ages import (
    age_distribution,
    past,
    past_max_age,
    root_max_age,
    salt_rows,
)
from kvpersist.l2.inventory import open_existing
from kvpersist.l2.prune import prune_stream
from kvpersist.l2.retention import (
    ACTIVE,
    STALE,
    Selection,
    age_selections,
    format_age,
    plan_explicit,
)
from kvpersist.l2.scan import scan_root
from kvpersist.l2.usage import HIST_BUCKET_NS, Usage
from tests.cli import kvp_in_process

from .test_settings import BASE, DEPLOY, build

DAY = 86400
H = HIST_BUCKET_NS
NS_A = "kvp-" + "a" * 32
NS_B = "kvp-" + "b" * 32


# -- the value -----------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "seconds"), [
    ("", 0.0), ("30d", 30 * DAY), ("12h", 43200.0), ("90m", 5400.0), ("2w", 14 * DAY),
    ("1.5d", 1.5 * DAY), ("7D", 7 * DAY),
])
def test_max_age_values(text: str, seconds: float) -> None:
    assert parse_max_age(text) == (seconds, "")


@pytest.mark.parametrize(("text", "needle"), [
    ("30", "give a unit: 30d"), ("x", "not a duration"), ("10s", "at least a minute"),
    ("-3d", "not a duration"), ("30y", "not a duration"),
    # issue 40: one token, as written, nothing around it (decided: refused, not trimmed)
    ("30 d", "not a duration"), ("30d\n", "not a duration"), (" 7d ", "not a duration"),
    ("\t7d", "not a duration"), ("30d\u00a0", "not a duration"), ("３０d", "not a duration"),
    ("99999999999d", "longer than 100 years"),
])
def test_max_age_refusals(text: str, needle: str) -> None:
    seconds, problem = parse_max_age(text)
    assert seconds == 0 and needle in problem


def test_setting_default_value_and_problem() -> None:
    assert build({**BASE, **DEPLOY}).settings.l2_max_age_s == 0
    assert build({**BASE, **DEPLOY, "KVP_L2_MAX_AGE": "30d"}).settings.l2_max_age_s == 30 * DAY
    with pytest.raises(ConfigError) as exc:
        build({**BASE, **DEPLOY, "KVP_L2_MAX_AGE": "30"})
    (problem,) = [p for p in exc.value.problems if "KVP_L2_MAX_AGE" in p.where]
    assert "give a unit" in problem.message and "docs/max-age.md" in problem.fix


def test_format_age() -> None:
    assert [format_age(s) for s in (30 * DAY, 43200, 5400, 14 * DAY, 61)] == \
        ["30d", "12h", "90m", "2w", "61s"]


# -- the plan ------------------------------------------------------------------------------

def usage(files: int) -> Usage:
    return Usage(files=files, bytes=files * 10)


def test_age_selections_every_namespace_the_active_one_too() -> None:
    now = 1000 * DAY * 10**9
    prefixes = {NS_A: usage(3), NS_B: usage(2), "test-model": usage(5),
                "kvp-" + "c" * 32: usage(0)}
    sels = age_selections(prefixes, active={NS_A}, now_ns=now, older_than_s=30 * DAY)
    assert [(s.prefix, s.kind, s.by_written) for s in sels] == [
        (NS_A, ACTIVE, True), (NS_B, STALE, True)]
    assert all(s.before_ns == now - 30 * DAY * 10**9 and not s.named for s in sels)
    assert sels[0].reason == "maximum age 30d"
    assert sels[0].to_dict()["by"] == "written"


def test_plan_explicit_with_an_age_notes_foreign_prefixes_and_skips_whole_ones() -> None:
    prefixes = {NS_A: usage(3), NS_B: usage(2), "test-model": usage(5)}
    plan = plan_explicit(prefixes, Usage(), active=set(), now_ns=10**18, namespaces=[NS_B],
                         older_than_s=DAY)
    assert [(s.prefix, s.by_written, s.named) for s in plan.selections] == [
        (NS_B, False, True), (NS_A, True, False)]
    assert any("test-model" in n for n in plan.notes)


def test_a_written_selection_compares_mtime_never_last_use() -> None:
    s = Selection(STALE, NS_A, 100, 0, 0, "maximum age", by_written=True)
    assert s.matches(NS_A, last_use_ns=10**9, written_ns=99)
    assert not s.matches(NS_A, last_use_ns=5, written_ns=100)  # read long ago, written late
    assert not s.matches(NS_A, last_use_ns=5)  # no write time: never selected
    assert not s.matches(NS_B, 5, 5)
    lru = Selection(STALE, NS_A, 100, 0, 0, "lru")
    assert lru.matches(NS_A, 99, 10**9) and not lru.matches(NS_A, 100, 0)


# -- the report's aggregates ---------------------------------------------------------------

def test_age_distribution_counts_from_the_bucket_end() -> None:
    now = 10_000 * H
    hist = {10_000: [1, 1], 9_999: [2, 20], 10_000 - 24: [3, 300],
            10_000 - 40 * 24: [4, 4000], 10_000 - 400 * 24: [5, 50000]}
    rows = {r["label"]: (r["files"], r["bytes"]) for r in age_distribution(hist, now)}
    assert rows == {"1h": (3, 21), "1d": (3, 300), "7d": (0, 0), "30d": (0, 0),
                    "90d": (4, 4000), "365d": (0, 0), "older": (5, 50000)}
    # past 30 days: whole buckets only, a lower bound exact to the hour
    assert past(hist, now, 30 * DAY) == (9, 54000)
    # the bucket 24 h back ends 23 h ago: not yet past a day, past 23 h
    assert past(hist, now, DAY) == (9, 54000)
    assert past(hist, now, 23 * 3600) == (12, 54300)
    assert past(None, now, DAY) == (0, 0)


def test_past_max_age_leaves_out_the_pins_and_a_held_namespace() -> None:
    now = 10_000 * H
    hist = {now // H - 50 * 24: [4, 400], now // H: [2, 20]}
    pins = {now // H - 50 * 24: [1, 100]}
    got = past_max_age(hist, now, 30 * DAY, pins)
    assert (got.files, got.bytes, got.pinned_files, got.pinned_bytes) == (3, 300, 1, 100)
    held = past_max_age(hist, now, 30 * DAY, pins, held=True)
    assert (held.files, held.pinned_files) == (0, 4)
    assert root_max_age([0, 30 * DAY, 7 * DAY]) == 7 * DAY and root_max_age([0.0]) is None


def test_salt_rows() -> None:
    rows = salt_rows(10, 1000, {"tenant-a": [3, 300], "tenant-b": [4, 400]}, [1, 100])
    assert rows == [
        {"salt": None, "files": 2, "bytes": 200},
        {"salt": "tenant-b", "files": 4, "bytes": 400},
        {"salt": "tenant-a", "files": 3, "bytes": 300},
        {"salt": "...", "files": 1, "bytes": 100, "other_salts": True},
    ]
    assert salt_rows(2, 20, {}, [0, 0]) == [{"salt": None, "files": 2, "bytes": 20}]


# -- real trees ----------------------------------------------------------------------------

def chunk(root: Path, ns: str, i: int, *, salt: str = "", age_s: float = 0,
          size: int = 1000) -> str:
    name = f"{ns}_01000100_0_{i:064x}{'@' + salt if salt else ''}.bin"
    (root / name).write_bytes(b"\1" * size)
    if age_s:
        t = time.time() - age_s
        os.utime(root / name, (time.time(), t))  # read just now, written long ago
    return name


@pytest.fixture
def tree(tmp_path: Path) -> tuple[Path, set[str], set[str]]:
    """Two namespaces: old and young files, salted and not, and a foreign prefix."""
    root = tmp_path / "cache"
    root.mkdir()
    old = {chunk(root, NS_A, 0, age_s=40 * DAY), chunk(root, NS_A, 1, age_s=31 * DAY,
                                                        salt="tenant-a"),
           chunk(root, NS_B, 2, age_s=400 * DAY)}
    young = {chunk(root, NS_A, 3), chunk(root, NS_A, 4, salt="tenant-a"),
             chunk(root, NS_A, 5, salt="tenant-b", age_s=29 * DAY), chunk(root, NS_B, 6)}
    chunk(root, "test-model", 7, age_s=90 * DAY)
    return root, old, young


def test_scan_keeps_write_times_and_salts(tree: tuple[Path, set[str], set[str]]) -> None:
    root, _, _ = tree
    with open_existing(root) as h:
        plain = scan_root(h, hist=False)
        aged = scan_root(h, hist=False, ages=True)
    assert not plain.prefixes[NS_A].write_hist
    a = aged.prefixes[NS_A]
    assert sum(f for f, _ in a.write_hist.values()) == a.files == 5
    assert past(a.write_hist, aged.started_ns, 30 * DAY) == (2, 2000)
    assert a.salt_usage == {"tenant-a": [2, 2000], "tenant-b": [1, 1000]}
    assert a.salted_files == 3


def test_prune_by_age_deletes_exactly_the_old_files_and_keeps_pins(
        tree: tuple[Path, set[str], set[str]]) -> None:
    root, old, young = tree
    pinned = sorted(n for n in old if n.startswith(NS_B))
    now = time.time_ns()
    prefixes = {NS_A: usage(5), NS_B: usage(2), "test-model": usage(1)}
    sels = age_selections(prefixes, active={NS_A}, now_ns=now, older_than_s=30 * DAY)
    with open_existing(root) as h:
        dry = prune_stream(h, sels, list_paths=True, keep=frozenset(pinned))
        assert set(dry.deleted_paths or []) == old - set(pinned)
        assert dry.kept_pinned == 1 and dry.skipped_used == 0
        res = prune_stream(h, sels, dry_run=False, keep=frozenset(pinned))
    assert res.deleted_files == 2
    left = {p.name for p in root.iterdir() if p.is_file()}
    assert young | set(pinned) <= left and not (old - set(pinned)) & left
    assert any(n.startswith("test-model") for n in left)  # not a namespace: never by age


# -- the CLI -------------------------------------------------------------------------------

def cfg_env(tmp_path: Path, root: Path, max_age: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVP_")}
    env.update({"KVP_CACHE_ROOT": str(root), "KVP_MODEL_PATH": str(tmp_path / "model"),
                "KVP_STATE_DIR": str(tmp_path / "state"), "KVP_L2_MAX_AGE": max_age})
    return env


def run_json(*args: str, env: dict[str, str] | None = None) -> tuple[int, Any]:
    r = kvp_in_process(*args, "--json", env=env)
    return r.returncode, json.loads(r.stdout)


def test_cli_report_prune_max_age(tmp_path: Path,
                                  tree: tuple[Path, set[str], set[str]]) -> None:
    root, old, young = tree
    env = cfg_env(tmp_path, root, "30d")
    code, doc = run_json("report", "--config", "cpu-demo", env=env)
    assert code == 0 and doc["schema"] == "kvpersist.report/1"
    assert doc["max_age_s"] == 30 * DAY
    assert doc["past_max_age"] == {"files": 3, "bytes": 3000}
    rows = {r["prefix"]: r for r in doc["namespaces"]}
    assert rows[NS_A]["past_max_age"]["files"] == 2
    assert rows["test-model"]["past_max_age"] is None  # not a namespace
    assert [x["salt"] for x in rows[NS_A]["salt_usage"]] == [None, "tenant-a", "tenant-b"]
    assert {b["label"]: b["files"] for b in rows[NS_B]["ages"]}["older"] == 1
    text = kvp_in_process("report", "--config", "cpu-demo", env=env).stdout
    assert "PAST MAX AGE" in text and "max age   30d" in text and "tenant-b" in text

    code, dry = run_json("prune", "--config", "cpu-demo", "--max-age", "--list", env=env)
    assert code == 0 and dry["dry_run"] and set(dry["files"]) == old
    code, applied = run_json("prune", "--config", "cpu-demo", "--max-age", "--apply", env=env)
    assert code == 0 and applied["deleted"]["files"] == 3
    assert {p.name for p in root.iterdir() if p.name.startswith("kvp-")} == young
    code, again = run_json("report", "--config", "cpu-demo", env=env)
    assert again["past_max_age"] == {"files": 0, "bytes": 0}


@pytest.mark.parametrize(("args", "needle"), [
    (("--older-than", "30"), "give a unit"),
    (("--older-than", "30d", "--max-age"), "not both"),
    (("--older-than", "30d", "--to-budget"), "--to-budget chooses"),
    (("--older-than", "30d", "--tier", "shared"), "--older-than"),
])
def test_cli_refusals(tmp_path: Path, tree: tuple[Path, set[str], set[str]],
                      args: tuple[str, ...], needle: str) -> None:
    root, _, _ = tree
    code, doc = run_json("prune", "--root", str(root), *args)
    assert code == 2 and needle in doc["error"], doc


def test_cli_max_age_needs_a_configured_age(tmp_path: Path,
                                            tree: tuple[Path, set[str], set[str]]) -> None:
    root, _, _ = tree
    code, doc = run_json("prune", "--config", "cpu-demo", "--max-age",
                         env=cfg_env(tmp_path, root, ""))
    assert code == 2 and "KVP_L2_MAX_AGE" in doc["error"]
    assert len(list(root.iterdir())) == 8  # nothing touched
