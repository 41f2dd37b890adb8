"""The padding leak closed: after a few hundred stores through a small L1, no published chunk
file's bytes after the frame hold a 64-byte run of another chunk's plaintext once the scrub
ran, and LMCache still serves every scrubbed chunk with the bytes stored.

A stock ``lmcache server`` (the argv kvpersist renders for the cpu-demo deployment: aesgcm,
``nixl_store_dynamic`` on POSIX, a 128 MiB L1 that LMCache reuses all the time) stores
sequences through LMCache's own client. Before the scrub the padding of many files holds
plaintext KV of other chunks (measured: :mod:`tests.integration._padding_leak`); then
``kvp-admin scrub cpu-demo --apply`` runs while the server serves lookups of the same chunks
(as the deployment's timer runs it), and every file's padding is zeros, its frame (and its
plaintext, size and mtime) unchanged; ``kvp-admin verify --apply`` (which scrubs too) then
finds every file valid and nothing left to zero, reading only the padding; after a restart of the
server every sequence hits from disk with the bytes stored.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from kvpersist.l2.frames import frame_end
from tests.cli import kvp

from ..conftest import free_port
from ._padding_leak import measure
from ._prefetch_faults import CHUNKS, Lab, lab_env

pytestmark = pytest.mark.integration


def test_scrub_leaves_no_plaintext_after_any_frame_and_lmcache_serves_every_chunk(
        tmp_path: Path) -> None:
    env = lab_env(tmp_path / "cache", free_port)
    env["KVP_L1_SIZE_GB"] = "0.125"
    lab = Lab(tmp_path, env)
    lab.start()
    try:
        with lab.driver() as d:  # until a file's padding holds another chunk's plaintext
            seqs = lab.store_through_l1(
                d, lambda on_disk: measure([lab.root / n for n in sorted(on_disk)],
                                           lab.key).leaking > 0)
        names = [n for s in seqs for n in lab.names[s]]
        kept = sorted(lab.present(names))
        paths = [lab.root / n for n in kept]
        before = measure(paths, lab.key)
        print(f"\n{len(seqs)} sequences stored; before the scrub: {before.line()}")
        assert before.unauthenticated == 0
        assert before.leaking > 0, "LMCache reused no L1 memory: nothing to test"
        plain = {n: lab.plaintext(n) for n in kept}
        dirty = set(before.dirty_names)
        stat0 = {n: (lab.root / n).stat() for n in kept}

        wrong: list[str] = []
        stop = threading.Event()

        def serve() -> None:  # LMCache reads the same files while the scrub writes
            with lab.driver() as d:
                while not stop.is_set():
                    for s in seqs:
                        lk, got = d.lookup_and_retrieve(s, prefix=True)
                        if got and got != lab.stored[s][:len(got)]:
                            wrong.append(f"sequence {s}: {lk}")
                        if stop.is_set():
                            return

        reader = threading.Thread(target=serve)
        reader.start()
        try:
            r = kvp("scrub", "cpu-demo", "--apply", "--json", env=lab.env)
        finally:
            stop.set()
            reader.join(120)
        doc = json.loads(r.stdout)
        assert r.returncode == 0, (r.stdout, r.stderr)
        assert doc["schema"] == "kvpersist.scrub/1" and doc["skipped"] == [], doc
        print(f"scrub: {doc['files']} files, {doc['scrubbed']} zeroed, {doc['clean']} clean, "
              f"{doc['bytes_zeroed']} bytes zeroed, {doc['bytes_read']} bytes read, "
              f"{doc['seconds']:.2f} s")
        assert doc["files"] == len(kept) and doc["scrubbed"] == before.dirty
        assert doc["unauthenticated"] == 0
        assert not wrong, wrong[:3]

        after = measure(paths, lab.key)
        print(f"after the scrub: {after.line()}")
        assert after.leaking == 0 and after.leaking_own == 0 and after.dirty == 0, after
        n = lab.frame_plaintext
        assert n is not None
        for name in kept:
            st = (lab.root / name).stat()
            assert (st.st_ino, st.st_size, st.st_mtime_ns) == (
                stat0[name].st_ino, stat0[name].st_size, stat0[name].st_mtime_ns), name
            assert lab.plaintext(name) == plain[name], f"{name}: the frame changed"
            assert not any((lab.root / name).read_bytes()[frame_end(n):])

        # verify --apply (which scrubs too) finds every file valid and nothing left to zero
        v = json.loads(kvp("verify", "cpu-demo", "--apply", "--json", env=lab.env).stdout)
        assert v["findings"] == [] and v["authenticated"] == len(kept), v["findings"][:3]
        again = v["scrub"]
        assert again["scrubbed"] == 0 and again["clean"] == len(kept), again
        # one file read whole to learn the frame length, then the padding of each file alone
        assert again["bytes_read"] <= stat0[kept[0]].st_size + len(kept) * 4096, again

        lab.restart()  # L1 empty: every chunk comes from its scrubbed file
        served = served_dirty = 0
        with lab.driver() as d:
            for s in seqs:
                lead = next((i for i, m in enumerate(lab.names[s]) if m not in kept), CHUNKS)
                lk, got = d.lookup_and_retrieve(s, prefix=True)
                assert lk.hit_chunks == lead and (got or []) == lab.stored[s][:lead], s
                served += lead
                served_dirty += sum(1 for m in lab.names[s][:lead] if m in dirty)
        print(f"after a restart: {served} of {len(kept)} chunk files served as stored, "
              f"{served_dirty} of the {len(dirty)} scrubbed (each sequence up to its first "
              "chunk not on disk)")
        assert served_dirty > 0
    finally:
        lab.stop()

