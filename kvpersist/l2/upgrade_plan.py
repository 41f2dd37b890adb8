"""The plan of an upgrade from one deployment config to another (pure).

Every vLLM, LMCache or model upgrade changes the compatibility identity, so the namespace
(``kvp-<32 hex>``, LMCache's model name) changes too: the new deployment starts cold and the
old namespace's data becomes stale. :func:`plan_upgrade` turns the facts an action gathered
(:class:`UpgradeFacts`: the two identities, what ``kvp-admin report`` counts of the old
namespace on this host and on the shared tier, the new warm set) into the plan document
(schema ``kvpersist.upgrade-plan/1``): which fields change and why each changes the
namespace, the old namespace's data, what becomes stale and when, the new warm set's size,
and the exact commands in order. No filesystem, process or network here.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpersist.config.engine_flags import KV, flags_for
from kvpersist.config.identity import ALL_IDENTITY_KEYS
from kvpersist.system.vllm_seam import RELEASES, support_problem, table_version

SCHEMA = "kvpersist.upgrade-plan/1"
SAME = "same namespace: the cache carries over, nothing to do"
DIFFERENT = ("new namespace: NEW starts cold, and the old namespace's data becomes stale "
             "once no host serves it")
#: the reason of a field that is not in :data:`REASONS`
UNKNOWN_REASON = "part of the compatibility identity"
#: what the warm-up of a launch is told to compute the warm set with (docs/upgrades.md)
WARMUP_COMPUTE = "KVP_WARMUP_COMPUTE=1"

#: identity field -> why a change of it changes the namespace (one line each)
REASONS: dict[str, str] = {
    "model_id": "another model: the KV of different weights differs",
    "model_revision": "other weights: the KV of different weights differs",
    "tokenizer_name": "another tokenizer: the same text becomes other token ids, so other "
                      "chunk keys",
    "tokenizer_revision": "another tokenizer revision: the same text may become other token "
                          "ids, so other chunk keys",
    "kv_cache_dtype": "KV dtype: bytes per element differ",
    "block_size": "block size: key boundaries move (a chunk is whole blocks)",
    "num_kv_heads": "KV geometry: the shape of every block differs",
    "head_dim": "KV geometry: the shape of every block differs",
    "tensor_parallel_size": "tensor-parallel: the per-rank KV split differs",
    "connector": "another connector: another way of storing and naming KV",
    "connector_build": "LMCache version: its keys and serialized chunks may change between "
                       "versions",
    "vllm_build": "vLLM version: KV layouts change between versions",
    "max_model_len": "maximum length: part of the compatibility identity (caches of "
                     "different maximum lengths are kept apart)",
    "chat_template_sha256": "chat template: the same conversation renders to other tokens",
    "engine_args": "KV-affecting vLLM flags: other kernels or layouts compute other KV bytes",
}

#: identity field -> what switching to NEW means for it (the install step's note)
SWITCH: dict[str, str] = {
    "model_id": "put NEW's weights at its KVP_MODEL_PATH",
    "model_revision": "put NEW's weights at its KVP_MODEL_PATH",
    "tokenizer_name": "NEW's tokenizer comes with its weights",
    "tokenizer_revision": "NEW's tokenizer comes with its weights",
    "vllm_build": "install NEW's vLLM build",
    "connector_build": "install NEW's LMCache",
    "chat_template_sha256": "NEW's chat template comes with its weights",
}


def reason(name: str) -> str:
    """Why a change of identity field ``name`` changes the namespace."""
    return REASONS.get(name, UNKNOWN_REASON)


@dataclass(frozen=True)
class Side:
    """One of the two deployments, as the plan names it."""

    #: the CONFIG argument as given (the step commands repeat it)
    arg: str
    name: str
    source: str
    namespace: str
    cache_root: str
    #: the shared tier's endpoint, or '' without one
    shared_tier: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"config": self.arg, "name": self.name, "source": self.source,
                "namespace": self.namespace, "cache_root": self.cache_root,
                "shared_tier": self.shared_tier or None}


@dataclass(frozen=True)
class LocalData:
    """The old namespace on this host's cache root, from its row of ``kvp-admin report``."""

    root: str
    files: int
    bytes: int
    pinned_files: int
    pinned_bytes: int
    #: the row's status in that report (``stale`` once NEW is the configured deployment)
    status: str | None

    @classmethod
    def from_report(cls, doc: Mapping[str, Any], namespace: str) -> LocalData:
        """The figures of ``namespace`` in a ``kvpersist.report/1`` document (0 without a
        row: it holds no file there)."""
        row = next((r for r in doc.get("namespaces", []) if r.get("prefix") == namespace), None)
        if row is None:
            return cls(str(doc.get("root", "")), 0, 0, 0, 0, None)
        pins = row.get("warm_pins") or {}
        return cls(str(doc.get("root", "")), int(row["files"]), int(row["bytes"]),
                   int(pins.get("files", 0)), int(pins.get("bytes", 0)), row.get("status"))

    def to_dict(self) -> dict[str, Any]:
        return {"root": self.root, "files": self.files, "bytes": self.bytes,
                "pinned_files": self.pinned_files, "pinned_bytes": self.pinned_bytes,
                "report_status": self.status}


@dataclass(frozen=True)
class SharedData:
    """The old namespace on the shared tier, from ``report --tier shared``'s row: its keys,
    bytes and the hosts whose fleet records name it."""

    endpoint: str
    keys: int = 0
    bytes: int = 0
    hosts: tuple[Mapping[str, Any], ...] = ()

    @classmethod
    def from_report(cls, doc: Mapping[str, Any], namespace: str) -> SharedData:
        endpoint = str((doc.get("tier") or {}).get("endpoint", ""))
        row = next((r for r in doc.get("namespaces", []) if r.get("namespace") == namespace),
                   None)
        if row is None:
            return cls(endpoint)
        return cls(endpoint, int(row["keys"]), int(row["bytes"]), tuple(row.get("hosts", ())))

    def to_dict(self) -> dict[str, Any]:
        return {"endpoint": self.endpoint, "keys": self.keys, "bytes": self.bytes,
                "hosts": [dict(h) for h in self.hosts]}


@dataclass(frozen=True)
class WarmFacts:
    """NEW's warm set: its entries, and (when its token ids are cached for NEW's namespace)
    the tokens and the chunks the warm-up would request."""

    file: str = ""
    entries: int = 0
    tokens: int | None = None
    #: complete chunks per rank (what LMCache keys: ``tokens // chunk_size`` per entry)
    chunks: int | None = None
    world_size: int = 1
    chunk_size: int = 0
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file or None, "entries": self.entries, "tokens": self.tokens,
                "chunks": self.chunks,
                "chunk_files": None if self.chunks is None else self.chunks * self.world_size,
                "world_size": self.world_size, "chunk_size": self.chunk_size,
                "note": self.note or None}


@dataclass(frozen=True)
class VllmChange:
    """The vLLM releases of OLD and NEW (None: not named) and the flags each config sets
    (KVP_ENGINE_ARGS and KVP_VLLM_EXTRA_ARGS, by dest, read with its own release's table)."""

    old: str | None
    new: str | None
    old_dests: tuple[str, ...] = ()
    new_dests: tuple[str, ...] = ()


def vllm_section(c: VllmChange) -> dict[str, Any] | None:
    """What a change of vLLM release means for this deployment (pure; None when both
    configs name the same release): the releases and what was tested of NEW's, how each
    starts its API server, the flags kvpersist renders, the flags the deployment sets whose
    class, spelling or existence differs, and the KV-affecting flags NEW's release adds."""
    if c.old == c.new:
        return None
    a, b = table_version(c.old), table_version(c.new)
    fa, fb = flags_for(a), flags_for(b)
    flags = []
    for dest in sorted(set(c.old_dests) | set(c.new_dests)):
        old, new = fa.get(dest), fb.get(dest)
        known = new or old
        name = known.name if known is not None else dest
        if new is None:
            flags.append({"flag": name, "dest": dest, "old_class": old and old.cls,
                          "new_class": None, "what": f"vLLM {b} has no such flag: remove it "
                          "from NEW's config"})
        elif old is None:
            flags.append({"flag": name, "dest": dest, "old_class": None,
                          "new_class": new.cls, "what": f"new in vLLM {b}"})
        elif old.cls != new.cls:
            flags.append({"flag": name, "dest": dest, "old_class": old.cls,
                          "new_class": new.cls, "what": "classified differently"})
        elif set(new.options) != set(old.options):
            gained = sorted(set(new.options) - set(old.options))
            flags.append({"flag": name, "dest": dest, "old_class": old.cls,
                          "new_class": new.cls,
                          "what": f"vLLM {b} also spells it {' '.join(gained)}; the "
                                  "canonical form (the namespace's) is the same"})
    added_kv = sorted(f.name for d, f in fb.items() if d not in fa and f.cls == KV)
    ra, rb = RELEASES[a], RELEASES[b]
    return {
        "old": c.old, "new": c.new,
        "supported": {"old": not support_problem(c.old, "OLD's"),
                      "new": not support_problem(c.new, "NEW's")},
        "new_tested": rb.tested,
        "serve": {"old": list(ra.serve), "new": list(rb.serve),
                  "model_positional": {"old": ra.model_positional, "new": rb.model_positional}},
        "rendered_flags": {"added": [f for f in rb.rendered_flags if f not in ra.rendered_flags],
                           "removed": [f for f in ra.rendered_flags
                                       if f not in rb.rendered_flags]},
        "deployment_flags": flags,
        "new_kv_flags": added_kv,
        "flag_counts": {"old": len(fa), "new": len(fb)},
    }


def install_command(version: str | None) -> str | None:
    """How to install a supported GPU release of vLLM (None for 0.32's CPU build, which the
    plain setup installs, or a release kvpersist does not support)."""
    rel = RELEASES.get(version or "")
    if rel is None or "vllm" not in rel.distributions or rel.version == "0.32.0":
        return None
    return _cmd("bash", "scripts/setup.sh", "--vllm", rel.version)


@dataclass(frozen=True)
class UpgradeFacts:
    """What the action gathered; every figure comes from code that ``kvp-admin report`` and
    the warm-up run."""

    old: Side
    new: Side
    #: (field, old value, new value) of the identity fields that differ
    changes: tuple[tuple[str, Any, Any], ...]
    #: True when OLD and NEW are the same file (then a restart is ``restart NEW``)
    same_config: bool = False
    local: LocalData | None = None
    shared: SharedData | None = None
    #: NEW uses the very shared tier OLD does
    same_tier: bool = False
    warm: WarmFacts = field(default_factory=WarmFacts)
    problems: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    vllm: VllmChange = field(default_factory=lambda: VllmChange(None, None))

    @property
    def same_namespace(self) -> bool:
        return self.old.namespace == self.new.namespace


def _cmd(*words: str, env: str = "") -> str:
    return (f"{env} " if env else "") + " ".join(shlex.quote(w) for w in words)


def _step(what: str, command: str | None, note: str = "") -> dict[str, Any]:
    return {"what": what, "command": command, "note": note or None}


def _value(v: Any) -> str:
    if isinstance(v, dict):
        return ",".join(f"{k}={x}" for k, x in sorted(v.items())) or "(none)"
    return str(v)


def switch_note(changes: Sequence[tuple[str, Any, Any]]) -> str:
    """The install/switch step's note: each changed field's key, old -> new, and what to do."""
    parts = []
    for name, a, b in changes:
        key = ALL_IDENTITY_KEYS.get(name, name)
        hint = SWITCH.get(name)
        parts.append(f"{key} {_value(a)} -> {_value(b)}" + (f" ({hint})" if hint else ""))
    return "; ".join(parts)


def steps(f: UpgradeFacts) -> list[dict[str, Any]]:
    """The commands of the upgrade, in order (pure). The same namespace: only the restart."""
    old, new = f.old, f.new
    if f.same_namespace:
        if f.same_config:
            return [_step("restart on NEW (the namespace is the same)",
                          _cmd("kvp-admin", "restart", new.arg))]
        return [_step("restart on NEW (the namespace is the same)",
                      _cmd("kvp-admin", "stop", old.arg) + " && "
                      + _cmd("kvp-admin", "launch", new.arg),
                      "OLD and NEW are different files: stop OLD's processes, launch NEW's")]
    out = []
    install = install_command(f.vllm.new) if f.vllm.old != f.vllm.new else None
    if install:
        out.append(_step(f"install vLLM {f.vllm.new} beside the running deployment", install,
                         f"a venv with vLLM {f.vllm.new}'s GPU wheel and LMCache 0.5.6 "
                         "(docs/vllm-versions.md); then `kvp-admin identity check NEW` with "
                         "its kvp-admin"))
    out += [_step("stop OLD", _cmd("kvp-admin", "stop", old.arg),
                  "vLLM first (it drains what is in flight), then the cache server; its L2 "
                  "files stay; a clean stop deletes this host's fleet record of the old "
                  "namespace"),
            _step("install/switch to NEW", None, switch_note(f.changes))]
    if f.warm.file:
        out.append(_step("launch NEW, computing its warm set before serving",
                         _cmd("kvp-admin", "launch", new.arg, env=WARMUP_COMPUTE),
                         f"{WARMUP_COMPUTE} makes the warm-up compute the warm set's KV "
                         "(the new namespace has none on disk) before NEW reports ready; "
                         "without it NEW serves cold"))
    else:
        out.append(_step("launch NEW", _cmd("kvp-admin", "launch", new.arg),
                         "NEW has no warm set (KVP_WARMUP_FILE): it serves cold"))
    out.append(_step("check NEW", _cmd("kvp-admin", "health", new.arg),
                     "exit 0 healthy, 1 degraded, 2 down, 3 warming"))
    # the old namespace is stale only where NEW, not OLD, is the configured deployment:
    # --config NEW; --root when the old data is on another cache root
    where: list[str] = []
    if f.local is not None and f.local.root and f.local.root != new.cache_root:
        where = ["--root", f.local.root]
    tier: list[str] = ["--tier", "all"] if f.shared is not None and f.same_tier else []
    out.append(_step("see the old namespace stale",
                     _cmd("kvp-admin", "report", *where, "--config", new.arg, *tier),
                     f"{old.namespace} is listed as stale"
                     + (" (on the shared tier: active while a host's fleet record names it)"
                        if tier else "")))
    prune = ["kvp-admin", "prune", *where, "--config", new.arg, "--namespace", old.namespace,
             *tier]
    out.append(_step("dry run: what deleting the old namespace would delete", _cmd(*prune)))
    out.append(_step("delete the old namespace", _cmd(*prune, "--apply"),
                     "refused while a host still serves it on the shared tier" if tier
                     else ""))
    if f.shared is not None and not f.same_tier:
        shared = ["kvp-admin", "prune", "--tier", "shared", "--config", old.arg,
                  "--namespace", old.namespace, "--force"]
        note = ("NEW does not use OLD's shared tier: name it through OLD, whose namespace "
                "it is (hence --force); first check that no host serves it (kvp-admin report "
                f"--tier shared --config {shlex.quote(old.arg)}: HOSTS)")
        out.append(_step("dry run on OLD's shared tier", _cmd(*shared), note))
        out.append(_step("delete the old namespace on OLD's shared tier",
                         _cmd(*shared, "--apply")))
    return out


def stale(f: UpgradeFacts) -> dict[str, Any] | None:
    """What becomes stale, and when (None: the same namespace, nothing does)."""
    if f.same_namespace:
        return None
    hosts = [dict(h) for h in f.shared.hosts] if f.shared is not None else []
    local = f.local
    out: dict[str, Any] = {
        "namespace": f.old.namespace,
        "local_files": local.files if local else None,
        "local_bytes": local.bytes if local else None,
        "local_when": "once OLD is stopped and NEW is this root's configured deployment",
        "shared_keys": f.shared.keys if f.shared else None,
        "shared_bytes": f.shared.bytes if f.shared else None,
        "serving_hosts": hosts,
        "shared_when": None,
    }
    if f.shared is not None:
        out["shared_when"] = ("now: no host's fleet record names it" if not hosts else
                              f"once no host serves it: {len(hosts)} host(s) do now "
                              "(their records go at a clean stop or lapse)")
    return out


def plan_upgrade(f: UpgradeFacts) -> dict[str, Any]:
    """The plan document (schema ``kvpersist.upgrade-plan/1``) of ``f`` (pure)."""
    changes = [{"field": name, "env_key": ALL_IDENTITY_KEYS.get(name, name), "old": a,
                "new": b, "reason": reason(name)} for name, a, b in f.changes]
    return {
        "schema": SCHEMA,
        "old": f.old.to_dict(),
        "new": f.new.to_dict(),
        "same_namespace": f.same_namespace,
        "verdict": SAME if f.same_namespace else DIFFERENT,
        "changes": changes,
        "old_data": {"local": f.local.to_dict() if f.local else None,
                     "shared": f.shared.to_dict() if f.shared else None},
        "stale": stale(f),
        "warm_set": f.warm.to_dict(),
        "vllm": vllm_section(f.vllm),
        "steps": [{"step": i, **s} for i, s in enumerate(steps(f), 1)],
        "problems": list(f.problems),
        "notes": list(f.notes),
    }
