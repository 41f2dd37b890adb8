"""Deployment settings and the generic cache-server config: schema and validation (pure).

Given already-read data (env-file values, the environment, the generic YAML as a dict),
build frozen objects or raise one :class:`ConfigError` listing every problem at once.
"""

from __future__ import annotations

import ipaddress
import math
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from kvpersist.config.engine_args import extra_args_problems
from kvpersist.config.envfile import value_problem
from kvpersist.config.identity import (
    ALL_IDENTITY_KEYS,
    IDENTITY_KEYS,
    CacheIdentity,
    identity_from_env,
    identity_problems,
    parse_engine_args,
    unpinned_namespace,
)
from kvpersist.config.shared_tier import SharedTier, parse_shared_tier
from kvpersist.config.values import (
    SYSTEM_TREES,
    is_loopback,
    is_scoped,
    parse_decimal,
    parse_duration,
    parse_size_or_percent,
    parse_uint,
    path_problem,
    system_dir,
)
from kvpersist.errors import ConfigError, Problem

# --------------------------------------------------------------------------- generic config


@dataclass(frozen=True)
class GenericConfig:
    """configs/generic/lmcache.yaml, validated."""

    host: str = "127.0.0.1"
    port: int = 5555
    http_host: str = "127.0.0.1"
    http_port: int = 8080
    supported_transfer_mode: str = "auto"
    chunk_size: int = 256
    max_workers: int = 1
    l1_size_gb: float = 64.0
    l1_eviction_policy: str = "LRU"
    l1_trigger_watermark: float = 0.9
    l1_eviction_ratio: float = 0.1
    l2_type: str = "nixl_store_dynamic"
    l2_backend: str = "POSIX"
    l2_use_direct_io: bool = True
    l2_shard_dirs: bool = False
    l2_persist_enabled: bool = True
    l2_eviction_policy: str = "LRU"
    l2_trigger_watermark: float = 0.9
    l2_eviction_ratio: float = 0.1
    l2_serde: str = "aesgcm"
    l2_budget: str = "80%"
    l2_reserve: str = "5%"


# (section, key) -> (field, type, check)
_Check = Callable[[Any], str]


def _positive(v: Any) -> str:
    return "" if v > 0 else "must be > 0"


def _fraction(v: Any) -> str:
    return "" if 0 < v <= 1 else "must be in (0, 1]"


def _port(v: Any) -> str:
    return "" if 1 <= v <= 65535 else "must be a TCP port (1-65535)"


def _choice(*allowed: str) -> _Check:
    return lambda v: "" if v in allowed else f"must be one of {', '.join(allowed)}"


def _size_spec(v: Any) -> str:
    try:
        parse_size_or_percent(str(v))
    except ValueError as exc:
        return str(exc)
    return ""


def _true(v: Any) -> str:
    return "" if v is True else "must stay true: false deletes every L2 file at shutdown"


def _any(v: Any) -> str:
    return ""


def _host(v: Any) -> str:
    return host_problem(str(v))


def host_problem(value: str) -> str:
    """Why ``value`` is not a listen address kvpersist accepts, or ''."""
    if value == "localhost":
        return ""
    if is_scoped(value):
        return f"must be an IP address without a zone, got {value!r}"
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        return f"must be an IP address (e.g. 127.0.0.1), got {value!r}"
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return f"write the IPv4 address {address.ipv4_mapped}, not {value!r}"
    if str(address) != value:
        # one spelling per address: the loopback rule, systemd's IPAddressAllow= and the
        # Ansible role compare addresses as text
        return f"write the address in its canonical form {address}, not {value!r}"
    return ""


_GENERIC_SCHEMA: dict[tuple[str, str], tuple[str, type, _Check]] = {
    ("server", "host"): ("host", str, _host),
    ("server", "port"): ("port", int, _port),
    ("server", "http_host"): ("http_host", str, _host),
    ("server", "http_port"): ("http_port", int, _port),
    ("server", "supported_transfer_mode"): (
        "supported_transfer_mode", str, _choice("auto", "lmcache_driven", "engine_driven")),
    ("server", "chunk_size"): ("chunk_size", int, _positive),
    ("server", "max_workers"): ("max_workers", int, _positive),
    ("l1", "size_gb"): ("l1_size_gb", float, _positive),
    ("l1", "eviction_policy"): ("l1_eviction_policy", str, _choice("LRU", "ARC", "IsolatedLRU")),
    ("l1", "trigger_watermark"): ("l1_trigger_watermark", float, _fraction),
    ("l1", "eviction_ratio"): ("l1_eviction_ratio", float, _fraction),
    ("l2", "type"): ("l2_type", str, _choice("nixl_store_dynamic")),
    ("l2", "backend"): ("l2_backend", str, _choice("POSIX")),
    ("l2", "use_direct_io"): ("l2_use_direct_io", bool, _any),
    ("l2", "shard_dirs"): ("l2_shard_dirs", bool, _any),
    ("l2", "persist_enabled"): ("l2_persist_enabled", bool, _true),
    ("l2", "eviction_policy"): ("l2_eviction_policy", str, _choice("LRU")),
    ("l2", "trigger_watermark"): ("l2_trigger_watermark", float, _fraction),
    ("l2", "eviction_ratio"): ("l2_eviction_ratio", float, _fraction),
    ("l2", "serde"): ("l2_serde", str, _choice("aesgcm", "none")),
    ("l2", "budget"): ("l2_budget", str, _size_spec),
    ("l2", "reserve"): ("l2_reserve", str, _size_spec),
}


def generic_from_dict(data: Any, source: str = "configs/generic/lmcache.yaml") -> GenericConfig:
    """Validate the parsed YAML ``data``; raise ConfigError with every problem."""
    problems: list[Problem] = []
    values: dict[str, Any] = {}
    if not isinstance(data, dict):
        raise ConfigError(Problem(source, "must be a mapping with server/l1/l2 sections"), source)
    known_sections = {s for s, _ in _GENERIC_SCHEMA}
    for section, body in data.items():
        if section not in known_sections:
            problems.append(Problem(f"{section}", "unknown section",
                                    f"use one of {', '.join(sorted(known_sections))}"))
            continue
        if not isinstance(body, dict):
            problems.append(Problem(section, "must be a mapping"))
            continue
        for key, raw in body.items():
            spec = _GENERIC_SCHEMA.get((section, key))
            where = f"{section}.{key}"
            if spec is None:
                allowed = sorted(k for s, k in _GENERIC_SCHEMA if s == section)
                problems.append(Problem(where, "unknown key", f"known: {', '.join(allowed)}"))
                continue
            name, typ, check = spec
            value, message = _coerce(raw, typ)
            if not message:
                message = check(value)
            if message:
                problems.append(Problem(where, f"{message} (got {raw!r})"))
            else:
                values[name] = value
    if problems:
        raise ConfigError(problems, source)
    return GenericConfig(**values)


def _coerce(raw: Any, typ: type) -> tuple[Any, str]:
    if typ is bool:
        if isinstance(raw, bool):
            return raw, ""
        if isinstance(raw, str) and raw.lower() in ("true", "false", "yes", "no", "1", "0"):
            return raw.lower() in ("true", "yes", "1"), ""
        return None, "must be true or false"
    if typ is int:
        if isinstance(raw, bool):
            return None, "must be an integer"
        try:
            if isinstance(raw, float) and not raw.is_integer():
                return None, "must be an integer"
            return int(str(raw).strip()), ""
        except ValueError:
            return None, "must be an integer"
    if typ is float:
        if isinstance(raw, bool):
            return None, "must be a number"
        try:
            number = float(str(raw).strip())
        except ValueError:
            return None, "must be a number"
        return (number, "") if math.isfinite(number) else (None, "must be a finite number")
    if isinstance(raw, (dict, list)):
        return None, "must be a plain value"
    return str(raw), ""


# --------------------------------------------------------------------------- deployment keys


@dataclass(frozen=True)
class DeploymentSettings:
    """Settings that do not change the bytes of a KV block (never in the namespace)."""

    cache_root: str
    served_model_name: str
    model_path: str
    state_dir: str
    l1_size_gb: float
    lmcache_host: str
    lmcache_port: int
    lmcache_http_host: str
    lmcache_http_port: int
    container_name: str = ""
    image: str = ""
    vllm_host: str = "127.0.0.1"
    vllm_port: int = 8000
    gpu_count: int = 0
    device: str = "cuda"
    model_dtype: str = "auto"
    vllm_extra_args: tuple[str, ...] = ()
    l2_budget: str = "80%"
    l2_reserve: str = "5%"
    l2_quota: str = ""
    serde: str = "aesgcm"
    serde_key_file: str = ""
    #: share of MemAvailable the launch pre-read may fill with the namespace's newest chunk
    #: files (kvpersist/stack/preread.py); 0: no pre-read
    preread_ram_share: float = 0.0
    allow_unpinned: bool = False
    generic_config: str = "generic"
    model_link_dir: str = ""
    log_dir: str = ""
    #: peers allowed to reach a non-loopback bind (addresses, prefixes or "any"); empty:
    #: the listener must bind loopback
    allow_remote_lmcache: tuple[str, ...] = ()
    allow_remote_lmcache_http: tuple[str, ...] = ()
    allow_remote_vllm: tuple[str, ...] = ()
    #: the user the cache server runs as (systemd User=); empty: whoever runs kvp-admin
    service_user: str = ""
    #: the shared KV tier's URL (kvpersist.config.shared_tier); empty: none
    shared_tier: str = ""
    #: owner-only file with the shared tier's ACL user and password
    shared_tier_secret_file: str = ""
    #: the warm set (JSONL: the prompts every session starts with, docs/warm-restart.md);
    #: empty: none. Not in the namespace: it selects what to warm, not what is computed
    warmup_file: str = ""
    #: seconds the launch's warm-up may take (its ``--wait``) before the deployment is
    #: reported ready anyway (cold, degraded in health); kvpersist.stack.readiness
    warmup_wait: float = 120.0


#: env key -> (field, kind, default-or-None-if-required). Defaults starting with "generic."
#: come from the generic config; "{cache_root}", "{cache_root_parent}", "{cache_root_name}"
#: and "{state_dir}" are substituted. The state dir defaults to a directory *beside* the cache
#: root: LMCache's clean-up at a graceful stop deletes every file whose name contains
#: ``.tmp.`` anywhere under the cache root, so kvpersist keeps its own state out of there.
LEGACY_STATE_DIR = "{cache_root}/.kvpersist"
DEPLOYMENT_KEYS: dict[str, tuple[str, str, str | None]] = {
    "KVP_CACHE_ROOT": ("cache_root", "dir", None),
    "KVP_SERVED_MODEL_NAME": ("served_model_name", "name", None),
    "KVP_MODEL_PATH": ("model_path", "path", None),
    "KVP_STATE_DIR": ("state_dir", "dir", "{cache_root_parent}/.kvpersist/{cache_root_name}"),
    "KVP_L1_SIZE_GB": ("l1_size_gb", "float", "generic.l1_size_gb"),
    "KVP_LMCACHE_HOST": ("lmcache_host", "host", "generic.host"),
    "KVP_LMCACHE_PORT": ("lmcache_port", "port", "generic.port"),
    "KVP_LMCACHE_HTTP_HOST": ("lmcache_http_host", "host", "generic.http_host"),
    "KVP_LMCACHE_HTTP_PORT": ("lmcache_http_port", "port", "generic.http_port"),
    "KVP_CONTAINER_NAME": ("container_name", "container?", ""),
    "KVP_IMAGE": ("image", "image?", ""),
    "KVP_VLLM_HOST": ("vllm_host", "host", "127.0.0.1"),
    "KVP_VLLM_PORT": ("vllm_port", "port", "8000"),
    "KVP_GPU_COUNT": ("gpu_count", "count", "0"),
    "KVP_DEVICE": ("device", "device", "cuda"),
    "KVP_MODEL_DTYPE": ("model_dtype", "dtype", "auto"),
    "KVP_VLLM_EXTRA_ARGS": ("vllm_extra_args", "argv", ""),
    "KVP_L2_BUDGET": ("l2_budget", "sizepct", "generic.l2_budget"),
    "KVP_L2_RESERVE": ("l2_reserve", "sizepct", "generic.l2_reserve"),
    "KVP_L2_QUOTA": ("l2_quota", "sizepct?", ""),
    "KVP_L2_SERDE": ("serde", "serde", "generic.l2_serde"),
    "KVP_SERDE_KEY_FILE": ("serde_key_file", "abspath", "{state_dir}/keys/l2-master.key"),
    "KVP_PREREAD_RAM_SHARE": ("preread_ram_share", "share", "0"),
    "KVP_ALLOW_UNPINNED": ("allow_unpinned", "bool", "false"),
    "KVP_GENERIC_CONFIG": ("generic_config", "confname", "generic"),
    "KVP_MODEL_LINK_DIR": ("model_link_dir", "dir", "{state_dir}/models"),
    "KVP_LOG_DIR": ("log_dir", "dir", "{state_dir}/logs"),
    "KVP_ALLOW_REMOTE_LMCACHE": ("allow_remote_lmcache", "peers", ""),
    "KVP_ALLOW_REMOTE_LMCACHE_HTTP": ("allow_remote_lmcache_http", "peers", ""),
    "KVP_ALLOW_REMOTE_VLLM": ("allow_remote_vllm", "peers", ""),
    "KVP_SERVICE_USER": ("service_user", "user?", ""),
    "KVP_SHARED_TIER": ("shared_tier", "sharedtier?", ""),
    "KVP_SHARED_TIER_SECRET_FILE": ("shared_tier_secret_file", "abspath?", ""),
    "KVP_WARMUP_FILE": ("warmup_file", "abspath?", ""),
    "KVP_WARMUP_WAIT": ("warmup_wait", "duration", "120"),
}

def parse_peers(value: str) -> tuple[tuple[str, ...], str]:
    """The peers of a ``KVP_ALLOW_REMOTE_*`` value (addresses or prefixes separated by spaces
    or commas, or ``any`` alone), as written and without repeats; and an error message."""
    tokens = [t for t in re.split(r"[ ,]+", value) if t]
    peers: list[str] = []
    for token in tokens:
        if token == "any":
            if len(tokens) > 1:
                return (), "'any' stands alone (it allows every peer)"
        else:
            try:
                if is_scoped(token):
                    raise ValueError(token)
                ipaddress.ip_network(token, strict=False)
            except ValueError:
                return (), (f"{token!r} is not an IP address or prefix (e.g. 10.1.0.0/16), "
                            "nor 'any'")
        if token not in peers:
            peers.append(token)
    return tuple(peers), ""


_CONTAINER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}\Z")
_IMAGE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/:@-]{0,511}\Z")
_CONFNAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")


def config_name_problem(name: str) -> str:
    """Why ``name`` cannot name a directory under configs/ (KVP_GENERIC_CONFIG), or ''."""
    return "" if _CONFNAME.match(name) else (
        f"must be the name of a directory under configs/, got {name!r}")


_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}\Z")


def _convert(kind: str, raw: str) -> tuple[Any, str]:
    """Convert one raw deployment value; return (value, error message or '')."""
    problem = value_problem(raw)
    if problem:
        return None, problem
    value = raw.strip()
    optional = kind.endswith("?")
    kind = kind.rstrip("?")
    if optional and value == "":
        return "", ""
    if kind in ("abspath", "dir", "path", "name", "host", "confname") and value == "":
        return None, "must not be empty"
    if kind in ("abspath", "dir", "path"):
        if value.startswith("-"):
            return None, f"must not start with '-', got {value!r}"
        problem = path_problem(value)
        if problem:
            return None, f"{problem}: {value[:64]!r}"
    if kind in ("abspath", "dir"):
        if not PurePosixPath(value).is_absolute():
            return None, f"must be an absolute path, got {value!r}"
        system = system_dir(value) if kind == "dir" else ""
        if system:
            return None, (f"{value!r} is the system directory {system}"
                          f"{' (or lies below it)' if system in SYSTEM_TREES else ''}: never "
                          "a cache, state, log or model-link directory")
        return value, ""
    if kind == "host":
        message = host_problem(value)
        return (None, message) if message else (value, "")
    if kind in ("port", "count"):
        n = parse_uint(value, 5 if kind == "port" else 4)
        if n is None:
            return None, f"must be an integer, got {value!r}"
        if kind == "port" and not 1 <= n <= 65535:
            return None, f"must be a TCP port (1-65535), got {n}"
        return n, ""
    if kind == "float":
        f = parse_decimal(value)
        if f is None:
            return None, f"must be a number, got {value!r}"
        return (f, "") if f > 0 else (None, "must be > 0")
    if kind == "duration":
        try:
            seconds = parse_duration(value)
        except ValueError as exc:
            return None, str(exc)
        return (seconds, "") if seconds > 0 else (None, "must be > 0")
    if kind == "share":
        f = parse_decimal(value)
        if f is None or not 0 <= f <= 1:
            return None, f"must be a share between 0 and 1 (e.g. 0.25; 0 disables), got {value!r}"
        return f, ""
    if kind == "peers":
        peers, message = parse_peers(value)
        return (None, message) if message else (peers, "")
    if kind == "user":
        return (value, "") if _USER.match(value) else (
            None, f"must be a user name ([a-z_][a-z0-9_-]*, at most 32), got {value!r}")
    if kind == "container":
        return (value, "") if _CONTAINER.match(value) else (
            None, f"must be a container name ([A-Za-z0-9][A-Za-z0-9_.-]*), got {value!r}")
    if kind == "image":
        return (value, "") if _IMAGE.match(value) else (
            None, f"must be an image reference (registry/name:tag or @sha256:...), "
            f"got {value!r}")
    if kind == "confname":
        message = config_name_problem(value)
        return (None, message) if message else (value, "")
    if kind == "bool":
        if value.lower() in ("1", "true", "yes", "on"):
            return True, ""
        if value.lower() in ("0", "false", "no", "off", ""):
            return False, ""
        return None, f"must be true or false, got {value!r}"
    if kind == "device":
        return (value, "") if value in ("cuda", "cpu", "rocm") else (
            None, f"must be cuda, rocm or cpu, got {value!r}")
    if kind == "dtype":
        ok = ("auto", "bfloat16", "float16", "float32")
        return (value, "") if value in ok else (None, f"must be one of {', '.join(ok)}")
    if kind == "sharedtier":
        _, message = parse_shared_tier(value)
        return (None, message) if message else (value, "")
    if kind == "serde":
        return (value, "") if value in ("aesgcm", "none") else (
            None, f"must be aesgcm or none, got {value!r}")
    if kind == "sizepct":
        try:
            parse_size_or_percent(value)
        except ValueError as exc:
            return None, str(exc)
        return value, ""
    if kind == "argv":
        try:
            argv = tuple(shlex.split(value))
        except ValueError as exc:
            return None, f"cannot be split like a shell word list: {exc}"
        # read as vLLM's parser reads them (underscores, abbreviations, dotted keys...):
        # only KV-neutral flags; kvp-admin launch checks again with vLLM's own parser
        problems = extra_args_problems(argv)
        return (None, "; ".join(problems)) if problems else (argv, "")
    if kind == "name" and any(ch.isspace() for ch in value):
        return None, f"must not contain whitespace, got {value!r}"
    if kind == "name" and value.startswith("-"):
        return None, f"must not start with '-', got {value!r}"
    return value, ""


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
    for key, (name, kind, _default) in DEPLOYMENT_KEYS.items():
        if key not in merged:
            problems.append(Problem(f"{source}: {key}", "missing", _DEPLOY_FIX.get(key, "")))
            continue
        raw = merged[key]
        if raw.startswith("generic."):
            converted[name] = getattr(generic, raw[len("generic."):])
            continue
        if origin[key].endswith("(default)") and "{" in raw:
            root = PurePosixPath(converted.get("cache_root", "/"))
            raw = raw.format(cache_root=root, cache_root_parent=root.parent,
                             cache_root_name=root.name, state_dir=converted.get("state_dir", ""))
        value, message = _convert(kind, raw)
        if message:
            problems.append(Problem(origin[key], message, _DEPLOY_FIX.get(key, "")))
        else:
            converted[name] = value
    if problems:
        return None, problems
    settings = DeploymentSettings(**converted)
    problems = listener_problems(settings, origin) + shared_tier_problems(settings, origin)
    return (None, problems) if problems else (settings, problems)


_DEPLOY_FIX = {
    "KVP_CACHE_ROOT": "set the NVMe directory for L2 files, e.g. /var/lib/kvp/cache",
    "KVP_SERVED_MODEL_NAME": "set the public model name clients send",
    "KVP_MODEL_PATH": "set the real weights directory (or hub id) vLLM loads",
    "KVP_VLLM_EXTRA_ARGS": "keep only KV-neutral vLLM flags here (docs/engine-flags.md); "
    "KV-affecting ones go in KVP_ENGINE_ARGS in identity.env, owned ones come from their KVP_ "
    "keys",
    "KVP_STATE_DIR": "use an absolute path",
    "KVP_ALLOW_REMOTE_LMCACHE": "peers allowed to reach KVP_LMCACHE_HOST, e.g. 10.1.0.0/16",
    "KVP_ALLOW_REMOTE_LMCACHE_HTTP": "peers allowed to reach KVP_LMCACHE_HTTP_HOST, e.g. "
    "10.9.0.5",
    "KVP_ALLOW_REMOTE_VLLM": "peers allowed to reach KVP_VLLM_HOST, e.g. 10.0.0.0/8 or any",
    "KVP_SHARED_TIER": "empty (no shared tier) or valkey://host:port[,host:port...]"
    "?cluster=0&tls=0&db=0&workers=8 (docs/fleet.md)",
    "KVP_SHARED_TIER_SECRET_FILE": "an absolute path to an owner-only file with username=... "
    "and password=... lines",
    "KVP_WARMUP_FILE": "empty (no warm set) or an absolute path to a JSONL file of "
    '{"messages": [...]} or {"prompt": "..."} lines (docs/warm-restart.md)',
    "KVP_WARMUP_WAIT": "seconds (or 90s, 5m) the launch's warm-up may take, e.g. 120",
}


def shared_tier_of(s: DeploymentSettings) -> SharedTier | None:
    """The deployment's shared tier, parsed (None when KVP_SHARED_TIER is empty)."""
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
        out["engine_args"] = dict(parse_engine_args(engine))
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


def _closest(key: str, known: set[str]) -> str:
    import difflib

    match = difflib.get_close_matches(key, sorted(known), n=1)
    return f"did you mean {match[0]}?" if match else "remove it (see README: configuration)"
