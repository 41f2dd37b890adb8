"""The canary's record of a namespace: ``S/canary/<namespace>.json``, owner-only.

It holds the canary prompt's token ids (built once from the deployment's chat template and
tokenizer), the reference (the greedy steps computed once under a fresh cache salt), the last
runs, and ``failed``: set by a run that failed and kept until ``kvp-admin canary reset``.
While it is set, every start of vLLM for the namespace renders it without the cache connector
(recompute: nothing is read from, or written to, the cache), ``health`` fails naming the
canary, and report, metrics and fleet status show the namespace as failed. The namespace's
files are kept for diagnosis.

The record is read as untrusted (never through a link, at most
:data:`~kvpersist.system.untrusted.MAX_STATE_BYTES`, typed field by field); written
atomically. :func:`parse` and :meth:`Record.to_dict` are pure.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kvpersist.errors import KvpError
from kvpersist.stack.canary.verdict import STATES, Step, steps_from
from kvpersist.system.files import atomic_write_json
from kvpersist.system.untrusted import MAX_STATE_BYTES, UnreadableFile, read_json_object

SCHEMA = "kvpersist.canary/1"
CANARY_DIR = "canary"
#: runs kept in the record's history
HISTORY = 20
#: the longest prompt a record may hold (tokens)
MAX_PROMPT_TOKENS = 65536
_TEXT = 512


def record_path(state_dir: str, namespace: str) -> str:
    """``S/canary/<namespace>.json`` (pure)."""
    return os.path.join(state_dir, CANARY_DIR, f"{namespace}.json")


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(frozen=True)
class Record:
    """A namespace's canary record (see the module docstring)."""

    namespace: str
    chunk_size: int = 0
    chunks: int = 0
    tokens: tuple[int, ...] = ()
    reference: tuple[Step, ...] = ()
    reference_at: str = ""
    #: the run that failed ({"at", "when", "why", ...}); empty: none
    failed: Mapping[str, Any] = field(default_factory=dict)
    #: the last runs, newest last (each {"at", "when", "state", "path", ...})
    history: tuple[Mapping[str, Any], ...] = ()
    #: the warm-set entry the next warm-set sample starts at
    warm_next: int = 0

    @property
    def state(self) -> str:
        """failed (kept until reset), else the last run's state, else ``none``."""
        if self.failed:
            return "failed"
        return str(self.history[-1].get("state", "none")) if self.history else "none"

    @property
    def last(self) -> Mapping[str, Any]:
        return self.history[-1] if self.history else {}

    def last_with(self, state: str) -> Mapping[str, Any]:
        return next((run for run in reversed(self.history) if run.get("state") == state), {})

    def fits(self, chunk_size: int, chunks: int) -> bool:
        """The prompt and reference were made for this chunk geometry."""
        return bool(self.tokens) and bool(self.reference) and \
            (self.chunk_size, self.chunks) == (chunk_size, chunks)

    def with_run(self, run: Mapping[str, Any]) -> Record:
        """This record with ``run`` appended (and, if it failed, ``failed`` set)."""
        failed = self.failed or (dict(run) if run.get("state") == "failed" else {})
        return replace(self, history=(*self.history, dict(run))[-HISTORY:], failed=failed)

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "namespace": self.namespace, "state": self.state,
                "prompt": {"chunk_size": self.chunk_size, "chunks": self.chunks,
                           "tokens": list(self.tokens)},
                "reference": {"at": self.reference_at,
                              "steps": [s.to_dict() for s in self.reference]},
                "failed": dict(self.failed) or None,
                "history": [dict(r) for r in self.history], "warm_next": self.warm_next}

    def summary(self) -> dict[str, Any]:
        """What health, report and metrics show (no tokens)."""
        return {"state": self.state, "failed": dict(self.failed) or None,
                "last": dict(self.last) or None,
                "last_passed_at": self.last_with("passed").get("at"),
                "reference_at": self.reference_at or None}


def _run(doc: Any) -> dict[str, Any]:
    """A run as stored: a flat object of short strings, finite numbers, booleans, nulls and
    one nested ``verdict`` object of the same."""
    if not isinstance(doc, dict):
        raise ValueError("a run is not an object")
    out: dict[str, Any] = {}
    for k, v in list(doc.items())[:32]:
        if k in ("verdict", "warm_sample") and isinstance(v, dict):
            out[k] = _run(v)
        elif isinstance(v, str):
            out[k] = v[:_TEXT]
        elif v is None or isinstance(v, (bool, int, float)):
            out[k] = v
    if out.get("state") not in (*STATES, None) and "verdict" not in out:
        raise ValueError(f"a run's state is {str(out.get('state'))[:20]!r}")
    return out


def _obj(v: Any) -> dict[str, Any]:
    return v if isinstance(v, dict) else {}


def parse(doc: Mapping[str, Any], namespace: str) -> Record:
    """A record from its JSON (pure). Raises ValueError for anything malformed or for
    another namespace's record."""
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"schema is {str(doc.get('schema'))[:40]!r}, not {SCHEMA}")
    if doc.get("namespace") != namespace:
        raise ValueError(f"it is the record of {str(doc.get('namespace'))[:40]!r}")
    prompt = _obj(doc.get("prompt"))
    tokens = prompt.get("tokens", [])
    if not isinstance(tokens, list) or len(tokens) > MAX_PROMPT_TOKENS or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31 for t in tokens):
        raise ValueError("prompt.tokens is not a list of token ids")
    size, chunks = prompt.get("chunk_size", 0), prompt.get("chunks", 0)
    if not all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**20
               for v in (size, chunks)):
        raise ValueError("prompt.chunk_size or prompt.chunks is not a small integer")
    ref = _obj(doc.get("reference"))
    steps = steps_from(ref.get("steps", []))
    failed = doc.get("failed")
    history = doc.get("history", [])
    if not isinstance(history, list):
        raise ValueError("history is not a list")
    warm_next = doc.get("warm_next", 0)
    if not isinstance(warm_next, int) or isinstance(warm_next, bool) or \
            not 0 <= warm_next < 2**31:
        raise ValueError("warm_next is not a small integer")
    return Record(namespace, size, chunks, tuple(tokens), steps,
                  str(ref.get("at") or "")[:64],
                  _run(failed) if failed is not None else {},
                  tuple(_run(r) for r in history[-HISTORY:]), warm_next)


def read_record(path: str, namespace: str) -> Record | None:
    """The record at ``path`` (None: there is none). Raises UnreadableFile for one that
    cannot be read or is malformed."""
    fix = "`kvp-admin canary reset CONFIG --apply` starts the namespace's canary afresh"
    try:
        doc = read_json_object(path, follow=False, max_bytes=MAX_STATE_BYTES, fix=fix)
    except FileNotFoundError:
        return None
    try:
        return parse(doc, namespace)
    except ValueError as exc:
        raise UnreadableFile(path, str(exc), fix) from None


def write_record(path: str, record: Record, owner: tuple[int, int] | None = None) -> None:
    """Write ``record`` atomically, owner-only. ``owner`` (uid, gid): the record and its
    directory are given to that user (root writes it in the vLLM unit's readiness step; the
    service user's health timer reads and writes it again). Raises KvpError."""
    atomic_write_json(path, record.to_dict())
    if owner is None:
        return
    try:
        for p in (os.path.dirname(path), path):
            st = os.lstat(p)
            if (st.st_uid, st.st_gid) != owner:
                os.chown(p, *owner, follow_symlinks=False)
    except OSError as exc:
        raise KvpError(f"cannot give {path} to uid {owner[0]}: {exc.strerror or exc}") from exc


def record_owner(service_user: str) -> tuple[int, int] | None:
    """(uid, gid) the record belongs to when root writes it: the deployment's
    KVP_SERVICE_USER (None when not root, no such user, or root)."""
    if os.geteuid() != 0 or not service_user:
        return None
    import pwd

    try:
        pw = pwd.getpwnam(service_user)
    except KeyError:
        return None
    return (pw.pw_uid, pw.pw_gid) if pw.pw_uid != 0 else None


def remove_record(path: str) -> bool:
    """Delete the record (``canary reset --apply``); False when there was none."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


__all__ = ["CANARY_DIR", "HISTORY", "SCHEMA", "Record", "now_iso", "parse", "read_record",
           "record_owner", "record_path", "remove_record", "write_record"]
