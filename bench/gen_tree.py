#!/usr/bin/env python3
"""Generate a realistic synthetic LMCache L2 tree for inventory benchmarks.

Files are named exactly as LMCache 0.5.6's nixl_store_dynamic adapter names them (via
kvpersist.l2.layout.ChunkName, which the unit tests cross-check against LMCache's own functions):
several namespaces with different TP degrees (one file per rank per chunk), an unpinned
namespace, a ``test-model`` prefix, a few salted chunks, in-flight temp files and foreign files.
Chunk files are sparse (``ftruncate`` to the chunk size): the apparent sizes are realistic and
the disk holds nothing, which is fine for measuring a metadata scan.

    python bench/gen_tree.py ROOT --files 1000000 [--shard-dirs] [--jobs 2]
    python bench/gen_tree.py ROOT --files 250000 --only-namespace kvp-...  (refill one namespace)
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvpersist.l2.layout import ChunkName, temp_name  # noqa: E402

CHUNK_BYTES = 4 * 1024 * 1024  # 256 tokens of a mid-size model: ~4 MiB per rank


def namespaces(n: int) -> list[tuple[str, int]]:
    """(prefix, TP degree) of the synthetic deployments: pinned ones, one unpinned, test-model."""
    tps = [1, 2, 4, 8]
    out = [(f"kvp-{hashlib.sha256(f'ns{i}'.encode()).hexdigest()[:32]}", tps[i % len(tps)])
           for i in range(max(1, n - 2))]
    out.append((f"kvp-unpinned-{hashlib.sha256(b'unpinned').hexdigest()[:32]}", 1))
    out.append(("test-model", 1))
    return out[:n] if n >= 1 else out[:1]


def plan_names(files: int, nss: list[tuple[str, int]], shard_dirs: bool,
               only: str | None) -> list[str]:
    """Relative paths of all files (chunks first, then temp and foreign extras)."""
    per_ns = files // len(nss) if only is None else files
    out: list[str] = []
    for k, (prefix, tp) in enumerate(nss):
        if only is not None and prefix != only:
            continue
        chunks = per_ns // tp
        for c in range(chunks):
            digest = hashlib.blake2b(f"{prefix}/{c}".encode(), digest_size=32).hexdigest()
            salt = "tenant-7" if c % 997 == 0 else None
            for r in range(tp):
                kv = tp << 24 | r << 16 | tp << 8 | r
                name = ChunkName(prefix, kv, 0, digest, salt)
                out.append(name.relpath(shard_dirs))
        if only is None and k == 0:
            # a handful of in-flight / crashed writes
            for t in range(max(1, files // 20000)):
                digest = hashlib.blake2b(f"tmp/{t}".encode(), digest_size=32).hexdigest()
                tmp_chunk = ChunkName(prefix, 0x01000100, 0, digest)
                rel = temp_name(tmp_chunk, f"{t:032x}")
                out.append(f"{digest[:2]}/{digest[2:4]}/{rel}" if shard_dirs else rel)
    if only is None:
        out += [f"foreign-{i}.txt" for i in range(max(1, files // 50000))]
    return out


def _make(args: tuple[str, list[str], int]) -> int:
    root, rels, size = args
    made_dirs: set[str] = set()
    for rel in rels:
        d = os.path.dirname(rel)
        if d and d not in made_dirs:
            os.makedirs(os.path.join(root, d), exist_ok=True)
            made_dirs.add(d)
        fd = os.open(os.path.join(root, rel), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if size:
                os.ftruncate(fd, size)
        finally:
            os.close(fd)
    return len(rels)


def generate(root: Path, files: int, *, n_namespaces: int = 6, shard_dirs: bool = False,
             jobs: int = 2, size: int = CHUNK_BYTES, only: str | None = None) -> int:
    """Create the tree; returns the number of files created."""
    root.mkdir(parents=True, exist_ok=True)
    rels = plan_names(files, namespaces(n_namespaces), shard_dirs, only)
    step = 20000
    batches = [(str(root), rels[i:i + step], size) for i in range(0, len(rels), step)]
    with Pool(jobs) as pool:
        return sum(pool.map(_make, batches))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--files", type=int, default=1_000_000)
    ap.add_argument("--namespaces", type=int, default=6)
    ap.add_argument("--shard-dirs", action="store_true")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--size", type=int, default=CHUNK_BYTES)
    ap.add_argument("--only-namespace", default=None)
    a = ap.parse_args()
    n = generate(a.root, a.files, n_namespaces=a.namespaces, shard_dirs=a.shard_dirs,
                 jobs=a.jobs, size=a.size, only=a.only_namespace)
    print(f"created {n:,} files under {a.root}")


if __name__ == "__main__":
    main()
