"""The warm-up engine: the deployment's warm set from L2 into L1 (I/O).

:func:`warm` is given a loaded deployment and its :class:`~kvpersist.stack.locate.Location`.
Steps: read and validate ``KVP_WARMUP_FILE`` (bad lines: ConfigError, nothing written);
record ``warming`` in ``loc.warmup_state_file``; token ids from the cache in
``loc.warmup_tokens_dir`` or computed by vLLM's own renderer (template digest checked,
:mod:`kvpersist.stack.warm.tokens`); the chunk files with LMCache's own key code
(:mod:`kvpersist.stack.warm.chunk_keys`), recorded as the namespace's pins
(:mod:`kvpersist.l2.pins.store`), or the pins already recorded for this very warm set; one
``POST /cache/prefetches`` per entry (every TP rank, :mod:`kvpersist.stack.warm.prefetch`), each
polled to completion; the final state ``done`` or ``failed``.

The state file (``kvpersist.warmup/1``, atomic, owner-only) is the contract other tools read:
``{"state": "warming"|"done"|"failed", "namespace", "started", "finished",
"requested_chunks", "found_chunks", "bytes", "seconds", "error"}`` (times ISO 8601 UTC).

A launch runs the engine as a child process (it runs as the service user and imports vLLM)
through kvp-admin's own command, ``python -m kvpersist.cli warmup CONFIG --wait S --json
--rendered FILE`` (:mod:`kvpersist.stack.warm.readiness`), handing it the parts of its rendered
plan the engine uses (:mod:`kvpersist.stack.warm.handoff`): the result as JSON on stdout; exit
0 done (or no warm set), 1 failed, 2 a bad config or warm set (the message on stderr).
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
from kvpersist.config.warmset import MAX_BYTES as WARM_FILE_MAX_BYTES
from kvpersist.config.warmset import MAX_ENTRIES as WARM_MAX_ENTRIES
from kvpersist.config.warmset import (
    WarmSet,
    parse_tokens_document,
    parse_warm_set,
    tokens_cache_name,
    tokens_document,
)
from kvpersist.errors import ConfigError, KvpError, Problem
from kvpersist.l2.pins.store import measure_pins, pins_path, read_pin_document, write_pins
from kvpersist.l2.pins.usage import parse_pin_document, pin_document
from kvpersist.l2.tree import RootDir, open_dir, open_root
from kvpersist.stack.locate import Location
from kvpersist.stack.render import TEMPLATE_NAMES, render
from kvpersist.stack.warm import compute as warm_compute
from kvpersist.stack.warm import gate, prefetch
from kvpersist.stack.warm import load as warm_load
from kvpersist.stack.warm.chunk_keys import chunk_files, key_scheme
from kvpersist.stack.warm.handoff import Handoff
from kvpersist.stack.warm.tokens import tokenize
from kvpersist.system.files import atomic_write, atomic_write_json
from kvpersist.system.software import running_vllm_version
from kvpersist.system.templates import read_templates
from kvpersist.system.untrusted import UnreadableFile, read_bytes, read_json, show_path
from kvpersist.system.vllm_seam import kv_cache_tokens

STATE_SCHEMA = "kvpersist.warmup/1"
DEFAULT_WAIT_S = 120.0
#: a token-id cache bigger than this is ignored (the ids are computed again): ~2 million
#: token ids; parsed, such a file stays far below 512 MiB
TOKENS_MAX_BYTES = 16 << 20
#: a token-id cache holds an object, a list of entries and two containers per entry
TOKENS_MAX_CONTAINERS = 2 * WARM_MAX_ENTRIES + 8
Progress = Callable[[str], None]


@dataclass
class EntryOutcome:
    """One warm-set entry: its line, tokens, chunks requested and keys found."""

    line: int
    tokens: int
    chunks: int = 0
    found_keys: int = 0
    total_keys: int = 0
    #: chunks missing before, found after vLLM computed the entry (--compute-missing)
    computed_chunks: int = 0

    @property
    def found_chunks(self) -> int:
        return self.found_keys * self.chunks // self.total_keys if self.total_keys else 0

    def to_dict(self) -> dict[str, int]:
        return {"line": self.line, "tokens": self.tokens, "chunks": self.chunks,
                "found_keys": self.found_keys, "total_keys": self.total_keys,
                "computed_chunks": self.computed_chunks}


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
    #: missing chunks were computed by the deployment's vLLM (--compute-missing)
    compute: bool = False
    #: chunks found only after vLLM computed them, and the seconds the computing took
    computed_chunks: int = 0
    compute_seconds: float = 0.0
    #: warm-set lines with chunks still missing after the computing: not sent (the budget
    #: ran out) or not stored (vLLM refused or failed: see warnings)
    not_computed: list[int] = field(default_factory=list)
    #: the loads of entries from the server into vLLM before ready (none: nothing found to
    #: load; :mod:`kvpersist.stack.warm.load`)
    loads: list[warm_load.Loaded] = field(default_factory=list)
    #: vLLM's KV cache in tokens, as its metrics said (None: not asked or not said)
    kv_cache_tokens: int | None = None
    #: seconds an early start waited for vLLM and at its gate (not in ``seconds``)
    waited_s: float = 0.0

    @property
    def exit_code(self) -> int:
        return 1 if self.state == "failed" else 0

    def state_document(self) -> dict[str, Any]:
        return {"schema": STATE_SCHEMA, "state": self.state if self.state != "none" else "done",
                "namespace": self.namespace, "started": self.started,
                "finished": self.finished, "requested_chunks": self.requested_chunks,
                "found_chunks": self.found_chunks, "bytes": self.bytes,
                "seconds": round(self.seconds, 3), "error": self.error,
                "warm_set": self.state != "none", "warm_file_sha256": self.warm_file_sha256,
                "compute": self.compute, "computed_chunks": self.computed_chunks,
                "compute_seconds": round(self.compute_seconds, 3),
                "not_computed": self.not_computed,
                "loads": [x.to_dict() for x in self.loads],
                "kv_cache_tokens": self.kv_cache_tokens}

    def to_dict(self) -> dict[str, Any]:
        return {**self.state_document(), "state": self.state, "warm_file": self.warm_file,
                "world_size": self.world_size, "tokens_cached": self.tokens_cached,
                "prefetch_seconds": round(self.prefetch_seconds, 3),
                "pins": {"path": self.pins_path, "files": self.pinned_files,
                         "reused": self.pins_reused},
                "entries": [e.to_dict() for e in self.entries], "warnings": self.warnings}


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def read_warm_set(path: str, source: str) -> WarmSet:
    """Read and validate the warm file at ``path`` (KVP_WARMUP_FILE of the config at
    ``source``: :func:`parse_warm_set`).

    The operator's file is read as untrusted (:mod:`kvpersist.system.untrusted`): a link is
    followed, but what it names must be a regular file (a FIFO never blocks, ``/dev/zero``
    is never read) of at most :data:`~kvpersist.config.warmset.MAX_BYTES`. Raises
    ConfigError (exit 2) naming KVP_WARMUP_FILE and the file for each way of failing."""
    fix = "point it at a readable JSONL file, or leave it empty"
    try:
        data = read_bytes(path, max_bytes=WARM_FILE_MAX_BYTES)
    except FileNotFoundError:
        raise ConfigError(Problem(f"KVP_WARMUP_FILE {show_path(path)}",
                                  "cannot be read: no such file", fix), source) from None
    except UnreadableFile as exc:
        raise ConfigError(Problem(f"KVP_WARMUP_FILE {exc.path}", exc.why, fix),
                          source) from None
    return parse_warm_set(data, show_path(path))


def world_size(dep: Deployment) -> int:
    """vLLM's world size for the deployment: its TP degree (1 when unknown)."""
    tp = dep.identity_values.get("tensor_parallel_size", 1)
    return tp if isinstance(tp, int) and tp > 0 else 1


# --------------------------------------------------------------------------- the engine


def warm(dep: Deployment, loc: Location, *, wait_s: float = DEFAULT_WAIT_S,
         progress: Progress | None = None, compute_missing: bool | None = None,
         handoff: Handoff | None = None) -> WarmupResult:
    """Warm the warm set of ``dep`` (located at ``loc``, see the module docstring), giving up
    ``wait_s`` seconds after the first request to the cache server. With ``compute_missing``
    (None: KVP_WARMUP_COMPUTE) the chunks found on no tier are computed by the deployment's
    vLLM within the same time (:mod:`kvpersist.stack.warm.compute`). ``handoff``: the
    launch's rendered arguments (:mod:`kvpersist.stack.warm.handoff`); None: rendered here.

    Returns the result (``state`` ``none`` when no warm file is configured, ``done`` when
    every prefetch completed, ``failed`` otherwise); the state file says the same. Raises
    ConfigError for a warm set that is wrong or an unpinned namespace (exit 2; nothing
    written when the warm file does not parse), KvpError when the state file cannot be
    written at the start."""
    say = progress or (lambda _: None)
    res = WarmupResult(loc.namespace, "warming", _now(), world_size=world_size(dep))
    res.compute = dep.settings.warmup_compute if compute_missing is None else compute_missing
    if not dep.settings.warmup_file:
        res.state, res.finished = "none", res.started
        _write_state(loc, res)
        return res
    if dep.identity is None:
        raise ConfigError(Problem(
            f"{dep.source}: KVP_WARMUP_FILE", "is set but the namespace is unpinned (identity "
            "incomplete): a one-off namespace never reuses anything, so there is nothing to warm",
            "complete the identity, or leave KVP_WARMUP_FILE empty"), dep.source)
    ws = read_warm_set(dep.settings.warmup_file, dep.source)
    res.warm_file, res.warm_file_sha256 = ws.source, ws.sha256
    t0 = time.monotonic()
    _write_state(loc, res)
    try:
        _run(dep, loc, ws, res, wait_s, say, handoff or render_handoff(dep))
    except ConfigError as exc:
        _finish(loc, res, t0, str(exc))
        raise
    except KvpError as exc:
        _finish(loc, res, t0, str(exc))
        return res
    _finish(loc, res, t0, None)
    return res


def _finish(loc: Location, res: WarmupResult, t0: float, error: str | None) -> None:
    res.seconds = time.monotonic() - t0 - res.waited_s
    res.finished = _now()
    res.error = error
    res.state = "failed" if error else "done"
    try:
        _write_state(loc, res)
    except KvpError as exc:
        res.warnings.append(str(exc))


def _write_state(loc: Location, res: WarmupResult) -> None:
    atomic_write_json(loc.warmup_state_file, res.state_document())


def render_handoff(dep: Deployment) -> Handoff:
    """What the warm-up uses of ``dep``'s rendering, for a warm-up no launch handed it to
    (``kvp-admin warmup`` by hand, ``launch --warmup-only``): the sizes enter neither the key
    scheme nor the arguments the tokens are computed with, and the arguments are those of the
    vLLM installed here, whose renderer computes the tokens."""
    rendered = render(dep, read_templates(TEMPLATE_NAMES), l1_size_gb=dep.settings.l1_size_gb,
                      l2_capacity_gb=1.0, vllm_version=running_vllm_version(
                          dep.vllm_version, direct_process=True))
    return Handoff.of(rendered.vllm_argv, rendered.lmcache_server_argv)


def _run(dep: Deployment, loc: Location, ws: WarmSet, res: WarmupResult, wait_s: float,
         say: Progress, handoff: Handoff) -> None:
    tokens = _token_ids(dep, loc, ws, list(handoff.vllm_argv), say)
    token_ids = tokens.ids
    res.tokens_cached = tokens.cached
    res.warnings += tokens.warnings
    root = _open_root(loc)
    try:
        pins = _pins(root, dep, loc, ws, res.world_size, list(handoff.server_argv), token_ids,
                     reuse=tokens.cached)
        res.pins_reused, res.pins_path = pins.reused, pins.path
        res.warnings += pins.warnings
        chunk_size = int(pins.doc["chunk_size"])
        res.entries = [EntryOutcome(e.line, len(ids), len(ids) // chunk_size)
                       for e, ids in zip(ws.entries, token_ids, strict=True)]
        res.requested_chunks = sum(e.chunks for e in res.entries)
        measured = _measure(root, loc, pins.doc)
        res.pinned_files, res.bytes = measured.files, measured.bytes
        res.warnings += measured.warnings
    finally:
        root.close()
    base = loc.server_http_url
    if handoff.gate:  # started early by a launch: the server is asked once vLLM serves
        res.waited_s += gate.wait_serving(loc, handoff.gate)
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
    if handoff.gate:  # nothing reaches vLLM before the launch's canary passed
        waited = gate.wait_open(handoff.gate)
        deadline, res.waited_s = deadline + waited, res.waited_s + waited
    if res.compute:
        computed = _compute_missing(dep, loc, res.entries, res.world_size, token_ids,
                                    deadline, say)
        res.not_computed, res.compute_seconds = list(computed.not_computed), computed.seconds
        res.computed_chunks = sum(e.computed_chunks for e in res.entries)
        res.warnings += computed.warnings
        if computed.error is not None:
            raise computed.error
    res.requested_chunks = sum(e.chunks for e in res.entries)
    res.found_chunks = sum(e.found_chunks for e in res.entries)
    # an entry the warm-up just computed is in vLLM's own prefix cache: a load would load none
    loadable = [(e.line, 0 if e.computed_chunks else e.found_chunks) for e in res.entries]
    if not any(n for _, n in loadable):
        return
    res.kv_cache_tokens = _kv_cache_tokens(loc)
    plans = warm_load.plan_loads(loadable, token_ids, chunk_size,
                                 bodies=[e.body for e in ws.entries],
                                 kv_tokens=res.kv_cache_tokens)
    left = sum(1 for _, n in loadable if n) - len(plans)
    if left:
        res.warnings.append(
            f"{left} warm-set entr{'y' if left == 1 else 'ies'} with chunks found not loaded "
            "into vLLM: " + ("its KV cache size is unknown" if res.kv_cache_tokens is None
                             else f"more than {warm_load.KV_SHARE:.0%} of vLLM's KV cache "
                             f"({res.kv_cache_tokens:,} tokens)"))
    for plan in plans:
        say(f"line {plan.line}: loading its {plan.chunks} chunk(s) into vLLM ({plan.endpoint})")
        loaded = warm_load.load(loc.vllm_url, loc.served_model_name, plan, deadline=deadline)
        res.loads.append(loaded)
        if not loaded.ok:
            res.warnings.append(f"line {plan.line}: the load into vLLM failed: "
                                f"{loaded.detail}")
            break


def _kv_cache_tokens(loc: Location) -> int | None:
    """vLLM's KV cache in tokens, from its metrics; None when they do not say."""
    try:
        return kv_cache_tokens(loc.vllm().metrics_text())
    except KvpError:  # Unreachable, an error status, an answer too big
        return None


@dataclass(frozen=True)
class _Computed:
    """What :func:`_compute_missing` did besides the entries' counts."""

    #: lines with chunks still missing after the computing
    not_computed: tuple[int, ...]
    warnings: tuple[str, ...]
    seconds: float
    #: what ended the computing early (raised by the caller once the rest is recorded)
    error: KvpError | None = None


def _compute_missing(dep: Deployment, loc: Location, entries: list[EntryOutcome],
                     world_size: int, token_ids: list[list[int]], deadline: float,
                     say: Progress) -> _Computed:
    """Each entry with chunks found on no tier: sent to vLLM (its token ids), then
    prefetched again to count what it stored (the entry's counts are updated); what does
    not fit before ``deadline``, or that vLLM did not store, is listed as not computed."""
    t0 = time.monotonic()
    missing: list[int] = []
    warnings: list[str] = []
    error: KvpError | None = None
    try:
        for entry, ids in zip(entries, token_ids, strict=True):
            if not entry.chunks or entry.found_chunks >= entry.chunks:
                continue
            before = entry.found_chunks
            say(f"line {entry.line}: {entry.chunks - before} chunk(s) on no tier: "
                "computing them with vLLM")
            run = warm_compute.compute(loc.vllm_url, loc.served_model_name, ids,
                                       deadline=deadline)
            if not run.ok:
                missing.append(entry.line)
                warnings.append(f"line {entry.line}: not computed: {run.detail}")
                continue
            try:
                _recount(dep, loc, world_size, entry, ids, deadline, say)
            except prefetch.PrefetchFailed as exc:
                warnings.append(f"line {entry.line}: computed, not counted again: {exc}")
            entry.computed_chunks = max(0, entry.found_chunks - before)
            if entry.found_chunks < entry.chunks:
                missing.append(entry.line)
    except KvpError as exc:
        error = exc
    return _Computed(tuple(missing), tuple(warnings), time.monotonic() - t0, error)


def _recount(dep: Deployment, loc: Location, world_size: int, entry: EntryOutcome,
             ids: list[int], deadline: float, say: Progress) -> None:
    """Prefetch a computed entry again until every chunk is found (LMCache stores them a
    moment after vLLM answers) or the tries or the time run out; each count goes into
    ``entry``."""
    base = loc.server_http_url
    for _ in range(warm_compute.RECOUNT_TRIES):
        sub = prefetch.submit(base, dep.lmcache_model_name, world_size, ids,
                              deadline=deadline, on_wait=say)
        if sub.request_id is None:
            return
        done = prefetch.wait_completed(base, sub.request_id, deadline=deadline)
        entry.found_keys, entry.total_keys = done.found_keys, done.total_keys
        entry.chunks = sub.chunks
        if entry.found_chunks >= entry.chunks or \
                time.monotonic() + warm_compute.RECOUNT_PAUSE_S > deadline:
            return
        time.sleep(warm_compute.RECOUNT_PAUSE_S)


@dataclass(frozen=True)
class _Tokens:
    """The warm set's token ids, whether they came from the cache, and what to warn of."""

    ids: list[list[int]]
    cached: bool
    warnings: tuple[str, ...] = ()


def _token_ids(dep: Deployment, loc: Location, ws: WarmSet, vllm_argv: list[str],
               say: Progress) -> _Tokens:
    assert dep.identity is not None
    expected = dep.identity.chat_template_sha256
    name = tokens_cache_name(loc.namespace, ws.sha256)
    ids, why = _cached_ids(loc, ws, expected)
    if ids is not None:
        return _Tokens(ids, True)
    warnings = [why] if why else []
    say("tokenizing the warm set with vLLM's renderer (the deployment's tokenizer and chat "
        "template)")
    tok = tokenize(vllm_argv, dep.settings.model_path, ws.entries,
                   expected_template_sha256=expected, source=ws.source)
    text = json.dumps(tokens_document(loc.namespace, ws.sha256, expected, tok.token_ids,
                                      [e.line for e in ws.entries]), separators=(",", ":"))
    try:
        if len(text) >= TOKENS_MAX_BYTES:
            raise KvpError(f"{len(text):,} bytes, more than the {TOKENS_MAX_BYTES:,} a cache "
                           "may hold")
        atomic_write(os.path.join(loc.warmup_tokens_dir, name), text + "\n")
    except KvpError as exc:
        warnings.append(f"the token ids were not cached: {exc}")
    return _Tokens(tok.token_ids, False, tuple(warnings))


def cached_token_ids(dep: Deployment, loc: Location) -> tuple[list[list[int]] | None, str]:
    """The warm set's token ids as the last warm-up cached them (never computed here: that
    needs vLLM's renderer), and why there are none ('' when there are). For the canary's
    warm-set sample (kvpersist.stack.canary.warm_sample). Raises ConfigError for a warm file
    that cannot be read."""
    if not dep.settings.warmup_file or dep.identity is None:
        return None, "the deployment has no warm set (KVP_WARMUP_FILE)"
    ws = read_warm_set(dep.settings.warmup_file, dep.source)
    ids, why = _cached_ids(loc, ws, dep.identity.chat_template_sha256)
    if ids is None:
        return None, ("the warm set's token ids are not cached yet (a warm-up caches them)"
                      + (f": {why}" if why else ""))
    return ids, ""


def _cached_ids(loc: Location, ws: WarmSet,
                template_sha256: str) -> tuple[list[list[int]] | None, str]:
    """The warm set's token ids from its cache in ``loc.warmup_tokens_dir``, or None when
    there is none or it is unusable, and the warning that says why it is unusable ('' when
    it is usable or there is none). The cache is read as untrusted (never through a link,
    never blocking on a FIFO, at most :data:`TOKENS_MAX_BYTES`, depth-limited, finite
    numbers, a bounded count of arrays and objects) and must be the document of exactly this
    namespace, warm file, template and number of entries. An unusable one is never trusted:
    a warning names it, and the ids are computed again and written over it."""
    name = tokens_cache_name(loc.namespace, ws.sha256)
    try:
        dfd = open_dir(loc.warmup_tokens_dir)
    except OSError:
        return None, ""
    where = show_path(os.path.join(loc.warmup_tokens_dir, name))
    try:
        doc = read_json(name, dir_fd=dfd, follow=False, max_bytes=TOKENS_MAX_BYTES,
                        max_containers=TOKENS_MAX_CONTAINERS, where=where)
    except FileNotFoundError:
        return None, ""
    except UnreadableFile as exc:
        return None, f"the token-id cache {where} {exc.why}: ignored, the ids are computed again"
    finally:
        os.close(dfd)
    ids = parse_tokens_document(doc, loc.namespace, ws.sha256, template_sha256)
    if ids is None or len(ids) != len(ws.entries):
        return None, (f"the token-id cache {where} is not the one of this warm set and "
                      "template: ignored, the ids are computed again")
    return ids, ""


@dataclass(frozen=True)
class _Pins:
    """The warm set's pin manifest, where it is recorded ('' when it is not) and whether
    the root's own was for this very warm set."""

    doc: dict[str, Any]
    path: str
    reused: bool
    warnings: tuple[str, ...] = ()


def _pins(root: _Root, dep: Deployment, loc: Location, ws: WarmSet, world_size: int,
          server_argv: list[str], token_ids: list[list[int]], *, reuse: bool) -> _Pins:
    """The root's pin manifest when ``reuse`` (the token ids came from their cache) and it
    was computed for exactly this namespace, warm file, world size, chunk size and file
    layout (then LMCache need not be imported again); else the chunk files of the warm set
    by LMCache's own key code, recorded as the pins."""
    doc = _recorded_pins(root, loc) if reuse else None
    g = dep.generic
    if (doc is not None and doc.get("warm_file_sha256") == ws.sha256
            and doc.get("world_size") == world_size and doc.get("chunk_size") == g.chunk_size
            and doc.get("shard_dirs") == g.l2_shard_dirs):
        return _Pins(doc, pins_path(loc.cache_root, loc.namespace), True)
    scheme = key_scheme(server_argv)
    files: list[str] = []
    chunks = 0
    for ids in token_ids:
        rel, n = chunk_files(scheme, dep.lmcache_model_name, world_size, ids)
        files += rel
        chunks += n
    try:
        doc = pin_document(loc.namespace, ws.sha256, files, world_size=world_size,
                           chunk_size=scheme.chunk_size, hash_algorithm=scheme.hash_algorithm,
                           shard_dirs=scheme.shard_dirs, chunks=chunks,
                           created_ns=time.time_ns())
    except ValueError as exc:
        raise KvpError(f"LMCache's key code and kvpersist's file-name parser disagree: {exc}; "
                       "nothing pinned") from None
    try:
        return _Pins(doc, _record_pins(root, doc), False)
    except KvpError as exc:
        return _Pins(doc, "", False, (f"the warm set's files are not pinned: {exc}",))


# --------------------------------------------------------------------------- the cache root
# The warm-up opens the root once (:func:`_open_root`); every use of the root's pin manifests
# (l2.pin_store) is here, one call each, on that handle.


@dataclass
class _Root:
    """The cache root as the warm-up holds it: the open handle, or why it could not be
    opened (then nothing is read, pinned or measured: each says so as today)."""

    handle: RootDir | None
    error: KvpError | None = None

    def close(self) -> None:
        if self.handle is not None:
            self.handle.close()


def _open_root(loc: Location) -> _Root:
    try:
        return _Root(open_root(loc.cache_root, purpose="pin the warm set on"))
    except KvpError as exc:
        return _Root(None, exc)


def _recorded_pins(root: _Root, loc: Location) -> dict[str, Any] | None:
    """The namespace's pin manifest on the root, if it is a valid one."""
    return None if root.handle is None else read_pin_document(root.handle, loc.namespace)


def _record_pins(root: _Root, doc: dict[str, Any]) -> str:
    """Write the pin manifest ``doc``; its path. Raises KvpError."""
    if root.handle is None:
        assert root.error is not None
        raise root.error
    return write_pins(root.handle, doc)


@dataclass(frozen=True)
class _Measured:
    """The pinned files, the bytes of those on disk, and what to warn of."""

    files: int = 0
    bytes: int = 0
    warnings: tuple[str, ...] = ()


def _measure(root: _Root, loc: Location, doc: dict[str, Any]) -> _Measured:
    """The pinned files and the bytes of those on disk (a root that cannot be opened is a
    warning)."""
    pins, _ = parse_pin_document(doc, loc.namespace)
    if pins is None:
        return _Measured()
    if root.handle is None:
        return _Measured(len(pins.files), 0, (str(root.error),))
    return _Measured(len(pins.files), measure_pins(root.handle, pins).bytes)
