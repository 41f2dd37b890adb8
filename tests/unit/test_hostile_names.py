"""Hostile file names under a cache root: names that are not UTF-8, carry control characters,
look almost like chunk files, are as long as the filesystem allows, or start with a dash.
Every command reads past them (they are foreign files: counted, shown escaped, never
touched) and none ends in a traceback."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

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
    f"{NS}_01000100_0_ab@.bin".encode(), CHUNK + b"ab@s\xff.bin", CHUNK + b"ab@s\nt.bin",
    b"a\nb", b"a\rb", b"\x1b[31mred\x1b[0m", b"\x07bell", b"tab\there", b"\x7f",
    b"-rf", b"--apply", b"-", b"--", b"$(id)", b"`id`", b"${HOME}", b"%s%n%x", b"'\"",
    b"\\", b"a\\xffb", "e\u0301".encode(), "\u00e9".encode(), "\u202eevil".encode(),
    "\u2028line".encode(), "\ufeffbom".encode(), b"x" * 255, b"." + b"y" * 254,
    b"name.tmp.", b".tmp.", b"lmcache-server.pid\xff", b".kvpersist\xff",
]
HOSTILE_DIRS: list[bytes] = [b"\xff\xfe", b"ab\xff", b"d\nir", b"-d", b"zz"]


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


@pytest.fixture
def hostile_root(tmp_path: Path) -> tuple[Path, list[bytes]]:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    return root, _populate(root)


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
            sample.encode("utf-8")  # printable, strict UTF-8
            assert sample.isprintable(), sample
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
