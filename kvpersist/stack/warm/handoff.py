"""What a launch hands its warm-up child of the rendered plan: vLLM's arguments (vLLM's
renderer computes the warm set's token ids from them) and the cache server's (they name
LMCache's key scheme). The launch writes it once (:func:`write_handoff`, owner-only, in the
state dir), the child reads it (:func:`read_handoff`, as untrusted: bounded, typed), so the
child never loads the templates or renders again; and, when the launch starts the child
early (while vLLM loads), the gate the child waits at before it sends anything to vLLM
(:mod:`kvpersist.stack.warm.gate`; '' : none, the child runs straight through). A warm-up run
by hand (``kvp-admin warmup``) renders the deployment itself.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvpersist.errors import ConfigError, Problem
from kvpersist.system.files import atomic_write_json
from kvpersist.system.untrusted import MAX_STATE_BYTES, UnreadableFile, read_json_object

SCHEMA = "kvpersist.warmup-handoff/1"


@dataclass(frozen=True)
class Handoff:
    """The parts of a rendered plan the warm-up uses."""

    vllm_argv: tuple[str, ...]
    server_argv: tuple[str, ...]
    #: the gate file of an early start ('' : none)
    gate: str = ""

    @classmethod
    def of(cls, vllm_argv: Sequence[str], server_argv: Sequence[str],
           gate: str = "") -> Handoff:
        return cls(tuple(vllm_argv), tuple(server_argv), gate)


def write_handoff(path: str, h: Handoff, ids: tuple[int, int] | None = None) -> None:
    """Write ``h`` to ``path`` (atomically, owner-only; owned by ``ids`` when given: the
    service user the child runs as). Raises KvpError when it cannot be written."""
    doc: dict[str, object] = {"schema": SCHEMA, "vllm_argv": list(h.vllm_argv),
                              "lmcache_server_argv": list(h.server_argv)}
    if h.gate:
        doc["gate"] = h.gate
    atomic_write_json(path, doc)
    if ids is not None:
        os.chown(path, *ids, follow_symlinks=False)


def read_handoff(path: str) -> Handoff:
    """The handoff at ``path``. Raises ConfigError (exit 2) naming the file when it is not
    one (absent, too big, not the schema, a field of another type)."""
    fix = "let `kvp-admin launch` start the warm-up, or run `kvp-admin warmup CONFIG` alone"
    try:
        doc = read_json_object(path, max_bytes=MAX_STATE_BYTES, follow=False)
    except FileNotFoundError:
        raise ConfigError(Problem(path, "no such file", fix)) from None
    except UnreadableFile as exc:
        raise ConfigError(Problem(path, exc.why, fix)) from None
    argvs = [doc.get("vllm_argv"), doc.get("lmcache_server_argv")]
    gate = doc.get("gate", "")
    if doc.get("schema") != SCHEMA or not isinstance(gate, str) or not all(
            isinstance(a, list) and all(isinstance(x, str) for x in a) for a in argvs):
        raise ConfigError(Problem(path, f"is not a {SCHEMA} document", fix))
    return Handoff.of(argvs[0], argvs[1], gate)  # type: ignore[arg-type]
