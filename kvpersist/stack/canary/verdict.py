"""The canary's verdict: what the cache path served against the known answer (pure).

A canary run sends a fixed prompt (a few full chunks of the deployment's own tokens) and asks
for a few greedy tokens with their top logprobs. The *reference* is the same request computed
once without any cache reuse (a unique ``cache_salt``: neither vLLM's prefix cache nor LMCache
holds anything under it). At each step where the two agree on what came before, the served
distribution must be the reference's:

* the greedy token is the reference's, unless the reference itself was a near tie at that
  step (its top two within ``tolerance``: then either is a correct answer, and the steps after
  it are no longer comparable);
* every token in both top lists has a logprob within ``tolerance`` of the reference's.

``tolerance`` holds for the deployment's KV cache dtype (:data:`TOLERANCE`, measured in
docs/benchmarks.md "Canary tolerance": vLLM's own run-to-run spread on this stack, with a
margin). Wrong KV (another chunk's, a stale layout) moves the logprobs by far more. A run that
could not compare (vLLM busy, a timeout, an answer without logprobs) is ``unknown``, never
``passed``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

PASSED = "passed"
FAILED = "failed"
UNKNOWN = "unknown"
STATES = (PASSED, FAILED, UNKNOWN)

#: max |logprob difference| (nats) accepted per KV cache dtype: vLLM's own spread measured on
#: this stack (docs/benchmarks.md "Canary tolerance": in float32 at most 9.5e-7, in bfloat16
#: at most 0.0079, both with other requests batched in; 0 alone) times a margin (about 1,000
#: and 5); float16 is taken as bfloat16 (not measured)
TOLERANCE: dict[str, float] = {"float32": 1e-3, "bfloat16": 0.04, "float16": 0.04}
#: a dtype not measured (the fp8 KV caches, ``auto``): twice the loosest measured bound
DEFAULT_TOLERANCE = 2 * max(TOLERANCE.values())


def tolerance_for(kv_dtype: str, override: float = 0.0) -> float:
    """The tolerance of a KV cache dtype: ``override`` when set (KVP_CANARY_TOLERANCE), else
    the measured one, else (``auto``, fp8) the loosest measured one."""
    return override if override > 0 else TOLERANCE.get(kv_dtype, DEFAULT_TOLERANCE)


@dataclass(frozen=True)
class Step:
    """One generated position: the greedy token and the top logprobs (token id -> logprob)."""

    token: int
    top: Mapping[int, float]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Step:
        """From ``{"token": int, "top": {"id": logprob, ...}}`` (JSON keys are text). Raises
        ValueError, TypeError or KeyError for anything else."""
        top = d["top"]
        if not isinstance(top, Mapping):
            raise TypeError("top is not an object")
        steps = {int(k): float(v) for k, v in top.items()}
        if not all(math.isfinite(v) or v == -math.inf for v in steps.values()):
            raise ValueError("a logprob is not a number")
        return cls(int(d["token"]), steps)

    def to_dict(self) -> dict[str, Any]:
        return {"token": self.token, "top": {str(k): v for k, v in self.top.items()}}

    def margin(self) -> float:
        """The greedy token's lead over the runner-up (inf with a single entry)."""
        values = sorted(self.top.values(), reverse=True)
        return values[0] - values[1] if len(values) > 1 else math.inf


def steps_from(doc: Any) -> tuple[Step, ...]:
    """Steps stored as a list of :meth:`Step.to_dict` (raises ValueError for anything else)."""
    if not isinstance(doc, list):
        raise ValueError("not a list of steps")
    try:
        return tuple(Step.from_dict(d) for d in doc)
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"a step is malformed: {exc}") from None


@dataclass(frozen=True)
class Verdict:
    """The comparison of one run with the reference."""

    state: str
    #: the largest |logprob difference| over the compared steps (None: nothing compared)
    max_diff: float | None = None
    #: steps compared, and the first step whose greedy token differs (None: none)
    compared: int = 0
    mismatch_step: int | None = None
    tolerance: float = 0.0
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        diff = self.max_diff
        return {"state": self.state,
                "max_diff": None if diff is None else (diff if math.isfinite(diff) else "inf"),
                "compared": self.compared, "mismatch_step": self.mismatch_step,
                "tolerance": self.tolerance, "why": self.why}


def unknown(why: str, tolerance: float = 0.0) -> Verdict:
    """A run that could not be compared: never a pass."""
    return Verdict(UNKNOWN, tolerance=tolerance, why=why)


def compare(reference: Sequence[Step], observed: Sequence[Step], tolerance: float) -> Verdict:
    """The verdict of ``observed`` against ``reference`` (see the module docstring)."""
    if not reference:
        return unknown("no reference", tolerance)
    if len(observed) < len(reference):
        return unknown(f"the run returned {len(observed)} of {len(reference)} tokens",
                       tolerance)
    worst = 0.0
    compared = 0
    for i, (ref, obs) in enumerate(zip(reference, observed, strict=False)):
        if ref.token not in obs.top:
            return Verdict(FAILED, math.inf, compared + 1, i, tolerance,
                           f"step {i}: the reference's token {ref.token} is not among the "
                           f"{len(obs.top)} most likely served")
        diff = max(abs(ref.top[t] - obs.top[t]) for t in set(ref.top) & set(obs.top))
        worst = max(worst, diff)
        compared += 1
        if diff > tolerance:
            return Verdict(FAILED, worst, compared, i if obs.token != ref.token else None,
                           tolerance, f"step {i}: a logprob differs from the reference's by "
                           f"{diff:.3g} (tolerance {tolerance:g})")
        if obs.token != ref.token:
            if ref.margin() <= tolerance:  # a near tie: both answers are right; stop here
                break
            return Verdict(FAILED, worst, compared, i, tolerance,
                           f"step {i}: greedy token {obs.token}, the reference's "
                           f"{ref.token} (its lead {ref.margin():.3g})")
    return Verdict(PASSED, worst, compared, None, tolerance)


#: where the served run's prompt came from (the connector's ``cached_token_stats``)
PATH_LMCACHE = "lmcache"   # the cache server (its L1, or L2 through it)
PATH_VLLM = "vllm"         # vLLM's own prefix cache (the cache path was not read)
PATH_COMPUTED = "computed"  # nothing cached: computed, and stored for the next run
PATH_UNKNOWN = "unknown"   # not reported (a connector without the statistics)


def served_path(vllm_cached: int | None, lmcache_extra: int | None, cached_tokens: int) -> str:
    """Where a served run's ``cached_tokens`` full-chunk tokens came from (pure): LMCache
    when it supplied at least one chunk's worth beyond vLLM's own prefix cache, vLLM's prefix
    cache when that held them, else computed."""
    if vllm_cached is None or lmcache_extra is None:
        return PATH_UNKNOWN
    if lmcache_extra > 0:
        return PATH_LMCACHE
    if vllm_cached >= cached_tokens > 0:
        return PATH_VLLM
    return PATH_COMPUTED


def canary_health(status: Mapping[str, Any], run: Mapping[str, Any] | None, *,
                  vllm_has_connector: bool | None) -> tuple[str, str]:
    """Health's ``canary`` check as (status, detail) (pure): ``down`` when the namespace's
    canary failed while vLLM still runs with the cache connector (it may serve wrong KV),
    ``degraded`` when it failed and vLLM serves recomputed, or when the last run is
    ``unknown`` (never a pass); ``ok`` when the last run passed; ``skipped`` when none has
    run. ``run``: this health run's own canary run, if asked for (``health --canary``)."""
    state = status.get("state")
    if state == "failed":
        failed = status.get("failed") or {}
        why = (f"the canary failed at {failed.get('at', '?')} "
               f"({failed.get('detail') or failed.get('why') or 'no detail'})")
        if vllm_has_connector:
            return ("down", f"{why} and vLLM still runs with the cache connector: restart "
                    "it (`kvp-admin restart CONFIG --only vllm`) to serve recomputed; "
                    "`kvp-admin canary show CONFIG`")
        return ("degraded", f"{why}; vLLM serves without the cache until "
                "`kvp-admin canary reset CONFIG --apply`")
    if "error" in status:
        return ("degraded", f"canary record unreadable: {status['error']}")
    last = run or status.get("last") or {}
    if state == "none" and not last:
        return ("skipped", "no canary has run for this namespace"
                + ("" if status.get("enabled", True) else " (KVP_CANARY=false)"))
    verdict_doc = last.get("verdict") or {}
    if last.get("state") == PASSED:
        return ("ok", f"passed at {last.get('at', '?')} ({last.get('when')}, path "
                f"{last.get('path')}, max |Δ logprob| {verdict_doc.get('max_diff')} within "
                f"{verdict_doc.get('tolerance')})")
    return ("degraded", f"the last canary run ({last.get('when')}, {last.get('at', '?')}) is "
            f"{last.get('state')}, not a pass: {last.get('detail') or 'no detail'}")


__all__ = ["DEFAULT_TOLERANCE", "FAILED", "PASSED", "PATH_COMPUTED", "PATH_LMCACHE",
           "PATH_UNKNOWN", "PATH_VLLM", "STATES", "TOLERANCE", "UNKNOWN", "Step", "Verdict",
           "canary_health", "compare", "served_path", "steps_from", "tolerance_for",
           "unknown"]
