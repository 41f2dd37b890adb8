"""Issue 20, the state dir: every file kvpersist reads back from a deployment's state dir or
cache root is untrusted. Each is replaced in turn by each hostile variant
(tests/unit/state_files.py: a FIFO, a link to /dev/zero, a link to a good file, a
directory, JSON nested 100,000 and 65 deep, JSON of the wrong type or with a field of the
wrong type, NaN, 1e309, a 300 MB sparse file, bytes that are not UTF-8, an empty file) and
the commands that read it run through tests/hostile.py (the real CLI in a child under
RLIMIT_AS = 512 MiB, a 30 s alarm, output measured): never a traceback, a hang, a memory
error or a megabyte of output, and each command gives the verdict its reader documents:

* pid files: *stale* with the reason (``status`` exit 1, not running); ``stop`` removes a
  stale one it can and names one it cannot (a directory: exit 1), the other process is
  stopped either way;
* ``warmup.json``: health's ``warmup`` check is *degraded*, "warm-up record unreadable"
  naming it; ``budget.json``: the ``cache_root.budget`` check is *skipped* naming it;
* a pin manifest: named in report's notes and prune's warnings, and its namespace is held
  whole: ``prune --stale/--unpinned/--to-budget --apply`` deletes none of its files;
* a namespace manifest: named in report's notes; when an unpinned deployment's active
  namespace may be in it, ``prune --unpinned/--to-budget`` refuses (exit 2);
* a run record: named in ``metrics``' notes, not exported;
* the crash-window records, the key fingerprint, the token-id cache, the hook's rendering
  (read by launch, the warm-up and the hook, which need a server or vLLM): their readers
  are called directly with the same variants.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.config.warmset import parse_warm_set, tokens_cache_name, tokens_document
from kvpersist.deploy import hook
from kvpersist.l2.keys import store as keys
from kvpersist.l2.layout import ChunkName
from kvpersist.stack import crash_window
from kvpersist.stack.stops import Launched
from kvpersist.stack.warm import run as warmup
from kvpersist.system import procs

from ..conftest import REPO
from ..hostile import HostileRunner, Outcome, assert_all_bounded
from .state_files import KINDS, Docs, json_doc, plant, relocated, summary, tree

STALE = "kvp-" + "a" * 32
UNPINNED = "kvp-unpinned-" + "b" * 32
OLD = time.time() - 7200


@pytest.fixture(scope="module")
def runner() -> Iterator[HostileRunner]:
    with HostileRunner() as r:
        yield r


def chunk(ns: str, i: int) -> str:
    return ChunkName(ns, 0x01000100, 0, f"{i:064x}").filename()


def chunks(root: Path, ns: str, n: int, *, old: bool) -> None:
    """``n`` chunk files of ``ns``, 1 MiB each (sparse), last used two hours ago if ``old``."""
    for i in range(n):
        p = root / chunk(ns, i)
        with open(p, "wb") as f:
            f.truncate(1 << 20)
        if old:
            os.utime(p, (OLD, OLD))


def by_name(doc: dict[str, object]) -> dict[str, dict[str, str]]:
    checks = doc["checks"]
    assert isinstance(checks, list)
    return {c["name"]: c for c in checks}


def pid_docs() -> Docs:
    return Docs(b"4242\n", b"42x\n")


def warmup_docs(ns: str) -> Docs:
    good = {"schema": "kvpersist.warmup/1", "state": "done", "namespace": ns,
            "started": "2026-01-01T00:00:00Z", "requested_chunks": 1, "found_chunks": 1}
    return Docs(json_doc(good), json_doc({**good, "state": ["done"]}))


def budget_docs() -> Docs:
    plan = {"on_disk_bytes": 1, "own_bytes": 1, "limit_bytes": 2, "l2_max_capacity_bytes": 2,
            "within_budget": True}
    good = {"schema": "kvpersist.budget-record/1", "recorded_at_ns": 1, "plan": plan}
    return Docs(json_doc(good), json_doc({**good, "plan": {**plan, "on_disk_bytes": "1"}}))


def pin_docs(ns: str) -> Docs:
    good = {"schema": "kvpersist.pins/1", "namespace": ns, "warm_file_sha256": "f" * 64,
            "files": [chunk(ns, 0)]}
    return Docs(json_doc(good), json_doc({**good, "files": chunk(ns, 0)}))


def manifest_docs(ns: str) -> Docs:
    good = {"schema": "kvpersist.manifest/1", "namespace": ns, "pinned": True,
            "identity": {"model_id": "m"}, "deployment": {"config": "cpu-demo"}}
    return Docs(json_doc(good), json_doc({**good, "identity": {"model_id": [["m"]]}}))


def run_docs() -> Docs:
    good = {"schema": "kvpersist.run/1", "kind": "verify", "finished_ns": 1, "ok": True,
            "mode": "check", "counts": {"files": 1}}
    return Docs(json_doc(good), json_doc({**good, "counts": {"files": "1"}}))


# --------------------------------------------------------------------------- lifecycle


def test_status_health_and_stop_give_a_verdict_for_every_hostile_state_file(
        tmp_path: Path, runner: HostileRunner) -> None:
    outcomes: list[Outcome] = []
    for kind in KINDS:
        env, loc = relocated(tmp_path / kind)
        pids = [loc.server_pid_file, loc.vllm_pid_file, loc.warmup_pid_file,
                loc.legacy_server_pid_file]
        for path in pids:
            plant(Path(path), kind, pid_docs())
        plant(Path(loc.warmup_state_file), kind, warmup_docs(loc.namespace))
        plant(Path(loc.budget_record), kind, budget_docs())

        status = runner.run("status", "cpu-demo", "--json", env=env)
        health = runner.run("health", "cpu-demo", "--json", env=env)
        stop = runner.run("stop", "cpu-demo", "--json", env=env)
        outcomes += [status, health, stop]
        assert_all_bounded([status, health, stop], allowed=(0, 1, 2))
        where = f"{kind}: "

        doc = json.loads(status.stdout)
        assert status.code == 1, where + status.stderr
        for part in ("lmcache", "vllm"):
            assert doc[part]["state"] == "stale", where + str(doc[part])
            # "12" is a pid (of whatever runs as 12, or nothing): stale for that reason
            want = "p" if kind == "json_number" else "pid file "
            assert doc[part]["reason"].startswith(want), where + str(doc[part])

        doc = json.loads(health.stdout)
        assert health.code == 2 and doc["status"] == "down", where + health.stderr
        checks = by_name(doc)
        assert checks["warmup"]["status"] == "degraded", where + str(checks["warmup"])
        assert "warm-up record unreadable" in checks["warmup"]["detail"]
        assert loc.warmup_state_file in checks["warmup"]["detail"], where
        assert checks["cache_root.budget"]["status"] == "skipped", where
        assert loc.budget_record in checks["cache_root.budget"]["detail"], where
        assert doc["warmup"]["pid_state"] == "stale" and doc["warmup"]["record"] is None

        doc = json.loads(stop.stdout)
        stopped = {s["what"]: s for s in doc["stopped"]}
        assert {s["how"] for s in stopped.values()} == {"stale"}, where + str(stopped)
        if kind == "directory":  # cannot be removed: named, exit 1, the other one stopped
            assert stop.code == 1, where + stop.stderr
            assert loc.server_pid_file in stopped["lmcache server"]["error"], where
            assert loc.vllm_pid_file in stopped["vLLM"]["error"], where
        else:
            assert stop.code == 0, where + stop.stderr
            assert not os.path.lexists(loc.server_pid_file), where
            assert not os.path.lexists(loc.vllm_pid_file), where
        if kind == "link_to_a_good_file":  # the link went, never what it named
            assert (Path(loc.server_pid_file).parent / "good-cpu-demo.lmcache.pid").exists()
    print("\n" + summary("status/health/stop, 6 state files", outcomes, 6 * len(KINDS)))


# --------------------------------------------------------------------------- the cache root


def test_prune_never_deletes_a_namespace_whose_pins_cannot_be_read(
        tmp_path: Path, runner: HostileRunner) -> None:
    """Two namespaces prune would take whole (a stale one, an unpinned one) hold a hostile
    pin manifest each: report names them, every kind of prune names them and deletes none
    of their files, dry run or --apply; verify and metrics stay bounded. Then, the manifests
    gone, the same prunes delete them (the guard is what kept them)."""
    outcomes: list[Outcome] = []
    prunes = [[sel, *apply] for sel in ("--stale", "--unpinned", "--to-budget")
              for apply in ([], ["--apply"])]
    for kind in KINDS:
        env, loc = relocated(tmp_path / kind, KVP_L2_BUDGET="1M")
        root = Path(loc.cache_root)
        chunks(root, loc.namespace, 2, old=False)
        chunks(root, STALE, 3, old=True)
        chunks(root, UNPINNED, 3, old=True)
        pins = root / ".kvpersist" / "pins"
        for ns in (STALE, UNPINNED):
            plant(pins / f"{ns}.json", kind, pin_docs(ns))
        plant(Path(loc.manifest_file), kind, manifest_docs(loc.namespace))
        plant(root / ".kvpersist" / "runs" / "verify.json", kind, run_docs())
        before = {k: v for k, v in tree(root).items() if not k.startswith(".kvpersist")}
        where = f"{kind}: "

        report = runner.run("report", "--config", "cpu-demo", "--json", env=env)
        runs = [report]
        doc = json.loads(report.stdout)
        notes = "\n".join(doc["notes"])
        for ns in (STALE, UNPINNED):
            assert f"pins/{ns}.json" in notes and "held as pinned" in notes, where + notes
            (row,) = [r for r in doc["namespaces"] if r["prefix"] == ns]
            assert row["warm_pins"]["unreadable"], where + str(row["warm_pins"])
        assert loc.manifest_file in notes, where + notes
        for argv in prunes:
            o = runner.run("prune", "--config", "cpu-demo", *argv, "--json", env=env)
            runs.append(o)
            doc = json.loads(o.stdout)
            assert o.code == 0 and doc["deleted"]["files"] == 0, where + str(argv) + o.stderr
            warnings = "\n".join(doc["warnings"])
            assert all(f"pins/{ns}.json" in warnings for ns in (STALE, UNPINNED)), where
        metrics = runner.run("metrics", "cpu-demo", "--no-vllm", env=env)
        verify = runner.run("verify", "cpu-demo", "--json", env=env)  # records its run
        runs += [metrics, verify]
        assert "pins/" in "\n".join(json.loads(verify.stdout)["warnings"]), where
        assert metrics.code == 0 and ".kvpersist/runs/verify.json" in metrics.stderr, where
        assert_all_bounded(runs, allowed=(0, 1, 2))
        after = {k: v for k, v in tree(root).items() if not k.startswith(".kvpersist")}
        assert after == before, where + "a prune deleted or changed files"
        outcomes += runs

    # the control: once the unreadable manifests are gone, the same prune takes them
    for ns in (STALE, UNPINNED):
        path = pins / f"{ns}.json"
        path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
    o = runner.run("prune", "--config", "cpu-demo", "--stale", "--apply", "--json", env=env)
    assert o.code == 0 and json.loads(o.stdout)["deleted"]["files"] == 3, o.stderr
    assert not list(root.glob(f"{STALE}_*")) and len(list(root.glob(f"{UNPINNED}_*"))) == 3
    print("\n" + summary("report/prune/verify/metrics, 4 cache-root files", outcomes,
                         4 * len(KINDS)))


UNPINNED_ENV = (REPO / "configs" / "cpu-demo" / "identity.env").read_text()


def test_an_unreadable_manifest_makes_an_unpinned_deployments_namespace_uncertain(
        tmp_path: Path, runner: HostileRunner) -> None:
    """The active namespace of an unpinned deployment is its newest manifest: when one
    cannot be read, --unpinned and --to-budget refuse (exit 2, naming it) rather than
    delete what may be the running server's files; without it, the prune runs."""
    config = tmp_path / "unpinned"
    config.mkdir()
    lines = [ln for ln in UNPINNED_ENV.split("\n") if not ln.startswith("KVP_MODEL_REVISION")]
    (config / "identity.env").write_text("\n".join([*lines, "KVP_ALLOW_UNPINNED=true", ""]))
    env, _ = relocated(tmp_path)
    root = Path(env["KVP_CACHE_ROOT"])
    chunks(root, UNPINNED, 2, old=True)
    bad = tmp_path / ".kvpersist" / "cache" / "manifests" / f"{UNPINNED}.json"
    plant(bad, "nested_100000", manifest_docs(UNPINNED))
    outcomes = [runner.run("prune", "--config", str(config), sel, "--apply", "--json", env=env)
                for sel in ("--unpinned", "--to-budget")]
    assert_all_bounded(outcomes, allowed=(2,))
    for o in outcomes:
        assert str(bad) in o.stderr and "not certain" in o.stderr, o.stderr
    assert len(list(root.glob(f"{UNPINNED}_*"))) == 2
    bad.unlink()
    o = runner.run("prune", "--config", str(config), "--unpinned", "--json", env=env)
    assert o.code == 0 and json.loads(o.stdout)["planned"]["files"] == 2, o.stderr


# --------------------------------------------------------------------------- direct readers


def test_the_crash_window_checks_everything_when_the_launch_record_cannot_be_read(
        tmp_path: Path) -> None:
    for kind in KINDS:
        env, loc = relocated(tmp_path / kind)
        good = Launched(10, 10).to_dict()
        path = Path(crash_window.launched_record(loc))
        plant(path, kind, Docs(json_doc(good), json_doc({**good, "launched_at_ns": "10"})))
        window = crash_window.window_of(loc, procs.PidState("absent"))
        assert window.unclean and window.since_ns == 0, (kind, window)
        assert str(path) in window.reason and "unreadable" in window.reason, kind
        # an unreadable clean-stop record is no clean stop: the window stays open
        path.unlink() if not path.is_dir() or path.is_symlink() else path.rmdir()
        path.write_text(json.dumps(good))
        plant(Path(crash_window.clean_stop_record(loc)), kind, Docs(
            json_doc({"schema": "kvpersist.clean-stop/1", "stopped_at_ns": 20}),
            json_doc({"schema": "kvpersist.clean-stop/1", "stopped_at_ns": 20, "how": [1]})))
        window = crash_window.window_of(loc, procs.PidState("absent"))
        assert window.unclean and window.since_ns == 10, (kind, window)


def test_an_unreadable_key_fingerprint_record_is_no_record(tmp_path: Path) -> None:
    for kind in KINDS:
        state = tmp_path / kind
        plant(state / "keys" / keys.FINGERPRINT_FILE, kind,
              Docs(b"0123456789abcdef\n", b"0123456789abcdeX\n"))
        assert keys.recorded_fingerprint(state) is None, kind
    keys.record_fingerprint(tmp_path / "fresh", "0123456789abcdef")
    assert keys.recorded_fingerprint(tmp_path / "fresh") == "0123456789abcdef"


def test_an_unusable_token_cache_is_ignored_with_a_warning_naming_it(tmp_path: Path) -> None:
    ws = parse_warm_set(b'{"prompt": "x"}\n', "/w.jsonl")
    for kind in [*KINDS, "good"]:
        _, loc = relocated(tmp_path / kind)
        good = tokens_document(loc.namespace, ws.sha256, "t" * 64, [[1, 2]], [1])
        path = Path(loc.warmup_tokens_dir) / tokens_cache_name(loc.namespace, ws.sha256)
        if kind == "good":
            path.parent.mkdir(parents=True)
            path.write_text(json.dumps(good))
            assert warmup._cached_ids(loc, ws, "t" * 64) == ([[1, 2]], "")
            continue
        plant(path, kind, Docs(json_doc(good), json_doc({**good, "entries": "x"})))
        ids, warning = warmup._cached_ids(loc, ws, "t" * 64)
        assert ids is None, kind
        assert str(path) in warning and "computed again" in warning, (kind, warning)


def test_the_hook_refuses_a_rendering_it_cannot_use_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = {"namespace": "kvp-" + "1" * 32, "model_link": {"target": "/m"},
            "kv_transfer_config": {}, "manifest": {"identity": None,
                                                   "deployment": {"served_model_name": "s"}}}
    for kind in KINDS:
        if kind == "link_to_a_good_file":
            continue  # an operator's path: a link is followed (the rendering is good)
        path = tmp_path / kind / "render.json"
        plant(path, kind, Docs(json_doc(good), json_doc({**good, "namespace": 1})))
        assert hook.main([str(path), "--", "vllm", "serve", "/m"]) == 2, kind
        err = capsys.readouterr().err
        assert err.startswith("kv-persist-hook: ") and str(path) in err, (kind, err)
        assert len(err) < 2000
