"""Use case: warm the deployment's warm set from L2 into L1 (``kvp-admin warmup``).

Loads CONFIG and runs the warm-up engine, :func:`kvpersist.stack.warm.run.warm` (its module
docstring lists the steps and the state file ``<state dir>/warmup.json``, schema
``kvpersist.warmup/1``, that other tools read).
"""

from __future__ import annotations

from kvpersist.config.loader import load_deployment
from kvpersist.stack.locate import locate
from kvpersist.stack.warm.handoff import read_handoff
from kvpersist.stack.warm.run import DEFAULT_WAIT_S, Progress, WarmupResult, warm


def warmup(config: str, *, wait_s: float = DEFAULT_WAIT_S,
           progress: Progress | None = None,
           compute_missing: bool | None = None,
           handoff_file: str | None = None) -> WarmupResult:
    """Load CONFIG (an incomplete identity is accepted: the engine refuses a warm set for
    an unpinned namespace itself) and warm its warm set.

    Returns the engine's result (``state`` ``none`` when no warm file is configured, ``done``
    when every prefetch completed, ``failed`` otherwise). Raises ConfigError for a config or
    warm set that is wrong (exit 2; nothing written when the warm file does not parse).
    ``handoff_file``: the rendered arguments a launch hands its warm-up child
    (:mod:`kvpersist.stack.warm.handoff`); without it the deployment is rendered here."""
    dep = load_deployment(config, allow_unpinned=True)
    handoff = read_handoff(handoff_file) if handoff_file else None
    return warm(dep, locate(dep), wait_s=wait_s, progress=progress,
                compute_missing=compute_missing, handoff=handoff)


__all__ = ["WarmupResult", "warmup"]
