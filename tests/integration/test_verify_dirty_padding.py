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
from pathlib import Path

import pytest

from kvpersist.l2.frames import FRAME_OVERHEAD
from tests.cli import kvp

from ..conftest import free_port
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
        with lab.driver() as d:  # until a sequence's worth of files is dirty
            seqs = lab.store_through_l1(d, lambda on_disk: len(dirty_files(lab, on_disk))
                                        >= CHUNKS)
        names = [n for s in seqs for n in lab.names[s]]
        lab.stop()
        kept = lab.present(names)
        dirty = dirty_files(lab, kept)
        print(f"\n{len(seqs)} sequences stored: {len(dirty)} of {len(kept)} chunk files have "
              "stale bytes in their padding")
        assert len(dirty) >= CHUNKS, "LMCache reused too little L1 memory: nothing to test"
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
