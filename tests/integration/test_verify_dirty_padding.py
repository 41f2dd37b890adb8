"""``verify`` keeps valid chunk files whose padding LMCache filled with stale L1 bytes, even
when every file of the namespace is such a file (nothing clean to learn the frame length from).

Found by the 60-minute soak (bench/soak.py, a small L1): its ``verify --apply`` timer
quarantined 522 valid files as ``auth`` findings; every one authenticated with the
namespace's plaintext length. Here a stock ``lmcache server`` (the argv kvpersist renders,
aesgcm, a 128 MiB L1 so that LMCache reuses its memory) stores sequences through LMCache's own
client; the files whose padding is clean are removed from the test's cache root, and
``kvp-admin verify --apply`` must find nothing in what is left; after a restart of the server,
each sequence still hits, with the bytes stored, up to its first file that was removed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from kvpersist.l2.frames import FRAME_OVERHEAD
from tests.cli import kvp

from ..conftest import free_port
from ..fullstack._stack import wait_until
from ._prefetch_faults import CHUNKS, Lab, lab_env

pytestmark = pytest.mark.integration

def _dirty(path: Path, plain: int) -> bool:
    """Whether the bytes after the frame (``plain`` bytes of plaintext) are not all zero."""
    return any(path.read_bytes()[FRAME_OVERHEAD + plain:])


def test_verify_keeps_valid_files_whose_padding_is_all_dirty(tmp_path: Path) -> None:
    env = lab_env(tmp_path / "cache", free_port)
    env["KVP_L1_SIZE_GB"] = "0.125"
    lab = Lab(tmp_path, env)
    lab.start()
    try:
        # LMCache reuses its L1 memory only once 128 MiB are in it, and how many frames land
        # on stale bytes after that varies (24 sequences left 7, then 23, dirty files in two
        # runs): store 8 MiB sequences, 12 at a time, until a sequence's worth of files is
        # dirty (at most 72 sequences, 576 MiB)
        seqs: list[int] = []
        rounds: list[tuple[int, int, int]] = []  # (sequences, files, dirty files)
        with lab.driver() as d:
            while len(seqs) < 72 and (not rounds or rounds[-1][2] < CHUNKS):
                for s in range(len(seqs) + 1, len(seqs) + 13):
                    lab.stored[s] = d.store(s)
                    lab.names[s] = lab.chunk_names(s)
                    seqs.append(s)
                    time.sleep(0.5)  # on disk before L1 reuses the memory (else dropped)
                names = [n for s in seqs for n in lab.names[s]]
                settle(lab, names)
                rounds.append((len(seqs), len(present(lab, names)),
                               len(dirty_files(lab, present(lab, names)))))
        print(f"\nstored, on disk, dirty: {rounds}")
        lab.stop()
        kept = present(lab, names)
        dirty = dirty_files(lab, kept)
        print(f"{len(dirty)} of {len(kept)} chunk files have stale bytes in their padding")
        assert len(dirty) >= CHUNKS, f"LMCache reused too little L1 memory: {rounds}"
        for n in kept - dirty:
            (lab.root / n).unlink()
        r = kvp("verify", "cpu-demo", "--apply", "--json", env=lab.env)
        doc = json.loads(r.stdout)
        assert doc["findings"] == [] and doc["quarantined"] == [], doc["findings"][:3]
        assert doc["authenticated"] == len(dirty) and r.returncode == 0, doc
        assert all(lab.plaintext(n) == lab.plain[n] for n in dirty)
        lab.start()  # LMCache serves them: each sequence hits up to its first file not kept
        with lab.driver() as d:
            for s in seqs:
                lead = next((i for i, n in enumerate(lab.names[s]) if n not in dirty), CHUNKS)
                lk, got = d.lookup_and_retrieve(s, prefix=True)
                assert lk.hit_chunks == lead and (got or []) == lab.stored[s][:lead], s
    finally:
        lab.stop()


def present(lab: Lab, names: list[str]) -> set[str]:
    return {n for n in names if (lab.root / n).exists()}


def settle(lab: Lab, names: list[str]) -> None:
    """Wait until the stores in flight have landed: the count of files stays for 2 s."""
    seen: list[int] = []
    assert wait_until(lambda: seen.append(len(present(lab, names))) or
                      (len(seen) > 4 and seen[-1] == seen[-5]), 60, 0.5), seen


def dirty_files(lab: Lab, names: set[str]) -> set[str]:
    """The files of ``names`` that authenticate and hold stale bytes after their frame; each
    authenticated file's plaintext digest is recorded in ``lab.plain``. The clean ones are
    read first: they tell the frame's length, which a dirty file's padding hides."""
    for n in sorted(names, key=lambda n: lab.plaintext(n) is None):
        digest = lab.plaintext(n)
        assert digest is not None, f"{n} fails authentication with the known length"
        lab.plain[n] = digest
    plain = lab.frame_plaintext
    assert plain is not None
    return {n for n in names if _dirty(lab.root / n, plain)}
