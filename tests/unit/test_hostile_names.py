"""Hostile file names under a cache root: names that are not UTF-8, carry control characters,
look almost like chunk files, are as long as the filesystem allows, or start with a dash.
Every command reads past them (they are foreign files: counted, shown escaped, never
touched) and none ends in a traceback. A namespace's chunk whose cache salt holds text vLLM
can send (a newline, an escape sequence: ``SALTED``) is the namespace's: counted in it, shown
escaped on a terminal and as it is in ``--json``, deleted by ``prune --namespace``; one whose
salt LMCache cannot have written (bytes that are not UTF-8, an ``@``: ``UNSENDABLE``) is
foreign (issue 40)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kvpersist.l2.layout import display_name

from ..cli import kvp
from ..conftest import clean_env, free_port
from ..l2_roots import scan_at

NS = "kvp-8a8877c212dbb9f802c2eb354e22b53a"  # cpu-demo's namespace
CHUNK = f"{NS}_01000100_0_".encode()

HOSTILE: list[bytes] = [
    b"x_\xff.bin", b"\xff", b"\xfe\xff", b"\xed\xa0\x80.bin", b"\xc3(", b"\x80abc",
    CHUNK + b"ab\xff.bin", CHUNK + b"\xffab.bin", CHUNK + b"abcd.bin.tmp.\xff",
    CHUNK + b"ABCD.bin", CHUNK + b"abcd.BIN", CHUNK + b"abcd.bin\n", b"\n" + CHUNK + b"ab.bin",
    f"{NS}_0100010_0_ab.bin".encode(), f"{NS}_01000100__ab.bin".encode(),
    f"{NS}_01000100_0_ab@.bin".encode(),
    b"a\nb", b"a\rb", b"\x1b[31mred\x1b[0m", b"\x07bell", b"tab\there", b"\x7f",
    b"-rf", b"--apply", b"-", b"--", b"$(id)", b"`id`", b"${HOME}", b"%s%n%x", b"'\"",
    b"\\", b"a\\xffb", "e\u0301".encode(), "\u00e9".encode(), "\u202eevil".encode(),
    "\u2028line".encode(), "\ufeffbom".encode(), b"x" * 255, b"." + b"y" * 254,
    b"name.tmp.", b".tmp.", b"lmcache-server.pid\xff", b".kvpersist\xff",
]
HOSTILE_DIRS: list[bytes] = [b"\xff\xfe", b"ab\xff", b"d\nir", b"-d", b"zz"]
#: chunks of another namespace (no deployment here uses it) whose salt (the client's
#: cache_salt, appended by LMCache as it is) holds a newline, an escape sequence and a "_"
SALTED_NS = "kvp-" + "12" * 16
_SC = f"{SALTED_NS}_01000100_0_".encode()
SALTED: list[bytes] = [_SC + b"ab@s\nt.bin", _SC + b"ab@\x1b[2J_01000100_0_cd.bin",
                       _SC + b"ab@q_01000100_0_ff.bin"]  # printable: the scan's fast path
#: named like the namespace's chunks, with a salt LMCache cannot have written: a byte that
#: is not UTF-8 (no request carries one) or a second "@" (LMCache refuses it)
UNSENDABLE: list[bytes] = [_SC + b"ab@s\xff.bin", _SC + b"ab@\xff\xfe.bin", _SC + b"ab@a@b.bin"]


def _populate(root: Path) -> list[bytes]:
    """Write every hostile name as a file (and a few as directories holding a file, a
    symlink and a hard link) under ``root``; return every path written, as bytes."""
    broot = os.fsencode(root)
    made: list[bytes] = []
    for i, name in enumerate(HOSTILE):
        p = os.path.join(broot, name)
        with open(p, "wb") as f:
            f.write(b"z" * (i + 1))
        made.append(p)
    for name in HOSTILE_DIRS:
        d = os.path.join(broot, name)
        os.mkdir(d, 0o700)
        inner = os.path.join(d, HOSTILE[0])
        with open(inner, "wb") as f:
            f.write(b"inner")
        os.symlink(b"/etc/passwd", os.path.join(d, b"link\xff"))
        os.link(inner, os.path.join(broot, b"hard-" + name.replace(b"/", b"_")))
        made += [inner, os.path.join(d, b"link\xff"),
                 os.path.join(broot, b"hard-" + name.replace(b"/", b"_"))]
    return made


def _salted(root: Path, names: list[bytes] = SALTED) -> list[bytes]:
    made = []
    for name in names:
        p = os.path.join(os.fsencode(root), name)
        with open(p, "wb") as f:
            f.write(os.urandom(4096))  # an aesgcm frame's size: verify authenticates it
        made.append(p)
    return made


@pytest.fixture
def hostile_root(tmp_path: Path) -> tuple[Path, list[bytes]]:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    return root, _populate(root)


def test_a_salt_holding_any_text_is_its_namespaces(hostile_root: tuple[Path, list[bytes]]
                                                    ) -> None:
    """Finding (issue 20): a salt with a newline made the chunk foreign, so ``report`` left
    it out of its namespace and ``prune --namespace`` left it behind while removing the
    namespace's manifest. Finding (issue 40): a salt of bytes that are not UTF-8 was called
    foreign by ``report`` and deleted by ``prune``; and ``--json`` showed a newline as
    ``\\x0a``, so what was reported could not be matched with what was deleted. Every other
    hostile name stays foreign."""
    root, made = hostile_root
    salted = _salted(root)
    foreign_before = scan_at(root).foreign.files
    foreign = _salted(root, UNSENDABLE)
    for workers in (1, 2):
        res = scan_at(root, workers=workers)
        assert res.chunk_files == len(SALTED), workers
        ns = res.prefixes[SALTED_NS]
        assert (ns.files, ns.bytes, ns.salted_files) == (len(SALTED), 4096 * len(SALTED),
                                                         len(SALTED))
        assert ns.salts == {"s\nt", "\x1b[2J_01000100_0_cd", "q_01000100_0_ff"}, ns.salts
    env = clean_env()
    env.update({"KVP_CACHE_ROOT": str(root), "KVP_L2_SERDE": "none"})
    doc = json.loads(kvp("report", "--root", str(root), "--json", env=env).stdout)
    [row] = [r for r in doc["namespaces"] if r["namespace"] == SALTED_NS]
    assert row["files"] == len(SALTED) and "s\nt" in row["salts"]  # a newline is a newline
    assert doc["foreign"]["files"] == foreign_before + len(UNSENDABLE)
    human = kvp("report", "--root", str(root), env=env)
    assert "s\\x0at" in human.stdout and "\x1b" not in human.stdout, human.stdout
    # verify derives the salt's key (HKDF over the salt's bytes); random bytes fail
    # authentication, named escaped on a terminal and as they are in --json
    keys = root.parent / ".kvpersist" / root.name / "keys"
    keys.mkdir(parents=True, mode=0o700)
    (keys / "l2-master.key").write_bytes(os.urandom(32))
    (keys / "l2-master.key").chmod(0o600)
    ver = kvp("verify", "cpu-demo", "--all-namespaces",
               "--json", env={**env, "KVP_L2_SERDE": "aesgcm"})
    assert ver.returncode == 1 and "Traceback" not in ver.stderr, ver.stderr
    findings = json.loads(ver.stdout)["findings"]
    assert sorted(os.fsencode(f["path"]) for f in findings) == sorted(salted)
    assert all(f["kind"] == "auth" for f in findings)
    human = kvp("verify", "cpu-demo", "--all-namespaces", env={**env, "KVP_L2_SERDE": "aesgcm"})
    assert "\x1b" not in human.stdout and "s\\x0at.bin" in human.stdout, human.stdout
    manifest = root / ".kvpersist" / "manifests" / f"{SALTED_NS}.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"schema": "kvpersist.manifest/1",
                                    "namespace": SALTED_NS}))
    listed = kvp("prune", "--namespace", SALTED_NS, "--root", str(root), "--list", env=env)
    assert listed.returncode == 0 and "\x1b" not in listed.stdout, listed.stderr
    assert all(line.isprintable() for line in listed.stdout.splitlines())
    assert f"{SALTED_NS}_01000100_0_ab@s\\x0at.bin" in listed.stdout, listed.stdout
    done = kvp("prune", "--namespace", SALTED_NS, "--root", str(root), "--apply", "--list",
                "--json", env=env)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["deleted"]["files"] == len(SALTED), done.stdout
    # the names deleted are the names planted, byte for byte
    assert sorted(os.fsencode(p) for p in out["files"]) == sorted(
        os.path.basename(p) for p in salted)
    assert not any(os.path.lexists(p) for p in salted)
    # the names LMCache cannot have written stay, and keep the manifest (no file left of
    # the namespace: removed with the last of them)
    assert all(os.path.lexists(p) for p in foreign)
    assert out["manifests_removed"] == [SALTED_NS] and not manifest.exists()
    assert all(os.path.lexists(p) for p in made)  # every foreign name is still there


def test_scan_counts_hostile_names_as_foreign_and_equals_du(
        hostile_root: tuple[Path, list[bytes]]) -> None:
    root, made = hostile_root
    for workers in (1, 2, 3):
        res = scan_at(root, workers=workers)
        du = subprocess.run(["du", "-s", "--apparent-size", "-b", os.fsencode(root)],
                            capture_output=True, check=True).stdout.split()[0]
        assert res.total_bytes == int(du), workers
        assert res.chunk_files == 0 and res.temp.files == 0
        for sample in res.foreign.samples + res.symlinks.samples:
            # the name as it is (PEP 383: os.fsencode gives its bytes back); shown escaped
            assert os.path.join(os.fsencode(root), os.fsencode(sample)) in made, sample
            display_name(sample).encode("utf-8")
            assert display_name(sample).isprintable(), sample
    assert res.symlinks.files == len(HOSTILE_DIRS)


COMMANDS: list[list[str]] = [
    ["report"], ["report", "--json"], ["report", "--config", "cpu-demo", "--json"],
    ["budget", "cpu-demo"], ["budget", "cpu-demo", "--json"], ["render", "cpu-demo"],
    ["render", "cpu-demo", "--json"], ["launch", "cpu-demo", "--check", "--no-vllm"],
    ["health", "cpu-demo", "--no-vllm", "--json"], ["health", "cpu-demo"],
    ["status", "cpu-demo"], ["verify", "cpu-demo"], ["verify", "cpu-demo", "--json"],
    ["prune", "--namespace", NS, "--list"], ["prune", "--stale", "--config", "cpu-demo"],
    ["prune", "--unpinned", "--config", "cpu-demo", "--json", "--list"],
    ["prune", "--to-budget", "--config", "cpu-demo", "--force", "--list"],
    ["prune", "--temp-older-than", "0s", "--list"],
    ["prune", "--namespace", NS, "--apply", "--force", "--config", "cpu-demo", "--list"],
    ["prune", "--temp-older-than", "0s", "--apply", "--list", "--json"],
    ["verify", "cpu-demo", "--apply", "--all-namespaces"],
]


def test_every_command_reads_past_hostile_names(hostile_root: tuple[Path, list[bytes]]
                                                ) -> None:
    root, made = hostile_root
    env = clean_env()
    env.update({"KVP_CACHE_ROOT": str(root), "KVP_LMCACHE_PORT": str(free_port()),
                "KVP_LMCACHE_HTTP_PORT": str(free_port()), "KVP_VLLM_PORT": str(free_port()),
                "KVP_L2_SERDE": "none", "KVP_L2_BUDGET": "1M", "KVP_L2_RESERVE": "0"})
    tried = 0
    for argv in COMMANDS:
        if argv[0] in ("report", "prune") and "--config" not in argv:
            argv = [*argv, "--root", str(root)]
        res = kvp(*argv, env=env)
        tried += 1
        out = res.stdout + res.stderr
        assert "Traceback" not in out, (argv, out)
        assert res.returncode in (0, 1, 2), (argv, res.returncode, out)
        if argv[0] in ("report", "prune") and res.returncode == 0:
            assert res.stdout.isprintable() or all(
                line.isprintable() for line in res.stdout.splitlines()), argv
        if "--json" in argv and res.returncode in (0, 1):
            json.loads(res.stdout)
    assert tried == len(COMMANDS)
    # nothing foreign was touched, not even by --apply
    for p in made:
        assert os.path.lexists(p), p
    doc = json.loads(kvp("report", "--root", str(root), "--json", env=env).stdout)
    assert doc["foreign"]["files"] >= len(HOSTILE)
