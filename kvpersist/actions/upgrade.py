"""Use case: plan an upgrade from one deployment config to another (``kvp-admin upgrade
plan``). Read-only: it loads the two configs, asks ``kvp-admin report``'s own functions what
the old namespace holds on this host and on the shared tier, reads the new warm set, and
hands the facts to the pure :mod:`kvpersist.l2.upgrade_plan`."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvpersist.actions.shared import report_shared
from kvpersist.config.deployment import Deployment
from kvpersist.config.engine_args import parse
from kvpersist.config.identity import diff_identities
from kvpersist.config.loader import load_deployment
from kvpersist.config.warmset import parse_tokens_document, tokens_cache_name
from kvpersist.errors import KvpError, UsageError
from kvpersist.l2.inventory import open_existing, real_root, resolve_inventory
from kvpersist.l2.report import report_on
from kvpersist.l2.tree import open_dir
from kvpersist.l2.upgrade_plan import (
    LocalData,
    SharedData,
    Side,
    UpgradeFacts,
    VllmChange,
    WarmFacts,
    plan_upgrade,
)
from kvpersist.stack.locate import locate
from kvpersist.stack.warm.run import (
    TOKENS_MAX_BYTES,
    TOKENS_MAX_CONTAINERS,
    read_warm_set,
    world_size,
)
from kvpersist.system.untrusted import UnreadableFile, read_json, show_path


@dataclass(frozen=True)
class UpgradePlan:
    """The plan document and the facts it was made from."""

    facts: UpgradeFacts

    def to_dict(self) -> dict[str, Any]:
        return plan_upgrade(self.facts)


def _load(config: str, which: str) -> Deployment:
    dep = load_deployment(config)
    if dep.identity is None:  # KVP_ALLOW_UNPINNED=true in the file
        raise UsageError(f"{which} {config}: the identity is unpinned (a one-off namespace "
                         "that is never reused): there is no namespace to upgrade from or to")
    return dep


def _side(arg: str, dep: Deployment) -> Side:
    tier = dep.shared
    return Side(arg, dep.name, dep.source, dep.namespace, real_root(dep.settings.cache_root),
                tier.endpoint if tier is not None else "")


def plan(old_config: str, new_config: str) -> UpgradePlan:
    """The plan of upgrading from ``old_config`` to ``new_config`` (both deployment
    configs). Raises ConfigError/UsageError (exit 2) for a config that does not load, is
    unpinned, or a warm set of NEW that does not parse; a cache root or a shared tier that
    cannot be read is a problem in the plan, not an error. Writes nothing."""
    old, new = _load(old_config, "OLD"), _load(new_config, "NEW")
    assert old.identity is not None and new.identity is not None
    problems: list[str] = []
    notes: list[str] = []
    a, b = _side(old_config, old), _side(new_config, new)
    local = _local(old, new_config, problems, notes)
    shared, same_tier = None, False
    old_tier = old.shared
    if old_tier is not None:
        same_tier = old_tier == new.shared
        shared = _shared(old_config, old.namespace, old_tier.endpoint, problems)
    facts = UpgradeFacts(
        a, b, tuple(diff_identities(old.identity, new.identity)),
        same_config=os.path.realpath(old.source) == os.path.realpath(new.source),
        local=local, shared=shared, same_tier=same_tier, warm=_warm(new),
        problems=tuple(problems), notes=tuple(notes),
        vllm=VllmChange(old.vllm_version, new.vllm_version, _dests(old), _dests(new)))
    return UpgradePlan(facts)


def _dests(dep: Deployment) -> tuple[str, ...]:
    """The vLLM flags a deployment sets: its KVP_ENGINE_ARGS and KVP_VLLM_EXTRA_ARGS (read
    with the flag table of the release it names; both were checked when it loaded)."""
    engine = dict(dep.identity_values.get("engine_args", {}))
    extra = parse(dep.settings.vllm_extra_args, dep.vllm_version).dests
    return tuple(sorted(set(engine) | set(extra)))


def _local(old: Deployment, new_config: str, problems: list[str],
           notes: list[str]) -> LocalData | None:
    """The old namespace's row of ``kvp-admin report --root OLDROOT --config NEW``: the
    report NEW's operator runs after the switch (NEW configured, so the old namespace is
    stale there)."""
    root = old.settings.cache_root
    if not os.path.lexists(root):
        notes.append(f"OLD's cache root {show_path(root)} does not exist on this host: "
                     "nothing of the old namespace is on its NVMe")
        return LocalData(real_root(root), 0, 0, 0, 0, None)
    try:
        inv = resolve_inventory(root, (new_config,))
        with open_existing(inv.root) as handle:
            doc = report_on(handle, inv).to_dict()
    except KvpError as exc:
        problems.append(f"OLD's cache root {show_path(root)}: {exc}")
        return None
    notes.extend(f"report: {n}" for n in doc.get("notes", ()))
    return LocalData.from_report(doc, old.namespace)


def _shared(old_config: str, namespace: str, endpoint: str,
            problems: list[str]) -> SharedData:
    """The old namespace's row of ``kvp-admin report --tier shared --config OLD``; a store
    that cannot be reached is a problem, and the figures stay 0."""
    try:
        doc = report_shared((old_config,))
    except KvpError as exc:
        problems.append(f"shared tier {endpoint}: {exc}")
        return SharedData(endpoint)
    return SharedData.from_report(doc, namespace)


def _warm(new: Deployment) -> WarmFacts:
    """NEW's warm set: its entries, and its tokens and chunks when the warm-up has cached
    the token ids for NEW's namespace (computing them needs vLLM's tokenizer: not here)."""
    if not new.settings.warmup_file:
        return WarmFacts(note="NEW has no warm set (KVP_WARMUP_FILE is empty)")
    # ConfigError (exit 2) for a file that does not parse
    ws = read_warm_set(new.settings.warmup_file, new.source)
    chunk, ws_n = new.generic.chunk_size, world_size(new)
    ids, why = _cached_token_ids(new, ws.sha256, len(ws.entries))
    if ids is None:
        return WarmFacts(ws.source, len(ws.entries), world_size=ws_n, chunk_size=chunk,
                         note=f"tokens and chunks unknown: {why}; counting them needs NEW's "
                              "tokenizer, which the warm-up of `kvp-admin launch NEW` runs")
    return WarmFacts(ws.source, len(ws.entries), sum(len(x) for x in ids),
                     sum(len(x) // chunk for x in ids), ws_n, chunk,
                     "from the warm-up's token-id cache of NEW's namespace")


def _cached_token_ids(dep: Deployment, warm_sha256: str,
                      entries: int) -> tuple[list[list[int]] | None, str]:
    """The warm set's token ids from the warm-up's cache for ``dep``'s namespace, read as
    the warm-up reads it (never through a link, bounded), or (None, why not)."""
    assert dep.identity is not None
    loc = locate(dep)
    name = tokens_cache_name(dep.namespace, warm_sha256)
    try:
        dfd = open_dir(loc.warmup_tokens_dir)
    except OSError:
        return None, "no token ids cached for NEW's namespace"
    where = show_path(os.path.join(loc.warmup_tokens_dir, name))
    try:
        doc = read_json(name, dir_fd=dfd, follow=False, max_bytes=TOKENS_MAX_BYTES,
                        max_containers=TOKENS_MAX_CONTAINERS, where=where)
    except FileNotFoundError:
        return None, "no token ids cached for NEW's namespace"
    except UnreadableFile as exc:
        return None, f"the token-id cache {where} {exc.why}"
    finally:
        os.close(dfd)
    ids = parse_tokens_document(doc, dep.namespace, warm_sha256,
                                dep.identity.chat_template_sha256)
    if ids is None or len(ids) != entries:
        return None, f"the token-id cache {where} is not the one of this warm set"
    return ids, ""
