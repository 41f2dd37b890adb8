"""What a launch will run: the argv and environments of the cache server, vLLM and the
hot-files pre-read (:class:`LaunchPlan`, frozen), and the deployment they come from.

:func:`plan_launch` is pure apart from the values passed in; :func:`prepare_launch` loads the
config, sizes it once (one scan of the cache root, never a write), renders it and plans it.
Nothing here starts, writes or judges anything: :mod:`kvpersist.stack.preflight` checks the
plan, :mod:`kvpersist.stack.launch` carries it out.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from kvpersist.config.deployment import Deployment, listeners, private_paths
from kvpersist.config.loader import load_deployment
from kvpersist.config.shared_tier import SharedTier
from kvpersist.l2.fleet.host import FleetHost, host_of
from kvpersist.l2.hot_files import off_reason
from kvpersist.l2.inventory import Sizing, size_deployment
from kvpersist.stack.canary.run import recompute_reason
from kvpersist.stack.identity_check import IdentityInputs
from kvpersist.stack.launch_options import DEFAULTS, LaunchOptions
from kvpersist.stack.lmcache_exec import exec_argv
from kvpersist.stack.locate import Location, locate, vllm_mode
from kvpersist.stack.preread import preread_argv
from kvpersist.stack.render import (
    TEMPLATE_NAMES,
    Rendered,
    container_argv,
    container_python_argv,
    render,
)
from kvpersist.stack.vllm_args import ParserInputs
from kvpersist.system.software import running_vllm_version
from kvpersist.system.templates import read_templates
from kvpersist.system.vllm_seam import RELEASES, table_version


@dataclass(frozen=True)
class LaunchChecks:
    """What the checks before a launch read of the deployment, taken from it once (plain
    values: :mod:`kvpersist.stack.preflight` gathers and judges from these and the plan)."""

    pinned: bool = True
    #: notes from the config, shown as they are
    notes: tuple[str, ...] = ()
    use_direct_io: bool = False
    generic_config: str = ""
    allow_tmp_cleanup: bool = False
    allow_unsupported_vllm: bool = False
    #: (component, description) of each port that binds a non-loopback address
    remote_listeners: tuple[tuple[str, str], ...] = ()
    #: (setting, path) as configured: the container's mounts (KVP_CONTAINER_MOUNTS, the
    #: weights when an absolute path) and what it must never see
    container_mounts: tuple[tuple[str, str], ...] = ()
    private_paths: tuple[tuple[str, str], ...] = ()
    #: KVP_SHARED_TIER as written ('' : none), parsed (None: none, or it does not parse), and
    #: its secret file
    shared_tier_url: str = ""
    shared_tier: SharedTier | None = None
    shared_tier_secret_file: str = ""
    #: what vLLM's parser check reads
    parser: ParserInputs = field(default_factory=ParserInputs)
    #: what the identity check reads
    identity: IdentityInputs = field(default_factory=IdentityInputs)
    #: KVP_WARMUP_FILE ('' : no warm set) and the config file that names it
    warmup_file: str = ""
    source: str = ""


def parser_inputs(dep: Deployment) -> ParserInputs:
    """What vLLM's parser check reads of ``dep`` (pure)."""
    s = dep.settings
    return ParserInputs(
        namespace=dep.namespace, extra=tuple(s.vllm_extra_args),
        engine=dict(dep.identity_values.get("engine_args", {})), source=dep.source,
        image=s.image, container_prefix=len(container_argv(dep, [])) if s.image else 0,
        container_run=tuple(container_python_argv(dep)) if s.image else (),
        named_version=dep.vllm_version, allow_unsupported=s.allow_unsupported_vllm)


def identity_inputs(dep: Deployment) -> IdentityInputs:
    """What the identity check reads of ``dep`` (pure)."""
    s = dep.settings
    return IdentityInputs(config=dep.name, namespace=dep.namespace, identity=dep.identity,
                          model_path=s.model_path, vllm_mode=vllm_mode(dep), image=s.image,
                          container_engine=s.container_engine,
                          allow_known_corruption=s.allow_known_corruption, canary=s.canary)


def launch_checks(dep: Deployment) -> LaunchChecks:
    """What the checks before a launch of ``dep`` read of it (pure)."""
    s = dep.settings
    mounts = [("KVP_CONTAINER_MOUNTS", m) for m in s.container_mounts]
    if s.model_path.startswith("/"):
        mounts.append(("KVP_MODEL_PATH", s.model_path))
    return LaunchChecks(
        pinned=dep.pinned, notes=tuple(dep.notes), use_direct_io=dep.generic.l2_use_direct_io,
        generic_config=s.generic_config, allow_tmp_cleanup=s.allow_lmcache_tmp_cleanup,
        allow_unsupported_vllm=s.allow_unsupported_vllm,
        remote_listeners=tuple((lst.component, lst.describe()) for lst in listeners(s)
                               if lst.remote),
        container_mounts=tuple(mounts), private_paths=tuple(private_paths(s)),
        shared_tier_url=s.shared_tier, shared_tier=dep.shared,
        shared_tier_secret_file=s.shared_tier_secret_file, parser=parser_inputs(dep),
        identity=identity_inputs(dep), warmup_file=s.warmup_file, source=dep.source)


@dataclass(frozen=True)
class LaunchPlan(Location):
    """A :class:`Location` plus the argv and environments to start the processes with."""

    server_argv: list[str] = field(default_factory=list)
    server_env: dict[str, str] = field(default_factory=dict)
    vllm_argv: list[str] = field(default_factory=list)
    vllm_env: dict[str, str] = field(default_factory=dict)
    #: the hot-files pre-read child (kvpersist/stack/preread.py); empty when it is off
    preread_argv: list[str] = field(default_factory=list)
    #: why there is no pre-read ('' when there is one)
    preread_skip: str = ""
    preread_log: str = ""
    #: the vLLM release that will run (None: not known), found once for every step
    vllm_version: str | None = None
    #: what the checks before the launch read of the deployment
    checks: LaunchChecks = field(default_factory=LaunchChecks)
    #: what this host's fleet record reads of the deployment (l2/fleet/host)
    fleet: FleetHost | None = None


def lmcache_bin() -> str:
    """The ``lmcache`` executable: next to this Python (a venv), else on PATH."""
    sibling = Path(sys.executable).parent / "lmcache"
    if sibling.exists():
        return str(sibling)
    return shutil.which("lmcache") or "lmcache"


def plan_launch(dep: Deployment, rendered: Rendered, environ: Mapping[str, str],
                *, python: str | None = None, server_bin: str | None = None,
                loc: Location | None = None, vllm_version: str | None = None) -> LaunchPlan:
    """Build the launch plan of ``dep`` from its rendering (pure apart from the values
    passed in: ``environ`` is the environment to start children with; ``loc``: ``dep``
    located already, else located here; ``vllm_version``: the release that will run). vLLM
    starts as the rendered release starts its API server (``rendered.vllm["serve"]``: the API
    server module for 0.32, ``vllm serve`` for 0.33 and 0.34;
    :mod:`kvpersist.system.vllm_seam`)."""
    s = dep.settings
    loc = locate(dep) if loc is None else loc
    server_argv = list(rendered.lmcache_server_argv)
    server_argv[0] = server_bin or server_argv[0]
    server_env = dict(environ)
    server_env.setdefault("LMCACHE_DISABLE_BANNER", "1")
    vllm_env = dict(environ)
    container = loc.vllm_mode == "container" and bool(rendered.container_argv)
    for kv in rendered.vllm.get("env", ()):  # what the device needs (KVP_DEVICE=cpu)
        key, _, value = kv.partition("=")
        vllm_env.setdefault(key, value)
    if container:
        vllm_argv = list(rendered.container_argv)
    else:
        serve = rendered.vllm.get("serve") or RELEASES[table_version(None)].serve
        vllm_argv = [python or sys.executable, *serve, *rendered.vllm_argv]
    if s.shared_tier:
        # the shared tier's credentials enter in the server's own process (lmcache_exec)
        tier = dep.shared
        server_argv = exec_argv(python or sys.executable, s.shared_tier_secret_file,
                                server_argv, tls_ca=tier.tls_ca if tier else "",
                                off_record=loc.shared_off_file)
        # the launcher must be this very kvpersist (the server's cwd is the state dir)
        here = str(Path(__file__).resolve().parents[2])
        server_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (here, server_env.get("PYTHONPATH", "")) if p)
    skip = off_reason(s.preread_ram_share, dep.generic.l2_use_direct_io)
    pre_argv = [] if skip else preread_argv(python or sys.executable, loc.cache_root,
                                            loc.namespace, s.preread_ram_share)
    return LaunchPlan(**{f.name: getattr(loc, f.name) for f in fields(Location)},
                      server_argv=server_argv, server_env=server_env,
                      vllm_argv=vllm_argv, vllm_env=vllm_env, preread_argv=pre_argv,
                      preread_skip=skip,
                      preread_log=os.path.join(os.path.dirname(loc.server_log), "preread.log"),
                      vllm_version=vllm_version, checks=launch_checks(dep),
                      fleet=host_of(dep))


@dataclass(frozen=True)
class Prepared:
    """A deployment ready to launch: loaded, sized once, rendered and planned."""

    dep: Deployment
    sizing: Sizing
    rendered: Rendered
    plan: LaunchPlan
    #: the config argument as given and the environment it was loaded with (the warm-up
    #: child loads the same deployment from them)
    config: str = ""
    environ: Mapping[str, str] = field(default_factory=dict)


def prepare_launch(config: str, opts: LaunchOptions = DEFAULTS, *,
                   environ: Mapping[str, str] | None = None) -> Prepared:
    """Load ``config``, size it once (scan + other deployments on its root), render it and
    build its launch plan. Of ``opts``: ``allow_unpinned``, ``allow_tmp_cleanup``
    (``launch --allow-lmcache-tmp-cleanup``: KVP_ALLOW_LMCACHE_TMP_CLEANUP for this launch)
    and ``allow_unsupported_vllm`` (KVP_ALLOW_UNSUPPORTED_VLLM). Writes nothing. Raises ConfigError
    for configuration or budget problems."""
    env = dict(os.environ if environ is None else environ)
    dep = load_deployment(config, env, allow_unpinned=opts.allow_unpinned)
    if opts.allow_tmp_cleanup:
        dep = replace(dep, settings=replace(dep.settings, allow_lmcache_tmp_cleanup=True))
    if opts.allow_unsupported_vllm:
        dep = replace(dep, settings=replace(dep.settings, allow_unsupported_vllm=True))
    sizing = size_deployment(dep, environ=env)
    loc = locate(dep)
    version = running_vllm_version(dep.vllm_version, direct_process=loc.vllm_mode == "process")
    rendered = _render(dep, sizing, version, recompute_reason(loc))
    plan = plan_launch(dep, rendered, env, loc=loc, vllm_version=version)
    return Prepared(dep, sizing, rendered, plan, config, env)


def _render(dep: Deployment, sizing: Sizing, version: str | None, recompute: str) -> Rendered:
    """``dep`` rendered at the launch's sizes for the vLLM release ``version``."""
    return render(dep, read_templates(TEMPLATE_NAMES), l1_size_gb=sizing.l1_size_gb,
                  l2_capacity_gb=sizing.l2_capacity_gb, lmcache_bin=lmcache_bin(),
                  vllm_version=version, recompute=recompute)


def recompute_plan(prepared: Prepared, why: str) -> Prepared:
    """``prepared`` rendered and planned again with vLLM WITHOUT the cache connector (its
    canary failed: ``why``), for the same vLLM release and at the same place. Raises
    ConfigError as :func:`render` does."""
    version = prepared.plan.vllm_version
    rendered = _render(prepared.dep, prepared.sizing, version, why)
    plan = plan_launch(prepared.dep, rendered, prepared.environ, loc=prepared.plan,
                       vllm_version=version)
    return replace(prepared, rendered=rendered, plan=plan)


__all__ = ["LaunchChecks", "LaunchPlan", "Prepared", "identity_inputs", "launch_checks",
           "lmcache_bin", "parser_inputs", "plan_launch", "prepare_launch", "recompute_plan"]
