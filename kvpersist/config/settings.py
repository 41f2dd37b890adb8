"""Deployment settings (the deployment keys of identity.env): their schema, and how each
value is read (pure).

Settings do not change the bytes of a KV block: they never enter the namespace.
:func:`convert_setting` reads one raw value by its kind; :mod:`kvpersist.config.deployment`
merges the file, the environment and the defaults and checks that the values agree.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from kvpersist.config.engine_args import extra_args_problems
from kvpersist.config.envfile import value_problem
from kvpersist.config.shared_tier import parse_shared_tier
from kvpersist.config.values import (
    MAX_WAIT_S,
    SYSTEM_TREES,
    host_problem,
    is_scoped,
    parse_decimal,
    parse_duration,
    parse_max_age,
    parse_size_or_percent,
    parse_uint,
    path_problem,
    system_dir,
)


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
    #: the container engine of KVP_IMAGE (docker or podman; the same argv either way)
    container_engine: str = "docker"
    #: host paths bind-mounted read-only at the same path into the container (e.g. a venv
    #: holding vLLM's CPU build and its interpreter); never the cache root, the state dir,
    #: a key or a secret (deployment.agreement_problems)
    container_mounts: tuple[str, ...] = ()
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
    #: run a vLLM outside the supported releases (docs/vllm-versions.md): the checks that
    #: need vLLM's internals are skipped, each saying so
    allow_unsupported_vllm: bool = False
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
    #: reported ready anyway (cold, degraded in health); kvpersist.stack.warm.readiness
    warmup_wait: float = 120.0
    #: the warm-up computes the warm set's chunks missing from every tier by sending its
    #: token ids to the deployment's own vLLM (one token each) before ready
    #: (``warmup --compute-missing``; docs/warm-restart.md)
    warmup_compute: bool = False
    #: launch even though files that are not LMCache's have ``.tmp.`` in their names under
    #: the cache root, which LMCache's clean-up deletes at a clean stop (default: refuse)
    allow_lmcache_tmp_cleanup: bool = False
    #: the longest a chunk file may stay on the cache root, counted from when it was written
    #: (its mtime; docs/max-age.md), in seconds; 0: no maximum. ``prune --max-age`` and the
    #: opt-in timer delete what is older; report and metrics count it
    l2_max_age_s: float = 0.0
    #: run a model in kvpersist.config.known_bad (its canary must stay on)
    allow_known_corruption: bool = False
    #: the known-answer canary (docs/canary.md): at every launch and restart before ready,
    #: and in ``health --canary``
    canary: bool = True
    #: full cache chunks in the canary's prompt
    canary_chunks: int = 2
    #: max |logprob difference| the canary accepts; 0: the measured one of the KV dtype
    canary_tolerance: float = 0.0
    #: warm-set entries ``health --canary`` samples besides the canary prompt (0: none)
    canary_warm_sample: int = 0


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
    "KVP_CONTAINER_ENGINE": ("container_engine", "engine", "docker"),
    "KVP_CONTAINER_MOUNTS": ("container_mounts", "mounts", ""),
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
    # empty: the namespace's own key, {state_dir}/keys/<namespace>/l2-master.key
    # (kvpersist.config.key_paths; filled in by build_deployment once the namespace is known)
    "KVP_SERDE_KEY_FILE": ("serde_key_file", "abspath?", ""),
    "KVP_PREREAD_RAM_SHARE": ("preread_ram_share", "share", "0"),
    "KVP_ALLOW_UNPINNED": ("allow_unpinned", "bool", "false"),
    "KVP_ALLOW_UNSUPPORTED_VLLM": ("allow_unsupported_vllm", "bool", "false"),
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
    "KVP_WARMUP_COMPUTE": ("warmup_compute", "bool", "false"),
    "KVP_ALLOW_LMCACHE_TMP_CLEANUP": ("allow_lmcache_tmp_cleanup", "bool", "false"),
    "KVP_L2_MAX_AGE": ("l2_max_age_s", "maxage", ""),
    "KVP_CANARY": ("canary", "bool", "true"),
    "KVP_ALLOW_KNOWN_CORRUPTION": ("allow_known_corruption", "bool", "false"),
    "KVP_CANARY_CHUNKS": ("canary_chunks", "chunks", "2"),
    "KVP_CANARY_TOLERANCE": ("canary_tolerance", "tolerance", ""),
    "KVP_CANARY_WARM_SAMPLE": ("canary_warm_sample", "sample", "0"),
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


CONTAINER_ENGINES = ("docker", "podman")


def parse_mounts(value: str) -> tuple[tuple[str, ...], str]:
    """The absolute host paths of ``KVP_CONTAINER_MOUNTS`` (separated by spaces or commas),
    normalized and without repeats; and an error message."""
    out: list[str] = []
    for token in (t for t in re.split(r"[ ,]+", value) if t):
        problem = path_problem(token)
        if problem or not token.startswith("/") or ":" in token:
            why = problem or "must be an absolute path without ':'"
            return (), f"{why}: {token[:64]!r}"
        norm = str(PurePosixPath(token))
        system = system_dir(norm)
        if system and not norm.startswith("/usr/"):
            return (), (f"{norm!r} is or lies in the system directory {system}: mount only "
                        "what the container needs")
        if norm not in out:
            out.append(norm)
    return tuple(out), ""


def config_name_problem(name: str) -> str:
    """Why ``name`` cannot name a directory under configs/ (KVP_GENERIC_CONFIG), or ''."""
    return "" if _CONFNAME.match(name) else (
        f"must be the name of a directory under configs/, got {name!r}")


_USER = re.compile(r"[a-z_][a-z0-9_-]{0,31}\Z")


def convert_setting(kind: str, raw: str, vllm_version: str | None = None) -> tuple[Any, str]:
    """Convert one raw deployment value (``vllm_version``: the release whose flag table reads
    vLLM arguments); return (value, error message or '')."""
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
    if kind == "chunks":
        n = parse_uint(value, 2)
        return (n, "") if n is not None and 1 <= n <= 16 else (
            None, f"must be a whole number of chunks from 1 to 16, got {value!r}")
    if kind == "sample":
        n = parse_uint(value, 2)
        return (n, "") if n is not None and n <= 16 else (
            None, f"must be a whole number of warm-set entries from 0 to 16, got {value!r}")
    if kind == "tolerance":
        if value == "":
            return 0.0, ""
        f = parse_decimal(value)
        return (f, "") if f is not None and 0 < f <= 10 else (
            None, f"must be empty (the KV dtype's measured tolerance) or a number of nats "
                  f"above 0 and at most 10, got {value!r}")
    if kind == "duration":
        try:
            seconds = parse_duration(value)
        except ValueError as exc:
            return None, str(exc)
        if not 0 < seconds <= MAX_WAIT_S:
            return None, f"must be more than 0 and at most a day ({MAX_WAIT_S:g} s)"
        return seconds, ""
    if kind == "maxage":
        return parse_max_age(value)
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
    if kind == "engine":
        return (value, "") if value in CONTAINER_ENGINES else (
            None, f"must be {' or '.join(CONTAINER_ENGINES)}, got {value!r}")
    if kind == "mounts":
        return parse_mounts(value)
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
        problems = extra_args_problems(argv, vllm_version)
        return (None, "; ".join(problems)) if problems else (argv, "")
    if kind == "name" and any(ch.isspace() for ch in value):
        return None, f"must not contain whitespace, got {value!r}"
    if kind == "name" and value.startswith("-"):
        return None, f"must not start with '-', got {value!r}"
    return value, ""


#: what to do about a bad or missing deployment key
DEPLOY_FIX = {
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
    "?cluster=0&tls=0&db=0&workers=8&timeout=1&connect_timeout=10 (docs/fleet.md)",
    "KVP_SHARED_TIER_SECRET_FILE": "an absolute path to an owner-only file with username=... "
    "and password=... lines",
    "KVP_WARMUP_FILE": "empty (no warm set) or an absolute path to a JSONL file of "
    '{"messages": [...]} or {"prompt": "..."} lines (docs/warm-restart.md)',
    "KVP_CONTAINER_ENGINE": "docker or podman (the container engine that runs KVP_IMAGE)",
    "KVP_CONTAINER_MOUNTS": "absolute host paths the container needs read-only (e.g. the "
    "venv with vLLM), separated by spaces; never the cache root, the state dir, a key or a "
    "secret",
    "KVP_WARMUP_WAIT": "seconds (or 90s, 5m) the launch's warm-up may take, e.g. 120",
    "KVP_WARMUP_COMPUTE": "true or false: the launch's warm-up computes the warm set's chunks "
    "found on no tier with the deployment's vLLM before ready (docs/warm-restart.md)",
    "KVP_CANARY": "true or false: the known-answer canary at launch, restart and "
    "`health --canary` (docs/canary.md)",
    "KVP_ALLOW_KNOWN_CORRUPTION": "true or false: launch a model LMCache's connector is known "
    "to serve wrong KV for (docs/canary.md), with the canary on",
    "KVP_CANARY_WARM_SAMPLE": "how many warm-set entries `health --canary` also checks, 0 "
    "to 16 (default 0; docs/canary.md)",
    "KVP_CANARY_CHUNKS": "how many full cache chunks the canary's prompt holds, 1 to 16 "
    "(default 2)",
    "KVP_CANARY_TOLERANCE": "empty (the KV dtype's measured tolerance, docs/canary.md) or "
    "the largest logprob difference accepted, e.g. 0.2",
    "KVP_L2_MAX_AGE": "empty (no maximum) or how long a chunk file may stay after it was "
    "written, with a unit: 30d, 12h, 90m (docs/max-age.md)",
}
