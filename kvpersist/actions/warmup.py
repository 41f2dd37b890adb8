"""Use case: warm the deployment's warm set from L2 into L1 (``kvp-admin warmup``).

Steps: load CONFIG; read and validate ``KVP_WARMUP_FILE`` (bad lines: ConfigError, nothing
written); record ``warming`` in ``<state dir>/warmup.json``; token ids from the cache under
``<state dir>/warmup/`` or computed by vLLM's own renderer (template digest checked); the
chunk files with LMCache's own key code, recorded as the namespace's pins in
``<root>/.kvpersist/pins/``; one ``POST /cache/prefetches`` per entry (every TP rank),
each polled to completion; the final state ``done`` or ``failed``.

The state file (``kvpersist.warmup/1``, atomic, owner-only) is the contract other tools read:
``{"state": "warming"|"done"|"failed", "namespace", "started", "finished",
"requested_chunks", "found_chunks", "bytes", "seconds", "error"}`` (times ISO 8601 UTC).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from kvpersist.config.deployment import Deployment
from kvpersist.config.warmset import (
    WarmSet,
    parse_tokens_document,
    parse_warm_set,
    tokens_cache_name,
    tokens_document,
)
from kvpersist.errors import ConfigError, KvpError, Problem
from kvpersist.system.files import atomic_write_json

STATE_SCHEMA = "kvpersist.warmup/1"
STATE_FILE = "warmup.json"
TOKENS_DIR = "warmup"
DEFAULT_WAIT_S = 120.0
Progress = Callable[[str], None]


@dataclass
class EntryOutcome:
    """One warm-set entry: its line, tokens, chunks requested and keys found."""

    line: int
    tokens: int
    chunks: int = 0
    found_keys: int = 0
    total_keys: int = 0

    def to_dict(self) -> dict[str, int]:
        return {"line": self.line, "tokens": self.tokens, "chunks": self.chunks,
                "found_keys": self.found_keys, "total_keys": self.total_keys}


@dataclass
class WarmupResult:
    """What a warm-up did; :meth:`state_document` is what ``warmup.json`` holds."""

    namespace: str
    state: str  # warming / done / failed / none (no warm set)
    started: str
    finished: str | None = None
    requested_chunks: int = 0
    found_chunks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    warm_file: str = ""
    warm_file_sha256: str = ""
    world_size: int = 1
    tokens_cached: bool = False
    #: the root's pin manifest was for this warm set already (LMCache not imported)
    pins_reused: bool = False
    #: seconds from the first request to the server to the last completion
    prefetch_seconds: float = 0.0
    pins_path: str = ""
    pinned_files: int = 0
    entries: list[EntryOutcome] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        return 1 if self.state == "failed" else 0

    def state_document(self) -> dict[str, Any]:
        return {"schema": STATE_SCHEMA, "state": self.state if self.state != "none" else "done",
                "namespace": self.namespace, "started": self.started,
                "finished": self.finished, "requested_chunks": self.requested_chunks,
                "found_chunks": self.found_chunks, "bytes": self.bytes,
                "seconds": round(self.seconds, 3), "error": self.error,
                "warm_set": self.state != "none", "warm_file_sha256": self.warm_file_sha256}

    def to_dict(self) -> dict[str, Any]:
        return {**self.state_document(), "state": self.state, "warm_file": self.warm_file,
                "world_size": self.world_size, "tokens_cached": self.tokens_cached,
                "prefetch_seconds": round(self.prefetch_seconds, 3),
                "pins": {"path": self.pins_path, "files": self.pinned_files,
                         "reused": self.pins_reused},
                "entries": [e.to_dict() for e in self.entries], "warnings": self.warnings}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def state_path(dep: Deployment) -> str:
    """``<state dir>/warmup.json``."""
    return os.path.join(dep.settings.state_dir, STATE_FILE)


def read_warm_set(dep: Deployment) -> WarmSet:
    """Read and validate the deployment's warm file. Raises ConfigError (exit 2)."""
    path = dep.settings.warmup_file
    try:
        with open(path, "rb") as fh:
            data = fh.read(16 << 20 | 1)
    except OSError as exc:
        raise ConfigError(Problem(f"KVP_WARMUP_FILE {path}", f"cannot be read: "
                                  f"{exc.strerror or exc}",
                                  "point it at a readable JSONL file, or leave it empty"),
                          dep.source) from None
    return parse_warm_set(data, path)


def world_size(dep: Deployment) -> int:
    """vLLM's world size for the deployment: its TP degree (1 when unknown)."""
    tp = dep.identity_values.get("tensor_parallel_size", 1)
    return tp if isinstance(tp, int) and tp > 0 else 1


def warmup(config: str, *, wait_s: float = DEFAULT_WAIT_S,
           progress: Progress | None = None) -> WarmupResult:
    """Warm CONFIG's warm set (see the module docstring).

    Returns the result (``state`` ``none`` when no warm file is configured, ``done`` when
    every prefetch completed, ``failed`` otherwise). Raises ConfigError for a config or warm
    set that is wrong (exit 2; nothing written when the warm file does not parse)."""
    from kvpersist.config.loader import load_deployment

    say = progress or (lambda _: None)
    dep = load_deployment(config, allow_unpinned=True)
    res = WarmupResult(dep.namespace, "warming", _now(), world_size=world_size(dep))
    if not dep.settings.warmup_file:
        res.state, res.finished = "none", res.started
        _write_state(dep, res)
        return res
    if dep.identity is None:
        raise ConfigError(Problem(
            f"{dep.source}: KVP_WARMUP_FILE", "is set but the namespace is unpinned (identity "
            "incomplete): a one-off namespace never reuses anything, so there is nothing to warm",
            "complete the identity, or leave KVP_WARMUP_FILE empty"), dep.source)
    ws = read_warm_set(dep)
    res.warm_file, res.warm_file_sha256 = ws.source, ws.sha256
    t0 = time.monotonic()
    _write_state(dep, res)
    try:
        _run(dep, ws, res, wait_s, say)
    except ConfigError as exc:
        _finish(dep, res, t0, str(exc))
        raise
    except KvpError as exc:
        _finish(dep, res, t0, str(exc))
        return res
    _finish(dep, res, t0, None)
    return res


def _finish(dep: Deployment, res: WarmupResult, t0: float, error: str | None) -> None:
    res.seconds = time.monotonic() - t0
    res.finished = _now()
    res.error = error
    res.state = "failed" if error else "done"
    try:
        _write_state(dep, res)
    except KvpError as exc:
        res.warnings.append(str(exc))


def _write_state(dep: Deployment, res: WarmupResult) -> None:
    atomic_write_json(state_path(dep), res.state_document())


def _run(dep: Deployment, ws: WarmSet, res: WarmupResult, wait_s: float,
         say: Progress) -> None:
    from kvpersist.stack import prefetch
    from kvpersist.stack.locate import locate
    from kvpersist.stack.render import TEMPLATE_NAMES, render
    from kvpersist.system.templates import read_templates

    # the sizes do not enter the key scheme nor the vLLM arguments tokenization reads
    rendered = render(dep, read_templates(TEMPLATE_NAMES), l1_size_gb=dep.settings.l1_size_gb,
                      l2_capacity_gb=1.0)
    token_ids = _token_ids(dep, ws, rendered.vllm_argv, res, say)
    pins = _recorded_pins(dep, ws, res) if res.tokens_cached else None
    if pins is None:
        pins = _compute_pins(dep, ws, res, rendered.lmcache_server_argv, token_ids)
    else:
        res.pins_reused = True
        res.pins_path = os.path.join(dep.settings.cache_root, ".kvpersist", "pins",
                                     f"{dep.namespace}.json")
    chunk_size = int(pins["chunk_size"])
    res.entries = [EntryOutcome(e.line, len(ids), len(ids) // chunk_size)
                   for e, ids in zip(ws.entries, token_ids, strict=True)]
    res.requested_chunks = sum(e.chunks for e in res.entries)
    _measure(dep, res, pins)
    base = locate(dep).server_http_url
    # --wait counts from the first request to the server, not from the tokenization
    t0 = time.monotonic()
    deadline = t0 + wait_s
    try:
        for entry, ids in zip(res.entries, token_ids, strict=True):
            if not entry.chunks:
                continue
            say(f"line {entry.line}: prefetching {entry.chunks} chunk(s) x {res.world_size} "
                "rank(s)")
            sub = prefetch.submit(base, dep.lmcache_model_name, res.world_size, ids,
                                  deadline=deadline, on_wait=say)
            if sub.request_id is None:
                continue
            done = prefetch.wait_completed(base, sub.request_id, deadline=deadline)
            entry.found_keys, entry.total_keys = done.found_keys, done.total_keys
            entry.chunks = sub.chunks
    finally:
        res.prefetch_seconds = time.monotonic() - t0
    res.requested_chunks = sum(e.chunks for e in res.entries)
    res.found_chunks = sum(e.found_keys * e.chunks // e.total_keys
                           for e in res.entries if e.total_keys)


def _token_ids(dep: Deployment, ws: WarmSet, vllm_argv: list[str], res: WarmupResult,
               say: Progress) -> list[list[int]]:
    assert dep.identity is not None
    expected = dep.identity.chat_template_sha256
    cache = os.path.join(dep.settings.state_dir, TOKENS_DIR,
                         tokens_cache_name(dep.namespace, ws.sha256))
    cached = _read_json(cache)
    if cached is not None:
        ids = parse_tokens_document(cached, dep.namespace, ws.sha256, expected)
        if ids is not None and len(ids) == len(ws.entries):
            res.tokens_cached = True
            return ids
    from kvpersist.stack.warm_tokens import tokenize

    say("tokenizing the warm set with vLLM's renderer (the deployment's tokenizer and chat "
        "template)")
    tok = tokenize(vllm_argv, dep.settings.model_path, ws.entries,
                   expected_template_sha256=expected, source=ws.source)
    try:
        atomic_write_json(cache, tokens_document(dep.namespace, ws.sha256, expected,
                                                 tok.token_ids, [e.line for e in ws.entries]))
    except KvpError as exc:
        res.warnings.append(f"the token ids were not cached: {exc}")
    return tok.token_ids


def _read_json(path: str) -> Any:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as fh:
            return json.loads(fh.read(64 << 20))
    except (OSError, ValueError):
        return None


def _recorded_pins(dep: Deployment, ws: WarmSet, res: WarmupResult) -> dict[str, Any] | None:
    """The root's pin manifest when it was computed for exactly this namespace, warm file,
    world size, chunk size and file layout (then LMCache need not be imported again)."""
    from kvpersist.l2.pin_store import read_pin_document

    doc = read_pin_document(dep.settings.cache_root, dep.namespace)
    g = dep.generic
    if (doc is None or doc.get("warm_file_sha256") != ws.sha256
            or doc.get("world_size") != res.world_size or doc.get("chunk_size") != g.chunk_size
            or doc.get("shard_dirs") != g.l2_shard_dirs):
        return None
    return doc


def _compute_pins(dep: Deployment, ws: WarmSet, res: WarmupResult, server_argv: list[str],
                  token_ids: list[list[int]]) -> dict[str, Any]:
    """The chunk files of the warm set by LMCache's own key code, recorded as the pins."""
    from kvpersist.l2.pin_store import write_pins
    from kvpersist.l2.pins import pin_document
    from kvpersist.stack.warm_keys import chunk_files, key_scheme

    scheme = key_scheme(server_argv)
    files: list[str] = []
    chunks = 0
    for ids in token_ids:
        rel, n = chunk_files(scheme, dep.lmcache_model_name, res.world_size, ids)
        files += rel
        chunks += n
    try:
        doc = pin_document(dep.namespace, ws.sha256, files, world_size=res.world_size,
                           chunk_size=scheme.chunk_size, hash_algorithm=scheme.hash_algorithm,
                           shard_dirs=scheme.shard_dirs, chunks=chunks,
                           created_ns=time.time_ns())
    except ValueError as exc:
        raise KvpError(f"LMCache's key code and kvpersist's file-name parser disagree: {exc}; "
                       "nothing pinned") from None
    try:
        res.pins_path = write_pins(dep.settings.cache_root, doc)
    except KvpError as exc:
        res.warnings.append(f"the warm set's files are not pinned: {exc}")
    return doc


def _measure(dep: Deployment, res: WarmupResult, doc: dict[str, Any]) -> None:
    from kvpersist.l2.pin_store import measure_pins
    from kvpersist.l2.pins import parse_pin_document
    from kvpersist.l2.tree import open_root

    pins, _ = parse_pin_document(doc, dep.namespace)
    if pins is None:
        return
    res.pinned_files = len(pins.files)
    try:
        with open_root(dep.settings.cache_root, purpose="measure the pins of") as r:
            res.bytes = measure_pins(r.fd, pins).bytes
    except KvpError as exc:
        res.warnings.append(str(exc))
