"""The generic cache-server config (``configs/<name>/lmcache.yaml``): schema and validation
(pure).

Given the parsed YAML as a dict, build a frozen :class:`GenericConfig` or raise one
:class:`ConfigError` listing every problem at once.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpersist.config.values import host_problem, parse_size_or_percent
from kvpersist.errors import ConfigError, Problem


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
