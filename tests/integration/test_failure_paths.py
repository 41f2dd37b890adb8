"""LMCache's L2 failure paths, provoked on purpose against a real server
(docs/lmcache-failure-paths.md; many more trials: bench/failure_paths.py).

A stock ``lmcache server`` runs the argv kvpersist renders (aesgcm, nixl_store_dynamic POSIX,
O_DIRECT) as a service user would (no DAC override); sequences of 16 chunks are stored by
LMCache's own client and, after a restart, live only in L2. While a prefetch runs, a chunk
file is truncated, unlinked, made unreadable or replaced by garbage (between the lookup and the
read: :func:`tests.integration._prefetch_faults.fifo_hold`), the server is SIGSTOPped past the
client's timeout, or a FIFO stalls the adapter. No retrieve ever returns bytes other than
those stored for the key (a miss, then a recompute, is fine) and LMCache writes no wrong
plaintext to L2, before or after a restart. A valid frame of another chunk put under a
chunk's name (a copy, a hard link, a symlink) IS served as that chunk's KV -- aesgcm does not
bind a frame to its name -- and ``kvp-admin verify --apply`` finds and quarantines every one
(and the damaged files), after which nothing wrong is served: after a restart each sequence
hits up to the quarantined chunk, and once recomputed it is stored afresh under its name.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvpersist.demo.kvdriver import Lookup
from tests.cli import kvp

from ..conftest import free_port
from ..fullstack._stack import wait_until
from ._prefetch_faults import (
    CHUNKS,
    Lab,
    Outcome,
    hang_trial,
    lab_env,
    run_trial,
    timeout_trial,
)

pytestmark = pytest.mark.integration

#: LMCache's own failure paths: the fault lands between the lookup and the read
FAILING = ("truncate", "unlink", "eacces", "random")
#: a valid frame of another chunk under the chunk's name
PLANTED = ("authentic", "hardlink", "symlink")


def test_failed_prefetches_never_serve_other_bytes_and_verify_quarantines_planted_frames(
        tmp_path: Path) -> None:
    rng = random.Random(5032)
    lab = Lab(tmp_path, lab_env(tmp_path / "cache", free_port))
    lab.start()
    try:
        failing = dict(zip(FAILING, range(1, 5), strict=True))
        planted_seqs = dict(zip(PLANTED, range(5, 8), strict=True))
        timeout_seq, hang_seq, other_seq, donor_seq = 8, 9, 10, 900
        with lab.driver() as d:
            lab.store(d, [*failing.values(), *planted_seqs.values(), timeout_seq, hang_seq,
                          other_seq, donor_seq])
        lab.restart()  # from here on every chunk is in L2 only
        outcomes: list[Outcome] = []
        with lab.driver() as d:
            for fault, seq in failing.items():
                o = run_trial(lab, d, seq, fault, "fifo", rng)
                outcomes.append(o)
                assert not o.notes and o.wrong == 0, o
                # the prefix before the faulted chunk is served (garbage that fails
                # authentication voids the whole load: LMCache's serde wrapper fails every key
                # of the task); after a recompute every chunk is served again, from L1
                assert o.after[0] == (0 if fault == "random" else o.chunk), o
                assert o.recomputed == (CHUNKS, True), o

            t = timeout_trial(lab, d, timeout_seq, 10.2, rng)
            assert t["during"] == [0, None] and t["after"] == [CHUNKS, True], t
            assert t["healthy"] and t["l1_read_locked"] >= CHUNKS, t  # orphaned until TTL

            h = hang_trial(lab, d, hang_seq, other_seq, 2.0)
            assert h["lookup"][:2] == [0, None], h  # the client gave up
            assert h["other_prefetch"]["status"] == "pending", h  # all of L2 is stalled...
            assert h["healthcheck_200"] and h["adapter_reported_healthy"], h  # ...unseen
            assert h["other_after_release"]["found_keys"] == CHUNKS, h
            assert h["after"] == [CHUNKS, True], h

            donors = list(lab.names[donor_seq])
            for fault, seq in planted_seqs.items():
                o = run_trial(lab, d, seq, fault, "race", rng, donors)
                outcomes.append(o)
                assert o.after == (CHUNKS, False), o  # served as that chunk's KV

            planted = {o.target: o.donor for o in outcomes if o.donor}
            audit = lab.audit_l2(planted)
            assert audit["written_other"] == 0 and audit["planted"] == len(PLANTED), audit

            # the mitigation: verify finds every planted frame (and the damaged files)
            r = kvp("verify", "cpu-demo", "--apply", "--json", env=lab.env)
            doc = json.loads(r.stdout)
            found = {Path(f["path"]).name: f["kind"] for f in doc["findings"]}
            by_target = {o.target: found.get(o.target) for o in outcomes}
            want = {"truncate": "size", "unlink": None, "eacces": "perm", "random": "auth",
                    "authentic": "dup", "hardlink": "dup", "symlink": "type"}
            assert {o.fault: by_target[o.target] for o in outcomes} == want, doc
            assert all(found[o.donor] == "dup" for o in outcomes
                       if o.fault in ("authentic", "hardlink")), doc
            assert len(doc["quarantined"]) == len(doc["findings"]) and r.returncode == 0, doc

            for o in outcomes:  # quarantined online: a miss where it was, never other bytes
                lk, got = d.lookup_and_retrieve(o.seq, prefix=True)
                assert got is None or got == lab.stored[o.seq][:len(got)], o
        lab.restart()
        with lab.driver() as d:
            for seq in (timeout_seq, hang_seq):
                assert d.lookup_and_retrieve(seq) == (Lookup(CHUNKS, CHUNKS), lab.stored[seq])
            for o in outcomes:
                # the prefix up to the chunk that was damaged or planted, and the stored bytes
                lk, got = d.lookup_and_retrieve(o.seq, prefix=True)
                assert (lk.hit_chunks, got) == (o.chunk, lab.stored[o.seq][:o.chunk]), o
                # recomputed (as vLLM does), the chunk is stored afresh under its name
                assert d.recompute(o.seq) == lab.stored[o.seq]
        assert lab.healthy()
        assert wait_until(lambda: all(lab.plaintext(o.target) == lab.plain[o.target]
                                      for o in outcomes), 30), lab.audit_l2()
    finally:
        lab.stop()
    # at rest: every chunk as stored, except the two sources of the copy and the hard link,
    # quarantined with them (which of two names holds the genuine frame cannot be told)
    assert lab.audit_l2() == {"same": len(lab.plain) - 2, "absent": 2, "fails": 0,
                              "planted": 0, "written_other": 0}
