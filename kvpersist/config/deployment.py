"""One deployment, validated as a whole (pure).

Given already-read data (env-file values, the environment, the generic config), merge the
file, the environment and the defaults into :class:`DeploymentSettings`
(:mod:`kvpersist.config.settings`), check that the values agree (ports, listeners, the
shared tier, TP and block size against the identity) and build a frozen :class:`Deployment`,
or raise one :class:`ConfigError` listing every problem at once.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import PurePosixPath
from typing import Any

from kvpersist.config.generic import GenericConfig
from kvpersist.config.identity import (
    ALL_IDENTITY_KEYS,
    IDENTITY_KEYS,
    CacheIdentity,
    identity_from_env,
    identity_problems,
    parse_engine_args,
    unpinned_namespace,
    vllm_version,
)
from kvpersist.config.key_paths import namespace_dir_problem, namespace_key_path
from kvpersist.config.settings import (
    DEPLOY_FIX,
    DEPLOYMENT_KEYS,
    LEGACY_STATE_DIR,
    DeploymentSettings,
    convert_setting,
)
from kvpersist.config.shared_tier import SharedTier, parse_shared_tier
from kvpersist.config.values import is_loopback, parse_uint
from kvpersist.errors import ConfigError, Problem
from kvpersist.system.vllm_seam import version_of_build

# --------------------------------------------------------------------------- settings


def settings_from_env(
    values: Mapping[str, str],
    environ: Mapping[str, str],
    generic: GenericConfig,
    source: str,
    defaults: Mapping[str, str] | None = None,
) -> tuple[DeploymentSettings | None, list[Problem]]:
    """Deployment settings from the file's ``values``, overridden by ``environ`` (deployment
    keys only); ``defaults`` replace built-in defaults (the loader's legacy state dir).
    Returns (settings or None, problems)."""
    problems: list[Problem] = []
    merged: dict[str, str] = {}
    origin: dict[str, str] = {}
    for key, (_, _, builtin) in DEPLOYMENT_KEYS.items():
        default = (defaults or {}).get(key, builtin)
        if key in environ:
            merged[key], origin[key] = environ[key], f"environment {key}"
        elif key in values:
            merged[key], origin[key] = values[key], f"{source}: {key}"
        elif default is not None:
            merged[key], origin[key] = default, f"{source}: {key} (default)"
    converted: dict[str, Any] = {}
    # the vLLM release reads KVP_VLLM_EXTRA_ARGS (its own flag table)
    version = vllm_version({**values, **{k: merged[k] for k in ("KVP_IMAGE",) if k in merged}})
    for key, (name, kind, _default) in DEPLOYMENT_KEYS.items():
        if key not in merged:
            problems.append(Problem(f"{source}: {key}", "missing", DEPLOY_FIX.get(key, "")))
            continue
        raw = merged[key]
        if raw.startswith("generic."):
            converted[name] = getattr(generic, raw[len("generic."):])
            continue
        if origin[key].endswith("(default)") and "{" in raw:
            root = PurePosixPath(converted.get("cache_root", "/"))
            raw = raw.format(cache_root=root, cache_root_parent=root.parent,
                             cache_root_name=root.name, state_dir=converted.get("state_dir", ""))
        value, message = convert_setting(kind, raw, version)
        if message:
            problems.append(Problem(origin[key], message, DEPLOY_FIX.get(key, "")))
        else:
            converted[name] = value
    if problems:
        return None, problems
    settings = DeploymentSettings(**converted)
    problems = listener_problems(settings, origin) + shared_tier_problems(settings, origin)
    return (None, problems) if problems else (settings, problems)


def shared_tier_of(s: DeploymentSettings) -> SharedTier | None:
    """The shared tier of settings ``s``, parsed (None when KVP_SHARED_TIER is empty); a
    deployment's is :attr:`Deployment.shared`, parsed once."""
    tier, _ = parse_shared_tier(s.shared_tier)
    return tier


def shared_tier_problems(s: DeploymentSettings, origin: Mapping[str, str]) -> list[Problem]:
    """A shared tier needs its secret file, and a secret file needs a shared tier."""
    if s.shared_tier and not s.shared_tier_secret_file:
        return [Problem(origin.get("KVP_SHARED_TIER", "KVP_SHARED_TIER"),
                        "a shared tier needs credentials (an ACL user and password)",
                        "set KVP_SHARED_TIER_SECRET_FILE to an owner-only file with "
                        "username=... and password=... lines")]
    if s.shared_tier_secret_file and not s.shared_tier:
        return [Problem(origin.get("KVP_SHARED_TIER_SECRET_FILE",
                                   "KVP_SHARED_TIER_SECRET_FILE"),
                        "is set but KVP_SHARED_TIER is empty: nothing to authenticate to",
                        "set KVP_SHARED_TIER or remove KVP_SHARED_TIER_SECRET_FILE")]
    return []


# --------------------------------------------------------------------------- listeners


@dataclass(frozen=True)
class Listener:
    """One port a deployment listens on, with its bind address and its remote opt-in."""

    component: str  # lmcache / lmcache_http / vllm
    what: str
    host_key: str
    allow_key: str
    host: str
    port: int
    #: peers allowed by ``allow_key`` (empty: loopback only)
    peers: tuple[str, ...]

    @property
    def remote(self) -> bool:
        """True when the bind address is not loopback (other hosts can connect)."""
        return not is_loopback(self.host)

    @property
    def address(self) -> str:
        """``host:port`` (``[host]:port`` for IPv6)."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def enforced_by(self) -> str:
        """What keeps peers other than :attr:`peers` out."""
        if self.component == "vllm":
            return "nothing in kvpersist: put a firewall in front of vLLM"
        return "the systemd unit's IPAddressAllow= (not a launch by hand)"

    def describe(self) -> str:
        """One line for launch, health and render: where it listens, and who may connect."""
        if not self.remote:
            return f"{self.what} on {self.address} (loopback)"
        return (f"{self.what} on {self.address} is NOT loopback: reachable from the network; "
                f"peers allowed by {self.allow_key}: {' '.join(self.peers) or 'none'}, "
                f"enforced by {self.enforced_by}")

    def to_dict(self) -> dict[str, Any]:
        return {"component": self.component, "host": self.host, "port": self.port,
                "loopback": not self.remote, "allow_key": self.allow_key,
                "allowed_peers": list(self.peers)}


def listeners(s: DeploymentSettings) -> tuple[Listener, ...]:
    """The three listeners of a deployment: the cache server's request (ZMQ) port, its HTTP
    admin port (no authentication) and vLLM's OpenAI server."""
    return (
        Listener("lmcache", "cache server (ZMQ requests)", "KVP_LMCACHE_HOST",
                 "KVP_ALLOW_REMOTE_LMCACHE", s.lmcache_host, s.lmcache_port,
                 s.allow_remote_lmcache),
        Listener("lmcache_http", "cache server HTTP admin (no authentication)",
                 "KVP_LMCACHE_HTTP_HOST", "KVP_ALLOW_REMOTE_LMCACHE_HTTP",
                 s.lmcache_http_host, s.lmcache_http_port, s.allow_remote_lmcache_http),
        Listener("vllm", "vLLM OpenAI server", "KVP_VLLM_HOST", "KVP_ALLOW_REMOTE_VLLM",
                 s.vllm_host, s.vllm_port, s.allow_remote_vllm),
    )


def listener_problems(s: DeploymentSettings, origin: Mapping[str, str]) -> list[Problem]:
    """A non-loopback bind needs its opt-in, and an opt-in needs a non-loopback bind.
    ``origin`` names where each key's value came from (file, environment, default)."""
    problems: list[Problem] = []
    for lst in listeners(s):
        if lst.remote and not lst.peers:
            problems.append(Problem(
                origin.get(lst.host_key, lst.host_key),
                f"{lst.host} is not a loopback address: the {lst.what} would be reachable "
                "from the network",
                f"bind 127.0.0.1, or opt in by naming the peers allowed to connect in "
                f"{lst.allow_key} (addresses or prefixes, or 'any')"))
        elif lst.peers and not lst.remote:
            problems.append(Problem(
                origin.get(lst.allow_key, lst.allow_key),
                f"is set but {lst.host_key} is {lst.host} (loopback): nothing to allow",
                f"remove {lst.allow_key}, or set {lst.host_key} to the address to bind"))
    return problems


# --------------------------------------------------------------------------- the deployment


@dataclass(frozen=True)
class Deployment:
    """One configured deployment: identity, namespace and settings, validated together."""

    name: str
    source: str
    identity: CacheIdentity | None
    namespace: str
    settings: DeploymentSettings
    generic: GenericConfig
    unpinned_reasons: tuple[Problem, ...] = field(default=())
    #: identity fields that passed validation (all 14 when pinned); used by render
    identity_values: Mapping[str, Any] = field(default_factory=dict)
    #: things an operator should know about this deployment's settings (shown by launch)
    notes: tuple[str, ...] = ()

    @property
    def pinned(self) -> bool:
        return self.identity is not None

    @property
    def lmcache_model_name(self) -> str:
        """The model name LMCache sees (vLLM's --model): the namespace."""
        return self.namespace

    @cached_property
    def shared(self) -> SharedTier | None:
        """The shared tier (KVP_SHARED_TIER), parsed once; None without one."""
        tier, _ = parse_shared_tier(self.settings.shared_tier)
        return tier

    @property
    def vllm_version(self) -> str | None:
        """The vLLM release this deployment names (KVP_VLLM_BUILD, else KVP_IMAGE's tag), or
        None; the release that runs is the installed one for a direct process
        (:func:`kvpersist.system.software.running_vllm_version`)."""
        return version_of_build(str(self.identity_values.get("vllm_build", "")),
                                self.settings.image)

    @property
    def cache_root(self) -> PurePosixPath:
        """The cache root as a path object (no I/O)."""
        return PurePosixPath(self.settings.cache_root)


def build_deployment(
    name: str,
    source: str,
    values: Mapping[str, str],
    environ: Mapping[str, str],
    generic: GenericConfig,
    *,
    allow_unpinned: bool = False,
    unpinned_token: str = "",
    legacy_state_dir: bool = False,
) -> Deployment:
    """Validate env-file ``values`` (+ ``environ`` overrides) into a :class:`Deployment`.

    ``legacy_state_dir`` (the loader found kvpersist 0.1's state inside the cache root and no
    KVP_STATE_DIR is set) keeps the state dir at ``<cache root>/.kvpersist``, with a note.

    Unknown ``KVP_`` keys and any non-``KVP_`` key are errors. Identity problems are errors
    unless unpinned operation is opted into (``allow_unpinned`` or KVP_ALLOW_UNPINNED=true),
    in which case the namespace is ``kvp-unpinned-<unpinned_token>``. Settings that cannot
    agree (ports, TP vs GPU count, block size vs chunk size) are errors. Raises ConfigError.
    """
    problems: list[Problem] = []
    known = set(ALL_IDENTITY_KEYS.values()) | set(DEPLOYMENT_KEYS)
    for key in values:
        if key not in known:
            problems.append(Problem(f"{source}: {key}", "unknown key",
                                    _closest(key, known)))
    settings, setting_problems = settings_from_env(
        values, environ, generic, source,
        {"KVP_STATE_DIR": LEGACY_STATE_DIR} if legacy_state_dir else None)
    problems += setting_problems
    id_problems = identity_problems(values, source)
    identity: CacheIdentity | None = None
    namespace = ""
    opted_in = allow_unpinned or bool(settings and settings.allow_unpinned)
    if not id_problems:
        identity = identity_from_env(values, source)
        namespace = identity.namespace()
    elif opted_in:
        namespace = unpinned_namespace(unpinned_token) if unpinned_token else ""
        if not namespace:
            problems.append(Problem(source, "unpinned operation needs a random token"))
        # an incomplete identity may run unpinned, but not with engine flags it cannot read
        problems += [p for p in id_problems if p.where == f"{source}: KVP_ENGINE_ARGS"]
    else:
        problems += id_problems
        problems.append(Problem(source, "identity incomplete: refusing a persistent "
                                "configuration (a wrong hit would serve wrong output)",
                                "fix the fields above, or pass --allow-unpinned for a "
                                "one-off namespace that never reuses anything"))
    if settings is not None:
        settings = with_namespace_key(settings, namespace)
    if settings is not None and not problems:
        problems += agreement_problems(identity, settings, generic, source)
    if problems or settings is None:
        raise ConfigError(problems, source)
    return Deployment(name=name, source=source, identity=identity, namespace=namespace,
                      settings=settings, generic=generic,
                      unpinned_reasons=tuple(id_problems) if identity is None else (),
                      identity_values=_valid_identity_values(values, id_problems, source),
                      notes=(LEGACY_STATE_NOTE.format(root=settings.cache_root),)
                      if legacy_state_dir else ())


def with_namespace_key(s: DeploymentSettings, namespace: str) -> DeploymentSettings:
    """``s`` with ``serde_key_file`` set to ``namespace``'s own key
    (``<state dir>/keys/<namespace>/l2-master.key``) when KVP_SERDE_KEY_FILE is empty (the
    default); an operator's KVP_SERDE_KEY_FILE is kept as given (pure)."""
    if s.serde_key_file or namespace_dir_problem(namespace):
        return s
    return replace(s, serde_key_file=namespace_key_path(s.state_dir, namespace))


LEGACY_STATE_NOTE = (
    "the state dir is {root}/.kvpersist, inside the cache root, where kvpersist 0.1 kept it: "
    "LMCache's clean-up deletes every file whose name contains '.tmp.' under the cache root "
    "when it stops. kvpersist's own files never carry that in their names, but to keep the "
    "state out of its reach, stop the deployment, move the directory out (e.g. `mv "
    "{root}/.kvpersist/* <new dir>` except prune.lock and quarantine/) and set KVP_STATE_DIR")


def _valid_identity_values(values: Mapping[str, str], id_problems: list[Problem],
                           source: str) -> dict[str, Any]:
    bad = {p.where for p in id_problems}
    out: dict[str, Any] = {}
    for name, key in IDENTITY_KEYS.items():
        if f"{source}: {key}" in bad or key not in values:
            continue
        raw = values[key].strip()
        number = parse_uint(raw, 18) if name in _INT_IDENTITY else None
        out[name] = number if number is not None else raw
    engine = values.get(ALL_IDENTITY_KEYS["engine_args"], "")
    if engine.strip() and f"{source}: KVP_ENGINE_ARGS" not in bad:
        out["engine_args"] = dict(parse_engine_args(engine, vllm_version(values)))
    return out


_INT_IDENTITY = ("block_size", "num_kv_heads", "head_dim", "tensor_parallel_size",
                 "max_model_len")


def agreement_problems(identity: CacheIdentity | None, s: DeploymentSettings,
                       g: GenericConfig, source: str) -> list[Problem]:
    """Settings that are valid alone but cannot work together."""
    problems: list[Problem] = []
    ports = [("KVP_LMCACHE_PORT", s.lmcache_host, s.lmcache_port),
             ("KVP_LMCACHE_HTTP_PORT", s.lmcache_http_host, s.lmcache_http_port),
             ("KVP_VLLM_PORT", s.vllm_host, s.vllm_port)]
    for i, (ka, _, pa) in enumerate(ports):
        for kb, _, pb in ports[i + 1:]:
            if pa == pb:
                problems.append(Problem(f"{source}: {kb}", f"port {pb} is also {ka}",
                                        "give every listener its own port"))
    if s.image:
        problems += settings_mount_problems(s, source)
    if identity is not None:
        tp = identity.tensor_parallel_size
        if s.device != "cpu" and s.gpu_count and tp > s.gpu_count:
            problems.append(Problem(f"{source}: KVP_TENSOR_PARALLEL_SIZE",
                                    f"TP {tp} needs {tp} GPUs, KVP_GPU_COUNT is {s.gpu_count}",
                                    "lower TP (a new namespace) or raise KVP_GPU_COUNT"))
        if g.chunk_size % identity.block_size:
            problems.append(Problem(f"{source}: KVP_BLOCK_SIZE",
                                    f"block size {identity.block_size} does not divide the "
                                    f"cache chunk size {g.chunk_size}",
                                    "use a block size that divides server.chunk_size"))
        if identity.connector != "LMCacheMPConnector":
            problems.append(Problem(f"{source}: KVP_CONNECTOR",
                                    f"{identity.connector!r} is not supported",
                                    "use LMCacheMPConnector"))
        if identity.kv_cache_dtype in ("bfloat16", "float16", "float32") and \
                s.model_dtype not in ("auto", identity.kv_cache_dtype):
            problems.append(Problem(f"{source}: KVP_MODEL_DTYPE",
                                    f"{s.model_dtype} differs from KVP_KV_CACHE_DTYPE "
                                    f"{identity.kv_cache_dtype}",
                                    "the KV cache is stored in the model dtype; make them agree"))
    return problems


def _overlap(a: str, b: str) -> bool:
    """``a`` and ``b`` are the same path or one lies below the other (pure)."""
    pa, pb = PurePosixPath(a), PurePosixPath(b)
    return pa == pb or pa in pb.parents or pb in pa.parents


def private_paths(s: DeploymentSettings) -> list[tuple[str, str]]:
    """(key, path) of what vLLM's container must never see: the cache root, the state, log
    and model-link directories, the L2 key and the shared tier's secret."""
    return [(k, p) for k, p in (
        ("KVP_CACHE_ROOT", s.cache_root), ("KVP_STATE_DIR", s.state_dir),
        ("KVP_LOG_DIR", s.log_dir), ("KVP_MODEL_LINK_DIR", s.model_link_dir),
        ("KVP_SERDE_KEY_FILE", s.serde_key_file),
        ("KVP_SHARED_TIER_SECRET_FILE", s.shared_tier_secret_file)) if p]


def container_mount_problems(private: list[tuple[str, str]], mounts: list[tuple[str, str]],
                             source: str) -> list[Problem]:
    """Each (key, host path) of ``mounts`` that is, holds or lies in a ``private`` path
    (pure: the paths as given; the caller resolves symlinks where it can)."""
    return [Problem(f"{source}: {key}", f"{path} would show the container {pkey} {ppath}: "
                    "vLLM's container never sees the cache, kvpersist's state, a key or a "
                    "secret", "mount only what vLLM needs (the weights, its venv), apart "
                    "from those")
            for key, path in mounts for pkey, ppath in private if _overlap(path, ppath)]


def settings_mount_problems(s: DeploymentSettings, source: str) -> list[Problem]:
    """:func:`container_mount_problems` of a KVP_IMAGE deployment's own mounts:
    ``KVP_CONTAINER_MOUNTS`` and the weights at ``KVP_MODEL_PATH``."""
    mounts = [("KVP_CONTAINER_MOUNTS", m) for m in s.container_mounts]
    if s.model_path.startswith("/"):
        mounts.append(("KVP_MODEL_PATH", s.model_path))
    return container_mount_problems(private_paths(s), mounts, source)


def _closest(key: str, known: set[str]) -> str:
    match = difflib.get_close_matches(key, sorted(known), n=1)
    return f"did you mean {match[0]}?" if match else "remove it (see README: configuration)"
