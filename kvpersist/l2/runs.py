"""The record of the last ``verify`` and ``prune`` on a cache root (I/O).

Each finished ``kvp-admin verify`` and ``kvp-admin prune --apply`` writes a small JSON document
(``kvpersist.run/1``) to ``<root>/.kvpersist/runs/<kind>.json``: when it finished, whether it
succeeded, and its counts. ``kvp-admin metrics`` exports them (``kvpersist_last_verify_*``,
``kvpersist_last_prune_*``), so an alert can say that verify is overdue. The record lives under
the root, not under a deployment's state dir, because both commands may be run against a root
alone.

Recording never fails the command that recorded: a root this user may read but not write
(or a ``.kvpersist`` that is a symlink) gives a warning instead. Everything is opened relative to
directory descriptors, never through a symlink. A record is read as untrusted
(:mod:`kvpersist.system.untrusted`): one that is not a regular file, bigger than
:data:`~kvpersist.system.untrusted.MAX_RECORD_BYTES`, not JSON, nested, or of the wrong shape
is a problem naming it and counts as no record (the run is then not exported).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

from kvpersist.errors import KvpError
from kvpersist.l2.layout import META_DIR, RUNS_DIR
from kvpersist.l2.tree import RootDir, meta_dir, open_rel, replace_at
from kvpersist.system.untrusted import MAX_RECORD_BYTES, UnreadableFile, read_json_object

SCHEMA = "kvpersist.run/1"
KINDS = ("verify", "prune")


def run_record(kind: str, *, ok: bool, finished_ns: int, counts: dict[str, int],
               mode: str = "") -> dict[str, Any]:
    """The document recorded for one run (pure)."""
    if kind not in KINDS:
        raise ValueError(f"unknown run kind {kind!r}")
    return {"schema": SCHEMA, "kind": kind, "finished_ns": finished_ns, "ok": ok,
            "mode": mode, "counts": {k: int(v) for k, v in counts.items()}}


def record_run(root: RootDir, kind: str, *, ok: bool, counts: dict[str, int],
               mode: str = "", finished_ns: int | None = None) -> str | None:
    """Record a finished run of ``kind`` on the open ``root``; None, or a warning when it could
    not be recorded (the run itself stands)."""
    doc = run_record(kind, ok=ok, counts=counts, mode=mode,
                     finished_ns=time.time_ns() if finished_ns is None else finished_ns)
    data = (json.dumps(doc, sort_keys=True) + "\n").encode()
    final = f"{kind}.json"
    try:
        dfd = meta_dir(root, RUNS_DIR)
        try:
            replace_at(dfd, final, data)
        finally:
            os.close(dfd)
    except KvpError as exc:
        return f"the {kind} run was not recorded for metrics: {exc}"
    except OSError as exc:
        return (f"the {kind} run was not recorded for metrics: "
                f"{os.path.join(root.given or root.path, META_DIR, RUNS_DIR, final)}: "
                f"{exc.strerror or exc}")
    return None


def read_runs(root: RootDir) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """The recorded runs of the open ``root`` by kind (a kind never recorded is absent), and
    problems met (a record that is unreadable or not ours). Never creates anything."""
    runs: dict[str, dict[str, Any]] = {}
    problems: list[str] = []
    try:
        dfd = open_rel(root.fd, f"{META_DIR}/{RUNS_DIR}")
    except FileNotFoundError:
        return runs, problems
    except OSError as exc:
        return runs, [f"{META_DIR}/{RUNS_DIR}: {exc.strerror or exc}"]
    try:
        for kind in KINDS:
            doc, problem = _read(dfd, f"{kind}.json", kind)
            if doc is not None:
                runs[kind] = doc
            if problem:
                problems.append(problem)
    finally:
        os.close(dfd)
    return runs, problems


def _read(dfd: int, name: str, kind: str) -> tuple[dict[str, Any] | None, str]:
    """The record ``name`` in the runs directory ``dfd``, or (None, why it is not one)."""
    where = f"{META_DIR}/{RUNS_DIR}/{name}"
    try:
        doc = read_json_object(name, dir_fd=dfd, follow=False, max_bytes=MAX_RECORD_BYTES,
                               max_containers=8, where=where)
    except FileNotFoundError:
        return None, ""
    except UnreadableFile as exc:
        return None, f"{where}: {exc.why}; ignored"
    counts = doc.get("counts")
    if (doc.get("schema") != SCHEMA or doc.get("kind") != kind
            or not _is_int(doc.get("finished_ns")) or not isinstance(doc.get("ok"), bool)
            or not isinstance(counts, dict) or not all(_is_int(v) for v in counts.values())
            or not isinstance(doc.get("mode", ""), str)):
        return None, f"{where}: not a kvpersist run record; ignored"
    return doc, ""


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
