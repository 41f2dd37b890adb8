"""Use case: forget one conversation on every tier (``kvp-admin forget``).

Steps, each in its own layer:

1. load CONFIG (a full identity: an unpinned namespace is a one-off that nothing reuses) and
   read the input file as untrusted bytes (:mod:`kvpersist.stack.conversation.input`: a
   conversation becomes the requests it was sent as);
2. token ids as the deployment computes them: vLLM's own renderer with the deployment's
   tokenizer and chat template, its digest checked against the identity
   (:func:`kvpersist.stack.warm.tokens.tokenize`, the warm-up's code); ``--token-ids`` as given;
3. the chunk keys with LMCache's own key code, per TP rank, with the cache salt
   (:mod:`kvpersist.stack.conversation.chunk_keys`), parse-checked into a frozen plan with the
   namespace's warm-set pins (:func:`kvpersist.l2.forget.plan.plan_forget`);
4. the tiers, in this order: the NVMe files (:func:`kvpersist.l2.forget.remove.forget_files`, under
   the root's prune lock), the shared tier's keys (:func:`kvpersist.l2.forget.shared.
   forget_keys`), then the running server's memory: L1, and the NVMe adapter's index
   (:mod:`kvpersist.stack.conversation.l1`). Files first: once they are gone no lookup can bring
   a chunk back from disk while its L1 copy is being dropped.

A dry run (the default) measures every tier and deletes nothing; the server is only asked
whether it answers (its admin API cannot list what L1 holds without deleting it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvpersist.config.loader import load_deployment
from kvpersist.errors import ConfigError, KvpError, Problem, UsageError
from kvpersist.l2.forget.plan import SCHEMA, ForgetPlan, plan_forget
from kvpersist.l2.forget.remove import FilesOutcome, forget_files
from kvpersist.l2.forget.shared import KeysOutcome, forget_keys
from kvpersist.l2.inventory import open_existing
from kvpersist.l2.pins.store import read_pins
from kvpersist.l2.shared.credentials import read_secret_file
from kvpersist.l2.shared.store import connect, describe, store_errors
from kvpersist.l2.tree import RootDir
from kvpersist.stack.conversation import l1 as forget_l1
from kvpersist.stack.conversation.chunk_keys import chunk_keys
from kvpersist.stack.conversation.input import MAX_BYTES, ForgetInput, parse_input
from kvpersist.stack.locate import locate
from kvpersist.stack.render import TEMPLATE_NAMES, render
from kvpersist.stack.warm.chunk_keys import key_scheme
from kvpersist.stack.warm.run import world_size
from kvpersist.stack.warm.tokens import tokenize
from kvpersist.system.files import service_uids
from kvpersist.system.software import running_vllm_version
from kvpersist.system.templates import read_templates
from kvpersist.system.untrusted import UnreadableFile, read_bytes, show_path


@dataclass
class MemoryOutcome:
    """The running server's memory: L1 and the NVMe adapter's index."""

    url: str
    state: str = "dry_run"  # dry_run / not_running / deleted / failed
    answers: bool = False
    requested_keys: int = 0
    deleted_keys: int = 0
    skipped_locked: int = 0
    index_dropped_keys: int = 0
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "state": self.state, "server_answers": self.answers,
                "requested_keys": self.requested_keys, "deleted_keys": self.deleted_keys,
                "skipped_locked": self.skipped_locked,
                "index_dropped_keys": self.index_dropped_keys, "error": self.error}


@dataclass
class SharedOutcome:
    """The shared tier, when the deployment has one."""

    configured: bool
    state: str = "none"  # none / checked / deleted / failed
    keys: KeysOutcome | None = None
    error: str = ""

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"configured": self.configured, "state": self.state,
                             "error": self.error}
        if self.keys is not None:
            d.update(self.keys.to_dict())
        return d


@dataclass
class ForgetResult:
    """What a forget found and did (or, for a dry run, would do) on every tier."""

    namespace: str
    dry_run: bool
    input_kind: str
    input_file: str
    world_size: int
    chunk_size: int
    plan: ForgetPlan
    nvme: FilesOutcome
    memory: MemoryOutcome
    shared: SharedOutcome
    warnings: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        """Why the forget is not complete (exit 1); empty when it is."""
        out = [f"NVMe: {e}" for e in self.nvme.errors]
        if self.nvme.changed:
            out.append(f"NVMe: {self.nvme.changed} file(s) changed while being forgotten "
                       "(written again): run it again")
        if self.memory.state == "failed":
            out.append(f"server memory: {self.memory.error}")
        if self.memory.skipped_locked:
            out.append(f"server memory: {self.memory.skipped_locked} key(s) in use by a "
                       "request in flight were kept in L1: run it again")
        if self.shared.state == "failed":
            out.append(f"shared tier: {self.shared.error}")
        return out

    @property
    def exit_code(self) -> int:
        return 1 if self.problems else 0

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, "namespace": self.namespace, "dry_run": self.dry_run,
                "cache_salt": self.plan.salt or None,
                "include_pinned": self.plan.include_pinned,
                "input": {"kind": self.input_kind, "file": self.input_file},
                "world_size": self.world_size, "chunk_size": self.chunk_size,
                "plan": self.plan.to_dict(),
                "tiers": {"nvme": self.nvme.to_dict(), "memory": self.memory.to_dict(),
                          "shared": self.shared.to_dict()},
                "problems": self.problems, "warnings": self.warnings,
                "exit_code": self.exit_code}


def read_input(kind: str, path: str) -> ForgetInput:
    """Read and parse the input file (a link is followed; what it names must be a regular
    file of at most :data:`~kvpersist.stack.conversation.input.MAX_BYTES`). Raises ConfigError."""
    shown = show_path(path)
    try:
        data = read_bytes(path, max_bytes=MAX_BYTES)
    except FileNotFoundError:
        raise ConfigError(Problem(shown, "cannot be read: no such file")) from None
    except UnreadableFile as exc:
        raise ConfigError(Problem(exc.path, exc.why)) from None
    return parse_input(kind, data, shown)


def forget(config: str, *, kind: str, path: str, cache_salt: str = "",
           include_pinned: bool = False, apply: bool = False) -> ForgetResult:
    """Forget the conversation (``kind`` messages / prompt / token_ids, in the file ``path``)
    of CONFIG's namespace on every tier; a dry run unless ``apply`` (see the module
    docstring).

    Returns the result (its ``exit_code`` 1 when a tier could not be completed). Raises
    ConfigError (exit 2) for a config, input file or salt that is wrong, UsageError when the
    namespace is unpinned, PruneLocked when a prune holds the cache root."""
    dep = load_deployment(config)
    if dep.identity is None:
        raise UsageError(f"{dep.source}: the identity is incomplete, so the namespace is a "
                         "one-off that nothing reuses: there is nothing to forget")
    loc = locate(dep)
    inp = read_input(kind, path)
    # the sizes enter neither the keys nor the tokens; the arguments are those of the vLLM
    # installed here, whose renderer computes the tokens
    rendered = render(dep, read_templates(TEMPLATE_NAMES), l1_size_gb=dep.settings.l1_size_gb,
                      l2_capacity_gb=1.0, vllm_version=running_vllm_version(
                          dep.vllm_version, direct_process=True))
    if inp.entries:
        sequences = tokenize(rendered.vllm_argv, dep.settings.model_path, inp.entries,
                             expected_template_sha256=dep.identity.chat_template_sha256,
                             source=inp.source).token_ids
    else:
        sequences = [list(inp.token_ids)]
    scheme = key_scheme(rendered.lmcache_server_argv)
    ws = world_size(dep)
    keys = chunk_keys(scheme, dep.lmcache_model_name, ws, sequences, cache_salt)
    warnings: list[str] = []
    try:
        root: RootDir | None = open_existing(loc.cache_root, purpose="forget a conversation on")
    except UsageError as exc:
        root = None
        warnings.append(f"no cache root: {exc}")
    try:
        plan = _plan(root, dep.namespace, keys, sequences, cache_salt, include_pinned, warnings)
        nvme = (forget_files(root, plan.targets, apply=apply, kept=plan.kept)
                if root is not None else FilesOutcome(loc.cache_root, not apply, "no_root"))
    finally:
        if root is not None:
            root.close()
    shared = _shared(dep, plan, apply)
    memory = _memory(loc.server_http_url, dep.lmcache_model_name, plan, apply)
    return ForgetResult(dep.namespace, not apply, kind, inp.source, ws, scheme.chunk_size,
                        plan, nvme, memory, shared, warnings)


def _plan(root: RootDir | None, namespace: str, keys: Any, sequences: Any, salt: str,
          include_pinned: bool, warnings: list[str]) -> ForgetPlan:
    pinned: frozenset[str] = frozenset()
    held = ""
    if root is not None:
        pins = read_pins(root)
        warnings.extend(pins.problems)
        if pins.unreadable_dir:
            held = pins.unreadable_dir
        elif namespace in pins.pins:
            pset = pins.pins[namespace]
            pinned, held = pset.files, pset.unreadable
    try:
        return plan_forget(namespace, keys, request_tokens=[len(s) for s in sequences],
                           salt=salt, pinned=pinned, pins_held=held,
                           include_pinned=include_pinned)
    except ValueError as exc:
        raise KvpError(f"LMCache's key code and kvpersist's file-name parser disagree: {exc}; "
                       "nothing was forgotten") from None


def _shared(dep: Any, plan: ForgetPlan, apply: bool) -> SharedOutcome:
    tier = dep.shared
    if tier is None:
        return SharedOutcome(False)
    out = SharedOutcome(True, "deleted" if apply else "checked")
    try:
        secret = read_secret_file(dep.settings.shared_tier_secret_file,
                                  also=service_uids(dep.settings.service_user))
        store = connect(tier, secret)
    except KvpError as exc:
        out.state, out.error = "failed", str(exc)
        return out
    try:
        out.keys = forget_keys(store, plan.namespace, [k.wire_key for k in plan.targets],
                               apply=apply, kept=[k.wire_key for k in plan.kept])
    except store_errors() as exc:
        out.state, out.error = "failed", describe(exc)
    finally:
        store.close()
    return out


def _memory(url: str, model_name: str, plan: ForgetPlan, apply: bool) -> MemoryOutcome:
    out = MemoryOutcome(url, requested_keys=len(plan.targets))
    out.answers = forget_l1.answers(url)
    if not apply:
        return out
    if not out.answers:
        out.state = "not_running"
        return out
    body = [k.encoded(model_name) for k in plan.targets]
    try:
        l1 = forget_l1.delete_from_l1(url, body)
        out.deleted_keys, out.skipped_locked = l1.deleted, l1.skipped
        index = forget_l1.delete_objects(url, body, tier="l2", adapter=forget_l1.NVME_ADAPTER)
        out.index_dropped_keys = index.deleted
    except forget_l1.ServerDown:
        out.state = "not_running"
        return out
    except KvpError as exc:
        out.state, out.error = "failed", str(exc)
        return out
    out.state = "deleted"
    return out
