"""Make LMCache's L2 prefetches fail mid-flight, many times, and count what every later
lookup returned (docs/lmcache-failure-paths.md).

For every fault of ``tests/integration/_prefetch_faults.py`` (truncated, unlinked, unreadable,
replaced by garbage, overwritten in place, replaced by another chunk's valid frame: a copy, a
rename, a hard link, a symbolic link) and every way of timing it against the prefetch (a FIFO
that holds the adapter between lookup and read, SIGSTOP of the server, a plain race), on
fresh sequences of 16 chunks stored by LMCache's own client and only in L2 (the server was
restarted since): the lookup during the fault, the lookup after it, a recompute and store of
the sequence when it no longer hit fully (what vLLM does after a miss) and a lookup after
that; then a clean restart and each sequence once more; then every chunk file is decrypted
with the deployment's key and compared with its plaintext at store time, and
``kvp-admin verify``'s check runs over the root. Separately: the server SIGSTOPped for 12 s
mid-prefetch (past the client's 10 s RPC timeout, as past the ``mq_timeout`` kvpersist
renders for vLLM); a FIFO nobody writes to under a chunk name (the adapter stalls); the
server stopped (SIGTERM) while a load is in flight, then started again.

usage: python bench/failure_paths.py [--trials 3] [--timeouts 2] [--shutdowns 2] [--out FILE]
Prints and writes (``--out``) one JSON document: totals per fault and hold, and every trial.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.integration._prefetch_faults import (  # noqa: E402
    CHUNKS,
    FAULTS,
    HOLDS,
    PLANTING,
    Lab,
    Outcome,
    final_pass,
    hang_trial,
    lab_env,
    run_trial,
    shutdown_trial,
    timeout_trial,
)


def _summary(outcomes: list[Outcome]) -> dict[str, Any]:
    by: dict[str, Counter[str]] = {}
    for o in outcomes:
        c = by.setdefault(f"{o.fault}/{o.hold}", Counter())
        c["trials"] += 1
        c["wrong_bytes"] += o.wrong
        c["during_full_hit"] += o.during[0] == CHUNKS
        c["during_partial"] += 0 < o.during[0] < CHUNKS
        c["during_miss"] += o.during[0] == 0
        c["after_full_hit"] += o.after[0] == CHUNKS
        c["recomputed_full_hit"] += o.recomputed is not None and o.recomputed[0] == CHUNKS
        c["final_full_hit"] += o.final[0] == CHUNKS
        c["final_past_fault"] += o.final[0] > o.chunk
        c["notes"] += len(o.notes)
    return {k: dict(v) for k, v in sorted(by.items())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3, help="trials per fault and hold")
    ap.add_argument("--timeouts", type=int, default=2, help="12 s SIGSTOP trials")
    ap.add_argument("--shutdowns", type=int, default=2, help="SIGTERM mid-prefetch trials")
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--holds", default=",".join(HOLDS))
    ap.add_argument("--seed", type=int, default=21)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--server-log", type=Path, help="keep a copy of the server's log here")
    a = ap.parse_args()
    faults, holds = a.faults.split(","), a.holds.split(",")
    rng = random.Random(a.seed)
    plan = [(f, h) for _ in range(a.trials) for f in faults for h in holds]
    planting = sum(f in PLANTING for f, _ in plan)
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="kvp-failure-paths-") as tmp:
        from kvpersist.system.procs import free_port

        lab = Lab(Path(tmp), lab_env(Path(tmp) / "cache", free_port))
        lab.start()
        try:
            seqs = list(range(1, len(plan) + 1))
            n = len(plan)
            timeout_seqs = list(range(n + 1, n + a.timeouts + 1))
            hang_seq, other_seq = n + a.timeouts + 1, n + a.timeouts + 2
            shutdown_seqs = list(range(n + a.timeouts + 3, n + a.timeouts + 3 + a.shutdowns))
            donor_seqs = list(range(900, 901 + (planting + CHUNKS - 1) // CHUNKS))
            with lab.driver() as d:
                lab.store(d, seqs + timeout_seqs + [hang_seq, other_seq] + shutdown_seqs
                          + donor_seqs)
            donors = [nm for s in donor_seqs for nm in lab.names[s]]
            lab.restart()  # every sequence is now only in L2
            outcomes: list[Outcome] = []
            timeouts: list[dict[str, Any]] = []
            with lab.driver() as d:
                for (fault, hold), seq in zip(plan, seqs, strict=True):
                    o = run_trial(lab, d, seq, fault, hold, rng, donors)
                    outcomes.append(o)
                    print(json.dumps(o.to_dict()), flush=True)
                for seq in timeout_seqs:
                    t = timeout_trial(lab, d, seq, 12.0, rng)
                    timeouts.append(t)
                    print(json.dumps(t), flush=True)
                hang = hang_trial(lab, d, hang_seq, other_seq, 5.0)
                print(json.dumps(hang), flush=True)
                planted = {o.target: o.donor for o in outcomes if o.donor}
                during_l2 = lab.audit_l2(planted)
            shutdowns: list[dict[str, Any]] = []
            for seq in shutdown_seqs:  # the in-flight clean-up at stop (#5032's second site)
                with lab.driver() as d:
                    shutdowns.append(shutdown_trial(lab, d, seq))
                lab.start()
                with lab.driver() as d:
                    lk, got = d.lookup_and_retrieve(seq, prefix=True)
                shutdowns[-1]["after_restart"] = [
                    lk.hit_chunks, None if got is None else got == lab.stored[seq][:len(got)]]
                print(json.dumps(shutdowns[-1]), flush=True)
            lab.restart()
            with lab.driver() as d:
                final_pass(lab, d, outcomes)
            served_after_restart = lab.healthy()
            lab.stop()
            after_l2 = lab.audit_l2(planted)
            from kvpersist.l2.keys import store as keys
            from kvpersist.l2.tree import open_root
            from kvpersist.l2.verify.root import verify_root

            with open_root(lab.root, purpose="verify") as r:
                v = verify_root(r, lab.ns, key=keys.read_key(lab.plan.serde_key_file),
                                rate_mb_s=None)
            verify_targets = {Path(f.path).name: f.kind for f in v.findings}
        finally:
            if lab.proc is not None and lab.proc.poll() is None:
                lab.stop()
            if a.server_log:
                a.server_log.write_bytes(lab.log.read_bytes())
    doc = {
        "schema": "kvpersist.bench.failure-paths/1",
        "lmcache": _version("lmcache"), "nixl": _version("nixl"),
        "trials": len(outcomes), "timeout_trials": len(timeouts),
        "wrong_bytes_retrieves": sum(o.wrong for o in outcomes),
        "wrong_bytes_by_fault": dict(Counter(o.fault for o in outcomes for _ in range(o.wrong))),
        "l2_before_restart": during_l2, "l2_after_restart": after_l2,
        "served_after_restart": served_after_restart,
        "verify_findings": dict(Counter(f.kind for f in v.findings)),
        "verify_finds_by_fault": dict(Counter(
            f"{o.fault}:{verify_targets.get(o.target, 'none')}" for o in outcomes)),
        "verify_authenticated": v.authenticated, "verify_files": v.files,
        "by_fault_and_hold": _summary(outcomes),
        "timeouts": timeouts, "hang": hang, "shutdowns": shutdowns,
        "seconds": round(time.monotonic() - t0, 1),
        "outcomes": [o.to_dict() for o in outcomes],
    }
    text = json.dumps(doc, indent=1, sort_keys=True)
    print(text)
    if a.out:
        a.out.write_text(text + "\n")


def _version(dist: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return "absent"


if __name__ == "__main__":
    main()
