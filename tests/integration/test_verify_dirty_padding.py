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
        seqs = list(range(1, 25))  # 192 MiB of KV through 128 MiB of L1
        with lab.driver() as d:
            for s in seqs:
                lab.stored[s] = d.store(s)
                lab.names[s] = lab.chunk_names(s)
                time.sleep(0.5)  # on disk before L1 reuses the memory (else some are dropped)
        names = [n for s in seqs for n in lab.names[s]]
        seen: list[int] = []  # the stores in flight land: the count stays for 2 s
        assert wait_until(lambda: seen.append(len(present(lab, names))) or
                          (len(seen) > 4 and seen[-1] == seen[-5]), 60, 0.5), seen
        lab.stop()
        kept = present(lab, names)
        for n in sorted(kept, key=lambda n: lab.plaintext(n) is None):  # clean ones first
            digest = lab.plaintext(n)
            assert digest is not None, f"{n} fails authentication with the known length"
            lab.plain[n] = digest
        plain = lab.frame_plaintext
        assert plain is not None
        dirty = {n for n in kept if _dirty(lab.root / n, plain)}
        print(f"\n{len(dirty)} of {len(kept)} chunk files have stale bytes in their padding")
        assert len(dirty) >= CHUNKS, "LMCache reused no L1 memory: nothing to test"
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
