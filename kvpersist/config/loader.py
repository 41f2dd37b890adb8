"""Load a deployment from disk (the I/O edge of configuration).

``CONFIG`` is a path to an ``identity.env`` file, a directory holding one, or the name of a
directory under ``configs/``. Reading happens here; validation is in :mod:`settings`.
"""

from __future__ import annotations

import os
import secrets
import stat
from collections.abc import Mapping, Sequence
from pathlib import Path

import yaml

from kvpersist.config.deployment import Deployment, build_deployment
from kvpersist.config.envfile import parse_env
from kvpersist.config.generic import GenericConfig, generic_from_dict
from kvpersist.config.settings import config_name_problem
from kvpersist.errors import ConfigError, Problem, UsageError
from kvpersist.system import resources, untrusted

ENV_FILE = "identity.env"
GENERIC_FILE = "lmcache.yaml"


def resolve_config(config: str) -> tuple[str, Path]:
    """Return (deployment name, path of its identity.env); raise ConfigError if none."""
    try:
        return _resolve_config(config)
    except (OSError, ValueError) as exc:  # a parent that cannot be searched, a NUL byte
        raise ConfigError(Problem(config, f"cannot look up this config: {exc}",
                                  "check the path and that this user may read it")) from exc


def _resolve_config(config: str) -> tuple[str, Path]:
    path = Path(config)
    if path.is_file():
        name = path.parent.name if path.name == ENV_FILE else path.stem
        return name, path
    if path.is_dir() and (path / ENV_FILE).is_file():
        return path.name, path / ENV_FILE
    for there in (path, path / ENV_FILE):
        if there.exists() and not there.is_dir() and not there.is_file():
            # a FIFO, a device (a link to /dev/zero): named as what it is, never opened
            raise ConfigError(Problem(str(there), "is not a regular file",
                                      "point CONFIG at an identity.env file"))
    if "/" not in config and config not in ("", ".", ".."):
        candidate = resources.configs_dir() / config / ENV_FILE
        if candidate.is_file():
            return config, candidate
    available = ", ".join(list_config_names()) or "none"
    raise ConfigError(Problem(config, "no such config (a path to identity.env, a directory "
                              "holding one, or a name under configs/)",
                              f"available: {available}"))


def list_config_names() -> list[str]:
    """Names of the deployment configs under configs/ (those with an identity.env)."""
    root = resources.configs_dir()
    try:
        return sorted(p.name for p in root.iterdir() if (p / ENV_FILE).is_file())
    except OSError:  # no configs directory (or not readable): no shipped configs
        return []


#: the largest config file read (an identity.env or lmcache.yaml is a few KiB)
MAX_CONFIG_BYTES = 1 << 20


def read_text(path: Path, what: str) -> str:
    """The text of a config file: its bytes as they are (no newline translation: a CR
    stays for the parser to refuse, as systemd and a shell would read it otherwise), strict
    UTF-8, a regular file of at most :data:`MAX_CONFIG_BYTES` (never blocking on a FIFO).
    Raises ConfigError naming the file."""
    try:
        data = untrusted.read_bytes(path, max_bytes=MAX_CONFIG_BYTES,
                                    fix="point the config at the right file (a regular "
                                    "file of a few KiB)")
        return untrusted.decode(data, str(path))
    except FileNotFoundError as exc:
        raise ConfigError(Problem(str(path), f"cannot read {what}: {exc.strerror}")) from exc
    except untrusted.UnreadableFile as exc:
        raise ConfigError(Problem(exc.path, f"cannot read {what}: {exc.why}", exc.fix)) \
            from None


def load_generic(name: str = "generic") -> GenericConfig:
    """Read and validate configs/<name>/lmcache.yaml."""
    candidates = [resources.configs_dir() / name / GENERIC_FILE,
                  resources.home() / "configs" / name / GENERIC_FILE]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        raise ConfigError(Problem(f"configs/{name}/{GENERIC_FILE}", "not found",
                                  "set KVP_GENERIC_CONFIG or KVP_HOME"))
    try:
        data = yaml.safe_load(read_text(path, "the generic config"))
    except yaml.YAMLError as exc:
        raise ConfigError(Problem(str(path), f"not valid YAML: {exc}")) from exc
    return generic_from_dict(data, str(path))


def load_deployment(config: str, environ: Mapping[str, str] | None = None,
                    allow_unpinned: bool = False) -> Deployment:
    """Load, validate and return the deployment named by ``config``.

    ``environ`` (default ``os.environ``) overrides deployment keys. Raises ConfigError
    listing every problem.
    """
    env = os.environ if environ is None else environ
    name, path = resolve_config(config)
    source = str(path)
    values = parse_env(read_text(path, "the identity file"), source)
    generic_key = "KVP_GENERIC_CONFIG"
    generic_name = env.get(generic_key) or values.get(generic_key) or "generic"
    problem = config_name_problem(generic_name)
    if problem:
        origin = f"environment {generic_key}" if env.get(generic_key) else f"{source}: " \
            f"{generic_key}"
        raise ConfigError(Problem(origin, problem, "name a directory under configs/ holding "
                                  "lmcache.yaml"), source)
    generic = load_generic(generic_name)
    return build_deployment(name, source, values, env, generic,
                            allow_unpinned=allow_unpinned,
                            unpinned_token=secrets.token_hex(16),
                            legacy_state_dir=_legacy_state_dir(values, env))


#: what kvpersist 0.1 kept in ``<cache root>/.kvpersist`` when KVP_STATE_DIR was not set
LEGACY_STATE_ENTRIES = ("keys", "manifests", "models")


def _legacy_state_dir(values: Mapping[str, str], env: Mapping[str, str]) -> bool:
    """True when no KVP_STATE_DIR is set and the cache root holds kvpersist 0.1's state (its
    serde key above all: a new key would turn every chunk on disk into a miss)."""
    if env.get("KVP_STATE_DIR") or values.get("KVP_STATE_DIR"):
        return False
    root = env.get("KVP_CACHE_ROOT") or values.get("KVP_CACHE_ROOT") or ""
    if not root.startswith("/") or "\0" in root:
        return False  # validation reports it
    meta = os.path.join(root, ".kvpersist")
    try:
        if not stat.S_ISDIR(os.lstat(meta).st_mode):
            return False
        return any(os.path.lexists(os.path.join(meta, e)) for e in LEGACY_STATE_ENTRIES)
    except (OSError, ValueError):
        return False


def load_identity_values(config: str) -> tuple[str, dict[str, str]]:
    """(source path, raw env values) of a config, for commands that look at fields only."""
    _, path = resolve_config(config)
    return str(path), parse_env(read_text(path, "the identity file"), str(path))


def deployments_with_shared_tier(configs: Sequence[str]) -> list[Deployment]:
    """The deployments that use a shared tier: ``configs`` (each must have one: UsageError
    otherwise), or every config under configs/ that loads and has one (a config that does
    not load is not this tier's). Raises ConfigError for a named config that does not
    load."""
    if configs:
        deps = [load_deployment(c) for c in configs]
        missing = [d.name for d in deps if d.shared is None]
        if missing:
            raise UsageError(f"{', '.join(missing)}: no shared tier (KVP_SHARED_TIER is empty)")
        return deps
    out = []
    for name in list_config_names():
        try:
            dep = load_deployment(name)
        except Exception:  # noqa: BLE001 - a config that does not load is not this tier's
            continue
        if dep.shared is not None:
            out.append(dep)
    return out
