"""Use case: the namespace's known-answer canary (``kvp-admin canary show|run|reset``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpersist.config.loader import load_deployment
from kvpersist.errors import ConfigError, Problem
from kvpersist.stack.canary.record import read_record, remove_record
from kvpersist.stack.canary.run import CanaryRun, canary_status, run_canary
from kvpersist.stack.locate import Location, locate
from kvpersist.stack.warm.run import cached_token_ids
from kvpersist.system.untrusted import UnreadableFile


@dataclass(frozen=True)
class CanaryShow:
    """``canary show``: the record's summary and its runs."""

    config: str
    namespace: str
    loc: Location
    status: dict[str, Any]
    history: tuple[dict[str, Any], ...]

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "kvpersist.canary-show/1", "config": self.config,
                "namespace": self.namespace, "record": self.loc.canary_file,
                "enabled": self.loc.canary_enabled, "chunks": self.loc.canary_chunks,
                "chunk_size": self.loc.canary_chunk_size,
                "tolerance": self.loc.canary_tolerance, **self.status,
                "history": list(self.history)}


def _located(config: str) -> tuple[str, Location]:
    dep = load_deployment(config, allow_unpinned=True)
    return dep.name, locate(dep)


def show(config: str) -> CanaryShow:
    """The namespace's canary record (read only). Raises ConfigError."""
    name, loc = _located(config)
    status = canary_status(loc)
    try:
        rec = read_record(loc.canary_file, loc.namespace)
    except UnreadableFile:
        rec = None
    history = tuple(dict(r) for r in rec.history) if rec is not None else ()
    return CanaryShow(name, loc.namespace, loc, status, history)


@dataclass(frozen=True)
class CanaryRunOutcome:
    config: str
    namespace: str
    run: CanaryRun

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "kvpersist.canary-run/1", "config": self.config,
                "namespace": self.namespace, **self.run.to_dict()}


def run(config: str, *, warm_sample: int = 0) -> CanaryRunOutcome:
    """One canary run against the deployment's running vLLM now; with ``warm_sample``, then
    that many warm-set entries (their token ids as the warm-up cached them). Raises
    ConfigError (also: a sample asked for and no cached token ids), KvpError if the record
    cannot be written."""
    dep = load_deployment(config, allow_unpinned=True)
    loc = locate(dep)
    ids = None
    if warm_sample:
        ids, why = cached_token_ids(dep, loc)
        if ids is None:
            raise ConfigError(Problem("--warm-sample", why,
                                      "run a launch or `kvp-admin warmup CONFIG` first"))
    return CanaryRunOutcome(dep.name, loc.namespace,
                            run_canary(loc, when="manual", warm_ids=ids, warm_n=warm_sample))


@dataclass(frozen=True)
class CanaryReset:
    """``canary reset``: what the record held, and whether it was removed."""

    config: str
    namespace: str
    record: str
    status: dict[str, Any]
    applied: bool
    removed: bool

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "kvpersist.canary-reset/1", "config": self.config,
                "namespace": self.namespace, "record": self.record, "was": self.status,
                "applied": self.applied, "removed": self.removed}


def reset(config: str, *, apply: bool = False) -> CanaryReset:
    """Forget the namespace's canary record (its failure, prompt and reference): the next
    start of vLLM renders it with the cache connector again and the next canary run starts
    afresh. Dry run unless ``apply``. The namespace's chunk files are not touched."""
    name, loc = _located(config)
    status = canary_status(loc)
    removed = remove_record(loc.canary_file) if apply else False
    return CanaryReset(name, loc.namespace, loc.canary_file, status, apply, removed)


__all__ = ["CanaryReset", "CanaryRunOutcome", "CanaryShow", "reset", "run", "show"]
