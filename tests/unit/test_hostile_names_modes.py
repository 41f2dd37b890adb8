"""Issue 40: one parser of chunk names decides for every command, in every selection mode.

Under a real cache root, next to real chunk and temp files of three namespaces (the active
``NS`` of cpu-demo, a stale one and an unpinned one; one salt holds a newline, one lies in a
shard directory), names LMCache cannot have written, made to look like those namespaces'
chunks: a salt of bytes that are not UTF-8 (the finding: ``report`` called it foreign and
``prune`` deleted it, 19 times over 24 scenarios and 26 over the warm-set variants), a salt
with a second ``@``, a backslash or 129 characters, an odd number of hash digits, a group
written ``00``, a hash in capitals, a temp name whose token is not a uuid4 hex. Everything is
40 days old, the budget is one byte and the maximum age 30 days, so every mode selects
everything it can.

Every prune mode (``--namespace``, ``--stale``, ``--unpinned``, ``--to-budget``,
``--older-than``, ``--max-age``, ``--temp-older-than``) runs with ``--apply`` on a fresh
root, with no warm set and with pin manifests that list ``../`` and absolute paths; then
``verify --apply``, ``scrub --apply``, ``shred --apply`` and ``forget --apply``. What
``report`` calls foreign is never deleted, renamed or written (its bytes are checked), and
the files a prune lists in ``--json`` are exactly, byte for byte, the files that are gone."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvpersist.l2.layout import ChunkName, parse_chunk_name, parse_temp_name

from ..cli import kvp
from ..conftest import clean_env, free_port
from ..hostile import HostileRunner, assert_all_bounded

NS = "kvp-8a8877c212dbb9f802c2eb354e22b53a"  # configs/cpu-demo: active
STALE = "kvp-" + "5a" * 16
UNPINNED = "kvp-unpinned-" + "0c" * 16
HASH = "ab" * 16
OLD_S = 40 * 86400


def lookalikes(prefix: str) -> list[bytes]:
    """Names that look like ``prefix``'s chunks but that LMCache cannot have written."""
    head = f"{prefix}_01000100_0_".encode()
    return [head + HASH.encode() + b"@\xff\xfe.bin", head + HASH.encode() + b"@s\xfft.bin",
            head + HASH.encode() + b"@a@b.bin", head + HASH.encode() + b"@a\\b.bin",
            head + HASH.encode() + b"@" + b"x" * 129 + b".bin", head + b"abc.bin",
            f"{prefix}_01000100_00_{HASH}.bin".encode(), head + HASH.upper().encode() + b".bin",
            head + HASH.encode() + b".bin.tmp.abcdef",
            head + HASH.encode() + b"@\xff.bin.tmp." + b"0f" * 16]


def real(prefix: str) -> list[bytes]:
    """Names LMCache writes for ``prefix``: plain, salted with a newline, in flight."""
    c = ChunkName(prefix, 0x01000100, 0, HASH)
    return [c.filename().encode(),
            ChunkName(prefix, 0x01000100, 0, "cd" * 16, "tenant\nB").filename().encode(),
            f"{c.filename()}.tmp.{'0f' * 16}".encode()]


def plant(root: Path) -> tuple[dict[bytes, str], dict[bytes, str]]:
    """(foreign path -> sha256, real path -> kind) under ``root``, all 40 days old."""
    broot = os.fsencode(root)
    foreign: dict[bytes, str] = {}
    chunks: dict[bytes, str] = {}
    shard = os.path.join(broot, b"ab", b"ab")
    os.makedirs(shard, 0o700)
    t = time.time() - OLD_S
    for prefix in (NS, STALE, UNPINNED):
        for name in lookalikes(prefix):
            p = os.path.join(broot, name)
            data = os.urandom(4096)
            with open(p, "wb") as f:
                f.write(data)
            os.utime(p, (t, t))
            foreign[p] = hashlib.sha256(data).hexdigest()
        for name in real(prefix):
            p = os.path.join(broot, name)
            with open(p, "wb") as f:
                f.write(os.urandom(4096))
            os.utime(p, (t, t))
            chunks[p] = "temp" if b".tmp." in name else "chunk"
        p = os.path.join(shard, f"{prefix}_01000100_0_{'ab' * 16}@\udcff.bin".encode(
            "utf-8", "surrogateescape"))
        with open(p, "wb") as f:
            f.write(b"s" * 4096)
        os.utime(p, (t, t))
        foreign[p] = hashlib.sha256(b"s" * 4096).hexdigest()
    return foreign, chunks


def check_untouched(foreign: dict[bytes, str]) -> None:
    for p, digest in foreign.items():
        with open(p, "rb") as f:
            assert hashlib.sha256(f.read()).hexdigest() == digest, p


def pins(root: Path, variant: str) -> None:
    """Pin manifests of every namespace: none, or ones naming ``../`` and absolute paths
    (refused whole: the namespace is held) next to the real chunk."""
    if variant == "none":
        return
    d = root / ".kvpersist" / "pins"
    d.mkdir(parents=True, exist_ok=True)
    for ns in (NS, STALE, UNPINNED):
        files = [ChunkName(ns, 0x01000100, 0, HASH).filename()]
        files += {"dotdot": ["../" + files[0], "../../etc/passwd"],
                  "absolute": ["/" + files[0], "/etc/passwd"]}[variant]
        (d / f"{ns}.json").write_text(json.dumps({
            "schema": "kvpersist.pins/1", "namespace": ns, "warm_file_sha256": "0" * 64,
            "world_size": 1, "chunk_size": 256, "hash_algorithm": "blake3",
            "shard_dirs": False, "chunks": 1, "created_ns": 1, "files": files}))


@pytest.fixture(scope="module")
def runner() -> Iterator[HostileRunner]:
    with HostileRunner() as h:
        yield h


def env_for(tmp: Path, root: Path) -> dict[str, str]:
    key = tmp / "l2-master.key"
    if not key.exists():
        key.write_bytes(os.urandom(32))
        key.chmod(0o600)
    env = clean_env()
    env.update({"KVP_CACHE_ROOT": str(root), "KVP_SERDE_KEY_FILE": str(key),
                "KVP_L2_BUDGET": "1", "KVP_L2_RESERVE": "0", "KVP_L2_MAX_AGE": "30d",
                "KVP_LMCACHE_PORT": str(free_port()), "KVP_LMCACHE_HTTP_PORT": str(free_port()),
                "KVP_VLLM_PORT": str(free_port())})
    return env


MODES: list[list[str]] = [
    ["--namespace", STALE], ["--namespace", UNPINNED], ["--namespace", NS, "--force"],
    ["--stale"], ["--unpinned"], ["--to-budget", "--force"], ["--older-than", "30d"],
    ["--max-age"], ["--temp-older-than", "0s"],
]


@pytest.mark.parametrize("variant", ["none", "dotdot", "absolute"])
def test_no_prune_mode_touches_a_name_that_does_not_parse(tmp_path: Path, variant: str,
                                                         runner: HostileRunner) -> None:
    outcomes = []
    for i, mode in enumerate(MODES):
        root = tmp_path / f"root{i}"
        root.mkdir(mode=0o700)
        foreign, chunks = plant(root)
        pins(root, variant)
        env = env_for(tmp_path, root)
        rep = runner.run("report", "--config", "cpu-demo", "--json", env=env)
        outcomes.append(rep)
        doc = json.loads(rep.stdout)
        assert doc["foreign"]["files"] == len(foreign), (mode, doc["foreign"])
        assert doc["chunk_files"] + doc["temp"]["files"] == len(chunks)
        o = runner.run("prune", "--config", "cpu-demo", *mode, "--apply", "--list", "--json",
                       env=env)
        outcomes.append(o)
        assert o.code == 0, (mode, o.stderr)
        out = json.loads(o.stdout)
        check_untouched(foreign)
        listed = {os.path.join(os.fsencode(root), os.fsencode(f)) for f in out["files"]}
        gone = {p for p in chunks if not os.path.lexists(p)}
        assert listed == gone, (mode, sorted(listed ^ gone))  # byte for byte
        assert out["deleted"]["files"] == len(gone)
        for p in gone:
            name = os.fsdecode(os.path.basename(p))
            assert parse_chunk_name(name) or parse_temp_name(name)
        if variant == "none" and mode[0] in ("--namespace", "--older-than", "--to-budget"):
            assert gone, mode  # the mode selected real files: it did delete
    assert_all_bounded(outcomes, allowed=(0,))


def test_verify_scrub_shred_and_forget_leave_them(tmp_path: Path,
                                                   runner: HostileRunner) -> None:
    root = tmp_path / "root"
    root.mkdir(mode=0o700)
    foreign, _ = plant(root)
    env = env_for(tmp_path, root)
    outcomes = [runner.run("verify", "cpu-demo", "--apply", "--all-namespaces", "--json",
                           env=env),
                runner.run("scrub", "cpu-demo", "--apply", "--json", env=env)]
    shred_env = {**env, "KVP_SERDE_KEY_FILE": ""}
    outcomes.append(runner.run("shred", "--config", "cpu-demo", "--namespace", STALE,
                               "--apply", "--json", env=shred_env))
    assert_all_bounded(outcomes, allowed=(0, 1))
    for o in outcomes:
        json.loads(o.stdout)
    # forget imports LMCache's key code (numpy: more address space than the harness grants)
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(list(range(1, 600))))
    forgot = kvp("forget", "cpu-demo", "--token-ids", str(ids), "--apply", "--json", env=env)
    assert forgot.returncode == 0 and "Traceback" not in forgot.stderr, forgot.stderr
    json.loads(forgot.stdout)
    check_untouched(foreign)
    verified = json.loads(outcomes[0].stdout)
    assert not any(b"@\xff" in os.fsencode(f["path"]) for f in verified["findings"])
