"""One canary run against the deployment's running vLLM, and its record.

:func:`run_canary`: read the namespace's record (:mod:`kvpersist.stack.canary.record`); make
the prompt once (the deployment's chat template and tokenizer, through vLLM); ask vLLM for it
**unsalted**, exactly as a user's request is served (a new vLLM process has nothing in its own
prefix cache, so what the last process stored comes back from the cache server: the LMCache
#4492 path); the first time, compute the reference under a fresh cache salt; compare
(:mod:`kvpersist.stack.canary.verdict`); append the run to the record, which keeps a failure
until ``kvp-admin canary reset``. A run that cannot compare (vLLM down or busy past the
request timeout, an answer without logprobs, an unreadable record) is ``unknown``.

A namespace whose record has failed is not probed again: vLLM then runs without the cache
connector (``render`` leaves it out), so a run would prove nothing about the cache path.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvpersist.stack.canary import probe
from kvpersist.stack.canary.record import (
    Record,
    now_iso,
    read_record,
    record_owner,
    write_record,
)
from kvpersist.stack.canary.verdict import (
    FAILED,
    PASSED,
    PATH_COMPUTED,
    PATH_LMCACHE,
    PATH_UNKNOWN,
    PATH_VLLM,
    UNKNOWN,
    Verdict,
    compare,
    served_path,
    unknown,
)
from kvpersist.stack.canary.warm_sample import SampleRun, sample
from kvpersist.stack.locate import Location
from kvpersist.system.http_client import Unreachable
from kvpersist.system.untrusted import UnreadableFile

SKIPPED = "skipped"

_PATH_WORDS = {
    PATH_LMCACHE: "from the cache server",
    PATH_VLLM: "from vLLM's own prefix cache",
    PATH_COMPUTED: "computed and stored (retrieved by the next vLLM process)",
    PATH_UNKNOWN: "from an unreported path",
}
_TIER_WORDS = {"l2": " (L2: the server started empty)", "l1": " (the running server's L1 or L2)"}


@dataclass(frozen=True)
class CanaryRun:
    """What one run found. ``state``: passed, failed, unknown, or skipped (off, or the
    namespace failed earlier: see ``failed_since``)."""

    state: str
    when: str
    path: str = PATH_UNKNOWN
    #: what the launch knows of the cache server: ``l2`` (started by this launch: its L1 was
    #: empty), ``l1`` (it ran already), '' (not a launch)
    tier: str = ""
    verdict: Verdict | None = None
    seconds: float = 0.0
    reference_computed: bool = False
    detail: str = ""
    failed_since: str = ""
    at: str = ""
    #: the warm-set sample of this run (None: none asked for)
    warm_sample: SampleRun | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "when": self.when, "at": self.at, "path": self.path,
                "tier": self.tier, "seconds": round(self.seconds, 3),
                "reference_computed": self.reference_computed, "detail": self.detail,
                "failed_since": self.failed_since or None,
                "verdict": self.verdict.to_dict() if self.verdict is not None else None,
                "warm_sample": self.warm_sample.to_dict() if self.warm_sample else None}

    def record_entry(self) -> dict[str, Any]:
        """The run as the record keeps it (the sample as counts: entries are many)."""
        d = self.to_dict()
        d.pop("failed_since")
        if self.warm_sample is not None:
            w = self.warm_sample
            d["warm_sample"] = {"state": w.state, "entries": len(w.entries),
                                "detail": w.detail, "next_entry": w.next_entry}
        return d

    def summary(self) -> str:
        """One line for progress output (pure)."""
        if self.state == SKIPPED:
            return f"canary skipped: {self.detail}"
        if self.state == PASSED:
            v = self.verdict
            diff = f"{v.max_diff:.2g}" if v is not None and v.max_diff is not None else "?"
            ref = "; reference computed now" if self.reference_computed else ""
            return (f"canary passed {_PATH_WORDS.get(self.path, self.path)}"
                    f"{_TIER_WORDS.get(self.tier, '') if self.path == PATH_LMCACHE else ''}: "
                    f"{v.compared if v else 0} steps, max |Δ logprob| {diff} within "
                    f"{v.tolerance if v else 0:g}{ref} ({self.seconds:.2f} s)")
        if self.state == FAILED:
            return (f"CANARY FAILED {_PATH_WORDS.get(self.path, self.path)}: {self.detail}")
        return f"WARNING: canary unknown (not a pass): {self.detail}"


def failed_state(rec: Record, when: str) -> CanaryRun:
    """The run a failed namespace gets instead of a probe (pure)."""
    why = str(rec.failed.get("detail") or rec.failed.get("why") or "")
    return CanaryRun(SKIPPED, when, detail=f"the namespace's canary failed at "
                     f"{rec.failed.get('at', '?')} ({why}); vLLM serves it recomputed, without "
                     "the cache, until `kvp-admin canary reset CONFIG --apply`",
                     failed_since=str(rec.failed.get("at", "")))


def run_canary(loc: Location, *, when: str, tier: str = "",
               timeout: float = probe.REQUEST_TIMEOUT_S,
               warm_ids: Sequence[Sequence[int]] | None = None,
               warm_n: int = 0) -> CanaryRun:
    """One canary run (see the module docstring); with ``warm_ids`` and ``warm_n``, then a
    sample of ``warm_n`` warm-set entries (:mod:`kvpersist.stack.canary.warm_sample`). The
    record is updated unless it could not be read. Raises KvpError only if the record cannot
    be written."""
    t0 = time.monotonic()
    at = now_iso()
    try:
        rec = read_record(loc.canary_file, loc.namespace)
    except UnreadableFile as exc:
        return CanaryRun(UNKNOWN, when, tier=tier, at=at,
                         detail=f"the canary record is unreadable: {exc}")
    if rec is not None and rec.failed:
        return failed_state(rec, when)
    chunk, chunks = loc.canary_chunk_size, loc.canary_chunks
    client = loc.vllm(timeout)
    model = loc.served_model_name
    fresh = rec is None or not rec.fits(chunk, chunks)
    rec = Record(loc.namespace) if rec is None else rec
    path, computed = PATH_UNKNOWN, False
    try:
        if fresh:
            rec = Record(loc.namespace, chunk, chunks,
                         tuple(probe.prompt_tokens(client, model, chunk, chunks, timeout)),
                         history=rec.history)
        served = probe.ask(client, model, rec.tokens, timeout=timeout)
        path = served_path(served.vllm_cached, served.lmcache_extra, chunk * chunks)
        if not rec.reference:
            ref = probe.ask(client, model, rec.tokens, timeout=timeout,
                            salt=f"kvp-canary-{uuid.uuid4().hex}")
            if ref.vllm_cached or ref.lmcache_extra:
                raise probe.ProbeError("the reference under a fresh salt was served from a "
                                       "cache: it is not a reference")
            rec = replace(rec, reference=ref.steps, reference_at=at)
            computed = True
        verdict = compare(rec.reference, served.steps, loc.canary_tolerance)
    except (Unreachable, probe.ProbeError) as exc:
        verdict = unknown(str(exc)[:300], loc.canary_tolerance)
    run = CanaryRun(verdict.state, when, path, tier, verdict, time.monotonic() - t0, computed,
                    verdict.why, at=at)
    if warm_ids and warm_n > 0 and run.state != FAILED:
        warm = sample(loc, warm_ids, n=warm_n, start=rec.warm_next, timeout=timeout)
        rec = replace(rec, warm_next=warm.next_entry)
        state = run.state if warm.state == PASSED else warm.state \
            if warm.state == FAILED or run.state == PASSED else run.state
        detail = run.detail if warm.state == PASSED else \
            "; ".join(x for x in (run.detail, f"warm set: {warm.detail}") if x)
        run = replace(run, state=state, detail=detail, warm_sample=warm,
                      seconds=time.monotonic() - t0)
    write_record(loc.canary_file, rec.with_run(run.record_entry()),
                 record_owner(loc.service_user))
    if run.state == FAILED:
        return replace(run, failed_since=at)
    return run


def recompute_reason(loc: Location) -> str:
    """Why vLLM must run without the cache connector: the namespace's canary failed and was
    not reset ('' : it may use the cache). An unreadable record is not a failure here (its
    run says unknown, and health says why). Never raises."""
    try:
        rec = read_record(loc.canary_file, loc.namespace)
    except UnreadableFile:
        return ""
    if rec is None or not rec.failed:
        return ""
    why = str(rec.failed.get("detail") or "")
    return (f"the namespace's canary failed at {rec.failed.get('at', '?')} ({why}); "
            "`kvp-admin canary reset CONFIG --apply` once the cause is found")


def canary_status(loc: Location) -> dict[str, Any]:
    """The namespace's canary as health, report and metrics show it: the record's summary,
    ``state`` ``none`` without a record, ``unknown`` (with ``error``) for an unreadable one.
    Never raises."""
    try:
        rec = read_record(loc.canary_file, loc.namespace)
    except UnreadableFile as exc:
        return {"state": UNKNOWN, "error": str(exc), "enabled": loc.canary_enabled}
    doc = rec.summary() if rec is not None else {"state": "none", "failed": None,
                                                   "last": None, "last_passed_at": None,
                                                   "reference_at": None}
    return {**doc, "enabled": loc.canary_enabled}


__all__ = ["SKIPPED", "CanaryRun", "canary_status", "failed_state", "recompute_reason",
           "run_canary"]
