"""The weights fingerprint over real directories (kvpersist/stack/weights.py): a plain
directory, a hub cache (blobs + snapshot symlinks), a ``--local-dir`` download; the digest
cache (a hit reads nothing; a changed file is read again); the launch check and the
``weights`` command."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.stack import weights as w
from kvpersist.stack.weights import WeightsError, fingerprint_weights, model_files

from ..cli import kvp
from ..conftest import REPO, clean_env

FILES = {
    "config.json": b'{"model_type": "llama"}\n',
    "tokenizer.json": b'{"version": "1.0"}\n',
    "model-00001-of-00002.safetensors": os.urandom(3 << 20) + b"x",  # > one read chunk
    "model-00002-of-00002.safetensors": os.urandom(1000),
}


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def git_sha1(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """The paths read_sha256 read, in order."""
    seen: list[str] = []
    real = w.read_sha256

    def counting(path: str) -> tuple[str, w.StatKey]:
        seen.append(os.path.basename(path))
        return real(path)

    monkeypatch.setattr(w, "read_sha256", counting)
    yield seen


def plain(root: Path, files: dict[str, bytes] = FILES) -> Path:
    root.mkdir(parents=True)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


def hub(cache: Path, files: dict[str, bytes] = FILES, rev: str = "1" * 40) -> Path:
    """A hub cache repository: LFS files (the weights) under their sha256, small files under
    their git sha1, the snapshot linking to them as huggingface_hub does."""
    repo = cache / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / rev
    snap.mkdir(parents=True)
    for name, data in files.items():
        blob = sha(data) if name.endswith(".safetensors") else git_sha1(data)
        (repo / "blobs" / blob).write_bytes(data)
        (snap / name).symlink_to(f"../../blobs/{blob}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    return snap


def expected(files: dict[str, bytes] = FILES) -> str:
    from kvpersist.config.fingerprint import FileDigest, combine

    return combine(FileDigest(n, len(d), sha(d)) for n, d in files.items())


# --------------------------------------------------------------------------- which files
def test_model_files_top_level_only_hidden_and_others_skipped(tmp_path: Path) -> None:
    m = plain(tmp_path / "m")
    (m / "README.md").write_text("x")
    (m / ".gitattributes").write_text("x")
    (m / "original").mkdir()
    (m / "original" / "consolidated.00.pth").write_bytes(b"x")
    (m / "sub.json").mkdir()  # a directory with a counted name
    assert [n for n, _ in model_files(str(m))] == sorted(FILES)
    (m / "broken.safetensors").symlink_to(m / "nowhere")
    with pytest.raises(WeightsError, match="broken link"):
        model_files(str(m))


def test_a_single_file_model_path(tmp_path: Path) -> None:
    f = tmp_path / "model-q4.gguf"
    f.write_bytes(b"GGUF" + os.urandom(100))
    res = fingerprint_weights(str(f), str(tmp_path / "s" / "cache.json"))
    assert [x.name for x in res.record.files] == ["model-q4.gguf"]
    assert res.record.files[0].sha256 == sha(f.read_bytes())
    with pytest.raises(WeightsError, match="No such file"):
        fingerprint_weights(str(tmp_path / "none"), str(tmp_path / "s" / "cache.json"))


# --------------------------------------------------------------------------- layouts
def test_plain_dir_read_once_then_one_stat_per_file(tmp_path: Path, reads: list[str]) -> None:
    m = plain(tmp_path / "m")
    cache = tmp_path / "state" / "weights-digests.json"
    first = fingerprint_weights(str(m), str(cache))
    assert first.record.fingerprint == expected()
    assert sorted(reads) == sorted(FILES) and first.sources == {"read": 4}
    assert first.bytes_read == sum(len(d) for d in FILES.values())
    assert stat.S_IMODE(cache.stat().st_mode) == 0o600
    mtime = cache.stat().st_mtime_ns
    reads.clear()
    again = fingerprint_weights(str(m), str(cache))
    assert reads == [] and again.sources == {"cache": 4} and again.bytes_read == 0
    assert again.record.fingerprint == first.record.fingerprint
    assert cache.stat().st_mtime_ns == mtime  # nothing new: not rewritten


def test_cache_hit_never_opens_a_weights_file(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Independent of the read counter: after the first pass, opening any weights file
    fails, and the second pass still succeeds (one stat per file)."""
    m = plain(tmp_path / "m")
    cache = str(tmp_path / "state" / "c.json")
    first = fingerprint_weights(str(m), cache).record.fingerprint
    real_open = os.open

    def guarded(path: str, *a: object, **k: object) -> int:
        if str(path).startswith(str(m)):
            raise AssertionError(f"opened {path}")
        return real_open(path, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", guarded)
    assert fingerprint_weights(str(m), cache).record.fingerprint == first


def test_hub_layout_lfs_blobs_are_free_small_files_are_read(tmp_path: Path,
                                                             reads: list[str]) -> None:
    snap = hub(tmp_path / "hub")
    res = fingerprint_weights(str(snap), str(tmp_path / "state" / "c.json"))
    # the same bytes give the same fingerprint in any layout
    assert res.record.fingerprint == expected()
    assert res.sources == {"hub-blob": 2, "read": 2}
    assert sorted(reads) == sorted(git_sha1(FILES[n]) for n in ("config.json",
                                                                 "tokenizer.json"))
    assert res.bytes_read == len(FILES["config.json"]) + len(FILES["tokenizer.json"])
    reads.clear()
    again = fingerprint_weights(str(snap), str(tmp_path / "state" / "c.json"))
    assert reads == [] and again.sources == {"cache": 4}


def test_hub_blob_changed_in_place_is_read_and_says_so(tmp_path: Path,
                                                       reads: list[str]) -> None:
    snap = hub(tmp_path / "hub")
    cache = str(tmp_path / "state" / "c.json")
    before = fingerprint_weights(str(snap), cache).record.fingerprint
    reads.clear()
    name = "model-00002-of-00002.safetensors"
    with open(snap / name, "r+b") as f:  # through the snapshot link, into the blob
        f.write(b"fine-tuned")
    res = fingerprint_weights(str(snap), cache)
    assert reads == [sha(FILES[name])]  # the blob, still under its old name
    assert res.record.fingerprint != before
    assert any("modified after download" in n for n in res.notes)
    reads.clear()
    assert fingerprint_weights(str(snap), cache).record.fingerprint == \
        res.record.fingerprint and reads == []


def _replace_by_rename_keeping_mtime(target: Path, data: bytes) -> None:
    """``cp target x; change x; touch -r target x; mv x target``: a new inode under the
    old name, with the old mtime (and size)."""
    tmp = target.with_name(target.name + ".new")
    shutil.copy2(target, tmp)
    with open(tmp, "r+b") as f:
        f.write(data)
    st = target.stat()
    os.utime(tmp, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.rename(tmp, target)


def test_hub_blob_replaced_by_rename_under_its_name_is_read(tmp_path: Path,
                                                            reads: list[str]) -> None:
    """Finding: a blob replaced by rename (same name, same size and mtime, a new inode) was
    taken at its name's word ("same"); a new inode where the cache knew another is read."""
    snap = hub(tmp_path / "hub")
    cache = str(tmp_path / "state" / "c.json")
    before = fingerprint_weights(str(snap), cache).record.fingerprint
    name = "model-00002-of-00002.safetensors"
    blob = snap.parent.parent / "blobs" / sha(FILES[name])
    ino = blob.stat().st_ino
    _replace_by_rename_keeping_mtime(blob, b"fine-tuned")
    assert blob.stat().st_ino != ino and blob.stat().st_size == len(FILES[name])
    reads.clear()
    res = fingerprint_weights(str(snap), cache)
    assert reads == [blob.name] and res.record.fingerprint != before
    assert res.sources == {"cache": 3, "read": 1}
    assert any("replaced after download" in n for n in res.notes)
    reads.clear()
    again = fingerprint_weights(str(snap), cache)  # the new inode is now known: one stat
    assert reads == [] and again.record.fingerprint == res.record.fingerprint


def test_local_dir_file_replaced_by_rename_mtime_kept_is_read(tmp_path: Path,
                                                              reads: list[str]) -> None:
    big = "model-00001-of-00002.safetensors"
    m = _local_dir(tmp_path / "m", {big: sha(FILES[big])}, time.time() + 5)
    cache = str(tmp_path / "state" / "c.json")
    first = fingerprint_weights(str(m), cache)
    assert first.sources["hf-metadata"] == 1 and first.record.fingerprint == expected()
    _replace_by_rename_keeping_mtime(m / big, b"fine-tuned")
    reads.clear()
    res = fingerprint_weights(str(m), cache)
    assert reads == [big] and res.record.fingerprint != first.record.fingerprint
    assert any("replaced after download" in n for n in res.notes)


def test_rehash_reads_everything(tmp_path: Path, reads: list[str]) -> None:
    snap = hub(tmp_path / "hub")
    cache = str(tmp_path / "state" / "c.json")
    fingerprint_weights(str(snap), cache)
    reads.clear()
    res = fingerprint_weights(str(snap), cache, rehash=True)
    assert len(reads) == 4 and res.sources == {"read": 4}
    assert res.record.fingerprint == expected()


def _local_dir(root: Path, etags: dict[str, str], stamp: float) -> Path:
    m = plain(root)
    meta = m / ".cache" / "huggingface" / "download"
    meta.mkdir(parents=True)
    for name, etag in etags.items():
        (meta / f"{name}.metadata").write_text(f"{'2' * 40}\n{etag}\n{stamp}\n")
    return m


def test_local_dir_metadata_sha256_etags_are_free(tmp_path: Path, reads: list[str]) -> None:
    big = "model-00001-of-00002.safetensors"
    etags = {big: sha(FILES[big]), "config.json": git_sha1(FILES["config.json"])}
    m = _local_dir(tmp_path / "m", etags, time.time() + 5)
    res = fingerprint_weights(str(m), str(tmp_path / "state" / "c.json"))
    assert res.record.fingerprint == expected()
    assert res.sources == {"hf-metadata": 1, "read": 3}  # a git-sha1 etag is not a sha256
    assert big not in reads and "config.json" in reads


def test_local_dir_outdated_metadata_is_ignored(tmp_path: Path, reads: list[str]) -> None:
    """huggingface_hub's own rule: metadata older than the file's mtime (minus 1 s) is
    outdated (the file was modified after its download)."""
    big = "model-00001-of-00002.safetensors"
    m = _local_dir(tmp_path / "m", {big: "f" * 64}, time.time() - 3600)
    res = fingerprint_weights(str(m), str(tmp_path / "state" / "c.json"))
    assert big in reads and res.record.fingerprint == expected()


# --------------------------------------------------------------------------- changed files
def _first(tmp_path: Path) -> tuple[Path, str, str]:
    m = plain(tmp_path / "m")
    cache = str(tmp_path / "state" / "c.json")
    return m, cache, fingerprint_weights(str(m), cache).record.fingerprint


def test_size_change_is_read_again(tmp_path: Path, reads: list[str]) -> None:
    m, cache, before = _first(tmp_path)
    reads.clear()
    with open(m / "config.json", "ab") as f:
        f.write(b" ")
    res = fingerprint_weights(str(m), cache)
    assert reads == ["config.json"] and res.record.fingerprint != before


def test_mtime_change_alone_is_read_again(tmp_path: Path, reads: list[str]) -> None:
    m, cache, before = _first(tmp_path)
    reads.clear()
    st = (m / "tokenizer.json").stat()
    os.utime(m / "tokenizer.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    res = fingerprint_weights(str(m), cache)
    assert reads == ["tokenizer.json"] and res.record.fingerprint == before


def test_rewritten_in_place_with_mtime_restored_is_read_again(tmp_path: Path,
                                                              reads: list[str]) -> None:
    """Same size, mtime set back: only ctime (which no user can set) tells."""
    m, cache, before = _first(tmp_path)
    reads.clear()
    f = m / "model-00002-of-00002.safetensors"
    st = f.stat()
    time.sleep(0.01)
    f.write_bytes(os.urandom(st.st_size))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    res = fingerprint_weights(str(m), cache)
    assert reads == [f.name] and res.record.fingerprint != before


def test_replaced_by_a_copy_new_inode_is_read_again(tmp_path: Path, reads: list[str]) -> None:
    m, cache, before = _first(tmp_path)
    reads.clear()
    f = m / "config.json"
    shutil.copy2(f, m / "copy.tmp")
    os.replace(m / "copy.tmp", f)
    res = fingerprint_weights(str(m), cache)
    assert reads == ["config.json"] and res.record.fingerprint == before


def test_changed_while_being_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x" * 10)
    real = os.fstat
    calls = []

    def moving(fd: int) -> os.stat_result:
        st = real(fd)
        calls.append(1)
        if len(calls) == 2:  # the stat after the read
            os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1))
            return real(fd)
        return st

    monkeypatch.setattr(os, "fstat", moving)
    with pytest.raises(WeightsError, match="changed while it was being read"):
        w.read_sha256(str(f))


# --------------------------------------------------------------------------- the cache file
def test_corrupt_cache_is_ignored_with_a_note(tmp_path: Path, reads: list[str]) -> None:
    m, cache, before = _first(tmp_path)
    Path(cache).write_text("{not json")
    reads.clear()
    res = fingerprint_weights(str(m), cache)
    assert len(reads) == 4 and res.record.fingerprint == before
    assert any("ignored" in n for n in res.notes)
    assert json.loads(Path(cache).read_text())["schema"] == w.CACHE_SCHEMA  # rewritten


def test_cache_keeps_other_models_entries_drops_files_changed_in_place(tmp_path: Path) -> None:
    a, b = plain(tmp_path / "a"), plain(tmp_path / "b", {"config.json": b"{}"})
    cache = tmp_path / "state" / "c.json"
    fingerprint_weights(str(a), str(cache))
    fingerprint_weights(str(b), str(cache))
    assert len(json.loads(cache.read_text())["files"]) == 5
    shutil.rmtree(a)  # gone (or moved aside): its entries stay a while
    (b / "config.json").write_bytes(b"{ }")  # changed in place: its old entry can never hit
    fingerprint_weights(str(b), str(cache))
    kept = json.loads(cache.read_text())["files"]
    assert sorted(e["path"] for e in kept.values()) == sorted(
        [str(a / n) for n in FILES] + [str(b / "config.json")])
    assert [e["sha256"] for e in kept.values() if e["path"] == str(b / "config.json")] == [
        sha(b"{ }")]


def test_weights_moved_aside_and_restored_still_hit(tmp_path: Path, reads: list[str]) -> None:
    """Digests are kept by (device, inode): other weights at the same path, then the first
    ones renamed back, cost no read."""
    m, cache, before = _first(tmp_path)
    m.rename(tmp_path / "aside")
    other = plain(m, {"config.json": b"{}", "model.safetensors": b"other"})
    reads.clear()
    assert fingerprint_weights(str(other), cache).record.fingerprint != before
    assert sorted(reads) == ["config.json", "model.safetensors"]
    shutil.rmtree(m)
    (tmp_path / "aside").rename(m)
    reads.clear()
    res = fingerprint_weights(str(m), cache)
    assert reads == [] and res.record.fingerprint == before and res.sources == {"cache": 4}


def test_cache_not_written_into_another_users_state_dir(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    m = plain(tmp_path / "m")
    state = tmp_path / "state"
    state.mkdir()
    monkeypatch.setattr(os, "geteuid", lambda: state.stat().st_uid + 1)
    res = fingerprint_weights(str(m), str(state / "c.json"))
    assert not (state / "c.json").exists()
    assert any("belongs to uid" in n for n in res.notes)


# --------------------------------------------------------------------------- the launch check
def _loc(tmp_path: Path, model: Path, **env: str) -> w.Location:
    from kvpersist.config.loader import load_deployment
    from kvpersist.stack.locate import locate

    base = dict(KVP_CACHE_ROOT=str(tmp_path / "cache"), KVP_MODEL_PATH=str(model))
    return locate(load_deployment("cpu-demo", {**base, **env}))


def test_check_first_same_changed_and_the_manifest_record(tmp_path: Path) -> None:
    m = plain(tmp_path / "m")
    loc = _loc(tmp_path, m)
    first = w.check_weights(loc, pinned=True, with_vllm=True)
    assert first.status == "first" and not first.problems and first.record is not None
    man = w.manifest_with_weights({"schema": "kvpersist.manifest/1"}, loc.manifest_file, first)
    Path(loc.manifest_file).parent.mkdir(parents=True)
    Path(loc.manifest_file).write_text(json.dumps(man))
    same = w.check_weights(loc, pinned=True, with_vllm=False)
    assert same.status == "same" and same.record == first.record
    assert any("matches" in n for n in same.notes)
    # an unchecked launch keeps the record that is there
    kept = w.manifest_with_weights({"schema": "kvpersist.manifest/1"}, loc.manifest_file, None)
    assert kept["weights"] == first.record.to_dict()

    (m / "config.json").write_bytes(b'{"model_type": "mistral"}\n')
    changed = w.check_weights(loc, pinned=True, with_vllm=False)
    assert changed.status == "changed" and len(changed.problems) == 1
    assert "changed since " + loc.namespace in str(changed.problems[0])
    assert "changed: config.json" in str(changed.problems[0])


def test_check_unchecked_cases(tmp_path: Path) -> None:
    loc = _loc(tmp_path, tmp_path / "absent")
    chk = w.check_weights(loc, pinned=True, with_vllm=False)
    assert chk.status == "unchecked" and not chk.problems
    assert "checked again before vLLM starts" in chk.notes[0]
    assert w.check_weights(loc, pinned=True, with_vllm=True).problems == ()  # preflight's own
    assert "unpinned" in w.check_weights(loc, pinned=False, with_vllm=True).notes[0]


def test_check_unreadable_manifest_is_a_problem(tmp_path: Path) -> None:
    loc = _loc(tmp_path, plain(tmp_path / "m"))
    Path(loc.manifest_file).parent.mkdir(parents=True)
    Path(loc.manifest_file).write_text("{")
    chk = w.check_weights(loc, pinned=True, with_vllm=False)
    assert [p.where for p in chk.problems] == ["KVP_STATE_DIR"]
    Path(loc.manifest_file).write_text(json.dumps({"weights": {"scheme": "x"}}))
    assert "newer kvpersist" in str(w.check_weights(loc, pinned=True, with_vllm=True).problems)


def test_check_unreadable_weights_problem_with_vllm_note_without(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loc = _loc(tmp_path, plain(tmp_path / "m"))

    def denied(path: str) -> tuple[str, w.StatKey]:
        raise WeightsError(f"cannot read {path}: Permission denied")

    monkeypatch.setattr(w, "read_sha256", denied)
    assert w.check_weights(loc, pinned=True, with_vllm=True).problems[0].where == \
        "KVP_MODEL_PATH"
    chk = w.check_weights(loc, pinned=True, with_vllm=False)
    assert not chk.problems and "Permission denied" in chk.notes[0]


# --------------------------------------------------------------------------- the CLI
def test_cli_weights_launch_check_and_foreground_refuse_changed_weights(tmp_path: Path) -> None:
    m = plain(tmp_path / "m")
    env = dict(clean_env(), KVP_CACHE_ROOT=str(tmp_path / "cache"), KVP_MODEL_PATH=str(m))
    first = kvp("weights", "cpu-demo", "--json", env=env, timeout=300)
    assert first.returncode == 0, first.stderr
    data = json.loads(first.stdout)
    assert data["status"] == "first" and data["recorded_now"] == ""
    assert not Path(data["manifest"]).exists()  # only --record (or a launch) records
    rec = kvp("weights", "cpu-demo", "--record", env=env, timeout=300)
    assert rec.returncode == 0 and "recorded in" in rec.stderr, rec.stderr
    manifest = json.loads(Path(data["manifest"]).read_text())
    assert manifest["weights"]["fingerprint"] == data["current"]["fingerprint"] == expected()
    assert manifest["namespace"] == data["namespace"]

    ok = kvp("launch", "cpu-demo", "--check", "--no-vllm", env=env, timeout=300)
    assert ok.returncode == 0 and "matches" in ok.stderr, ok.stderr

    (m / "model-00002-of-00002.safetensors").write_bytes(os.urandom(1000))
    for args in (["weights", "cpu-demo"], ["launch", "cpu-demo", "--check"],
                 ["launch", "cpu-demo", "--check", "--no-vllm"],
                 ["launch", "cpu-demo", "--foreground", "--no-vllm"],
                 ["launch", "cpu-demo", "--no-vllm"]):
        res = kvp(*args, env=env, timeout=300)
        assert res.returncode == (1 if args[0] == "weights" else 2), (args, res.stderr)
        assert f"changed since {data['namespace']} was first served" in res.stderr, args
        assert "bump KVP_MODEL_REVISION, or restore them" in res.stderr
    state = Path(data["manifest"]).parent.parent
    assert not (state / "pids").exists()  # nothing was started
    assert json.loads(Path(data["manifest"]).read_text()) == manifest  # record unchanged

    missing = dict(env, KVP_MODEL_PATH=str(tmp_path / "none"))
    assert kvp("weights", "cpu-demo", env=missing, timeout=300).returncode == 2


def test_cli_weights_hub_blob_replaced_by_rename_is_changed(tmp_path: Path) -> None:
    """The finding as reported: ``kvp-admin weights`` said ``same`` (exit 0) for a blob
    replaced by rename with its mtime kept; only ``--rehash`` said ``changed``."""
    snap = hub(tmp_path / "hub")
    env = dict(clean_env(), KVP_CACHE_ROOT=str(tmp_path / "cache"), KVP_MODEL_PATH=str(snap))
    assert kvp("weights", "cpu-demo", "--record", env=env).returncode == 0
    assert json.loads(kvp("weights", "cpu-demo", "--json", env=env).stdout)["status"] == "same"
    name = "model-00001-of-00002.safetensors"
    _replace_by_rename_keeping_mtime(snap.parent.parent / "blobs" / sha(FILES[name]), b"ft")
    res = kvp("weights", "cpu-demo", "--json", env=env)
    assert res.returncode == 1, res.stderr
    data = json.loads(res.stdout)
    assert data["status"] == "changed" and data["comparison"]["changed"] == [name]


def test_weights_command_imports_nothing_heavy(tmp_path: Path) -> None:
    m = plain(tmp_path / "m")
    code = ("import runpy, sys\nsys.argv = ['kvp-admin', *sys.argv[1:]]\n"
            "try:\n    runpy.run_module('kvpersist.cli', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "heavy = [m for m in ('lmcache', 'torch', 'vllm', 'transformers')"
            " if m in sys.modules]\n"
            "print('HEAVY=' + ','.join(heavy), file=sys.stderr)\n")
    env = dict(clean_env(), KVP_CACHE_ROOT=str(tmp_path / "cache"), KVP_MODEL_PATH=str(m))
    res = subprocess.run([sys.executable, "-c", code, "weights", "cpu-demo", "--record"],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert "recorded in" in res.stderr, res.stderr
    assert res.stderr.rstrip().endswith("HEAVY="), res.stderr
