"""Deployment settings and the generic cache-server config: schema and validation (pure).

Given already-read data (env-file values, the environment, the generic YAML as a dict),
build frozen objects or raise one :class:`ConfigError` listing every problem at once.
"""

from __future__ import annotations

import ipaddress
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

from kvpersist.config.identity import (
    IDENTITY_KEYS,
    CacheIdentity,
    identity_from_env,
    identity_problems,
    unpinned_namespace,
)
from kvpersist.config.values import is_loopback, is_wildcard, parse_size_or_percent
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
    l2_use_direct_io: bool = False
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


_GENERIC_SCHEMA: dict[tuple[str, str], tuple[str, type, _Check]] = {
    ("server", "host"): ("host", str, _any),
    ("server", "port"): ("port", int, _port),
    ("server", "http_host"): ("http_host", str, _any),
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
            return float(str(raw).strip()), ""
        except ValueError:
            return None, "must be a number"
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
    allow_unpinned: bool = False
    generic_config: str = "generic"
    model_link_dir: str = ""
    log_dir: str = ""


#: env key -> (field, kind, default-or-None-if-required). Defaults starting with "generic."
#: come from the generic config; "{state_dir}" is substituted.
DEPLOYMENT_KEYS: dict[str, tuple[str, str, str | None]] = {
    "KVP_CACHE_ROOT": ("cache_root", "abspath", None),
    "KVP_SERVED_MODEL_NAME": ("served_model_name", "name", None),
    "KVP_MODEL_PATH": ("model_path", "path", None),
    "KVP_STATE_DIR": ("state_dir", "abspath", "{cache_root}/.kvpersist"),
    "KVP_L1_SIZE_GB": ("l1_size_gb", "float", "generic.l1_size_gb"),
    "KVP_LMCACHE_HOST": ("lmcache_host", "host", "generic.host"),
    "KVP_LMCACHE_PORT": ("lmcache_port", "port", "generic.port"),
    "KVP_LMCACHE_HTTP_HOST": ("lmcache_http_host", "host", "generic.http_host"),
    "KVP_LMCACHE_HTTP_PORT": ("lmcache_http_port", "port", "generic.http_port"),
    "KVP_CONTAINER_NAME": ("container_name", "name?", ""),
    "KVP_IMAGE": ("image", "str", ""),
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
    "KVP_ALLOW_UNPINNED": ("allow_unpinned", "bool", "false"),
    "KVP_GENERIC_CONFIG": ("generic_config", "str", "generic"),
    "KVP_MODEL_LINK_DIR": ("model_link_dir", "abspath", "{state_dir}/models"),
    "KVP_LOG_DIR": ("log_dir", "abspath", "{state_dir}/logs"),
}

#: vLLM flags the launcher owns; KVP_VLLM_EXTRA_ARGS may not set them.
OWNED_VLLM_FLAGS = (
    "--model", "--served-model-name", "--tensor-parallel-size", "-tp", "--kv-cache-dtype",
    "--max-model-len", "--block-size", "--kv-transfer-config", "--dtype", "--host", "--port",
    "--tokenizer", "--revision", "--tokenizer-revision", "--chat-template",
)


def _convert(kind: str, raw: str) -> tuple[Any, str]:
    """Convert one raw deployment value; return (value, error message or '')."""
    value = raw.strip()
    optional = kind.endswith("?")
    kind = kind.rstrip("?")
    if optional and value == "":
        return "", ""
    if kind in ("abspath", "path", "name", "host") and value == "":
        return None, "must not be empty"
    if kind == "abspath":
        return (value, "") if PurePosixPath(value).is_absolute() else (
            None, f"must be an absolute path, got {value!r}")
    if kind == "host":
        try:
            ipaddress.ip_address(value)
        except ValueError:
            if value != "localhost":
                return None, f"must be an IP address (e.g. 127.0.0.1), got {value!r}"
        return value, ""
    if kind in ("port", "count"):
        if not value.isdigit():
            return None, f"must be an integer, got {value!r}"
        n = int(value)
        if kind == "port" and not 1 <= n <= 65535:
            return None, f"must be a TCP port (1-65535), got {n}"
        return n, ""
    if kind == "float":
        try:
            f = float(value)
        except ValueError:
            return None, f"must be a number, got {value!r}"
        return (f, "") if f > 0 else (None, "must be > 0")
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
        owned = [a for a in argv if a.split("=", 1)[0] in OWNED_VLLM_FLAGS]
        if owned:
            return None, f"sets flags kvpersist owns: {', '.join(owned)}"
        return argv, ""
    if kind == "name" and any(ch.isspace() for ch in value):
        return None, f"must not contain whitespace, got {value!r}"
    return value, ""


def settings_from_env(
    values: Mapping[str, str],
    environ: Mapping[str, str],
    generic: GenericConfig,
    source: str,
) -> tuple[DeploymentSettings | None, list[Problem]]:
    """Deployment settings from the file's ``values``, overridden by ``environ`` (deployment
    keys only). Returns (settings or None, problems)."""
    problems: list[Problem] = []
    merged: dict[str, str] = {}
    origin: dict[str, str] = {}
    for key, (_, _, default) in DEPLOYMENT_KEYS.items():
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
            raw = raw.format(cache_root=converted.get("cache_root", ""),
                             state_dir=converted.get("state_dir", ""))
        value, message = _convert(kind, raw)
        if message:
            problems.append(Problem(origin[key], message, _DEPLOY_FIX.get(key, "")))
        else:
            converted[name] = value
    if problems:
        return None, problems
    return DeploymentSettings(**converted), problems


_DEPLOY_FIX = {
    "KVP_CACHE_ROOT": "set the NVMe directory for L2 files, e.g. /var/lib/kvp/cache",
    "KVP_SERVED_MODEL_NAME": "set the public model name clients send",
    "KVP_MODEL_PATH": "set the real weights directory (or hub id) vLLM loads",
    "KVP_VLLM_EXTRA_ARGS": "remove those flags; kvpersist renders them from identity.env",
    "KVP_STATE_DIR": "use an absolute path",
}


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
) -> Deployment:
    """Validate env-file ``values`` (+ ``environ`` overrides) into a :class:`Deployment`.

    Unknown ``KVP_`` keys and any non-``KVP_`` key are errors. Identity problems are errors
    unless unpinned operation is opted into (``allow_unpinned`` or KVP_ALLOW_UNPINNED=true),
    in which case the namespace is ``kvp-unpinned-<unpinned_token>``. Settings that cannot
    agree (ports, TP vs GPU count, block size vs chunk size) are errors. Raises ConfigError.
    """
    problems: list[Problem] = []
    known = set(IDENTITY_KEYS.values()) | set(DEPLOYMENT_KEYS)
    for key in values:
        if key not in known:
            problems.append(Problem(f"{source}: {key}", "unknown key",
                                    _closest(key, known)))
    settings, setting_problems = settings_from_env(values, environ, generic, source)
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
                      identity_values=_valid_identity_values(values, id_problems, source))


def _valid_identity_values(values: Mapping[str, str], id_problems: list[Problem],
                           source: str) -> dict[str, Any]:
    bad = {p.where for p in id_problems}
    out: dict[str, Any] = {}
    for name, key in IDENTITY_KEYS.items():
        if f"{source}: {key}" in bad or key not in values:
            continue
        raw = values[key].strip()
        out[name] = int(raw) if raw.isdigit() and name in _INT_IDENTITY else raw
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
    if not is_loopback(s.lmcache_host) and is_wildcard(s.lmcache_http_host):
        problems.append(Problem(f"{source}: KVP_LMCACHE_HTTP_HOST",
                                "the HTTP admin API has no authentication",
                                "bind it to loopback or a private management address"))
    return problems


def _closest(key: str, known: set[str]) -> str:
    import difflib

    match = difflib.get_close_matches(key, sorted(known), n=1)
    return f"did you mean {match[0]}?" if match else "remove it (see README: configuration)"
