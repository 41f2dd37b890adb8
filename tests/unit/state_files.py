"""Hostile variants of a file kvpersist reads, planted for real (FIFOs, links, devices,
sparse files), and a relocated cpu-demo deployment to plant them in.

Used by tests/unit/test_hostile_state_dir.py; each variant is one way a state file can be
what kvpersist did not write.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvpersist.config.loader import load_deployment
from kvpersist.stack.locate import Location, locate

from ..conftest import clean_env, free_port
from ..hostile import Outcome

#: far past every cap of a state file (pins and token caches 16 MiB, state 4 MiB, records
#: 64 KiB); sparse, so it costs no disk
SPARSE_BYTES = 300 << 20
DEEP = 100_000


@dataclass(frozen=True)
class Docs:
    """What a variant is made of, for one kind of file: a good document (the target of the
    "link to a good file" variant) and one with a field of the wrong type."""

    good: bytes
    wrong_field: bytes


def plant(path: Path, kind: str, docs: Docs) -> None:
    """Put the variant ``kind`` of a file at ``path`` (its directory created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link_to_dev_zero":
        os.symlink("/dev/zero", path)
    elif kind == "link_to_a_good_file":
        good = path.parent / f"good-{path.name}"
        good.write_bytes(docs.good)
        os.symlink(good, path)
    elif kind == "directory":
        path.mkdir()
    elif kind == "oversize_sparse":
        with open(path, "wb") as f:
            f.truncate(SPARSE_BYTES)
    else:
        path.write_bytes(CONTENT.get(kind, docs.wrong_field))


CONTENT = {
    "nested_100000": b"[" * DEEP + b"]" * DEEP,
    "nested_65": b"[" * 65 + b"]" * 65,
    "json_list": b"[1, 2, 3]",
    "json_string": b'"a string"',
    "json_number": b"12",
    "nan": b'{"schema": NaN}',
    "1e309": b'{"schema": 1e309}',
    "not_utf8": b'{"schema": "\xff\xfe"}',
    "empty": b"",
}
KINDS = ("fifo", "link_to_dev_zero", "link_to_a_good_file", "directory", "oversize_sparse",
         *CONTENT, "wrong_field")


def relocated(tmp: Path, **extra: str) -> tuple[dict[str, str], Location]:
    """cpu-demo with its cache root at ``tmp/cache`` (made, 0700), free ports and serde
    ``none`` (no key needed): the environment for the CLI, and where its files are."""
    root = tmp / "cache"
    tmp.mkdir(parents=True, exist_ok=True)
    root.mkdir(mode=0o700, exist_ok=True)
    env = {**clean_env(), "KVP_CACHE_ROOT": str(root), "KVP_LMCACHE_PORT": str(free_port()),
           "KVP_LMCACHE_HTTP_PORT": str(free_port()), "KVP_VLLM_PORT": str(free_port()),
           "KVP_L2_SERDE": "none", **extra}
    return env, locate(load_deployment("cpu-demo", env))


def json_doc(doc: object) -> bytes:
    return json.dumps(doc).encode()


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every regular file below ``root`` by relative path: (inode, size)."""
    out = {}
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_ino, st.st_size)
    return out


def summary(what: str, outcomes: Sequence[Outcome],
            inputs: int, kinds: Sequence[str] = KINDS) -> str:
    """One line of figures: inputs, runs, outcomes by exit code, max RSS, slowest."""
    codes = Counter(o.code for o in outcomes)
    slowest = max(outcomes, key=lambda o: o.seconds)
    return (f"{what}: {inputs} hostile inputs ({len(kinds)} kinds), {len(outcomes)} runs, "
            f"exit codes {dict(sorted(codes.items(), key=lambda kv: str(kv[0])))}, "
            f"max RSS {max(o.maxrss_kb for o in outcomes) >> 10} MiB, slowest "
            f"{slowest.seconds:.2f} s (kvp-admin {' '.join(slowest.argv[:2])}), "
            f"most output {max(o.out_bytes + o.err_bytes for o in outcomes):,} bytes")

