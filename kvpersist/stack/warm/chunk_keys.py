"""The L2 chunk files a warm set maps to, computed by LMCache's own code (imports lmcache).

The cache server turns token ids into keys itself (``/cache/prefetches`` and every lookup):
``TokenHasher(chunk_size, hash_algorithm)`` built from the server's arguments exactly as
``MPCacheServerContext`` builds it (``lmcache/v1/multiprocess/engine_context.py``), then
``key_resolver.resolve_object_keys`` expands each complete chunk into one ``ObjectKey`` per
TP rank in object group 0, and the ``nixl_store_dynamic`` adapter names each key's file with
``_object_key_to_filename`` (or ``_object_key_to_relpath`` with ``shard_dirs``). This module
parses the deployment's rendered server argv with LMCache's own parser and calls those
functions; nothing of the hash or of the naming is re-implemented here.

Only object group 0 is computed: kvpersist never renders ``--separate-object-groups``, and
without it every kernel group of a model shares group 0.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass

from kvpersist.errors import ConfigError, Problem


@dataclass(frozen=True)
class KeyScheme:
    """How the deployment's server turns token ids into chunk files."""

    chunk_size: int
    hash_algorithm: str
    shard_dirs: bool
    separate_object_groups: bool


def key_scheme(server_argv: Sequence[str]) -> KeyScheme:
    """Parse the rendered ``lmcache server`` argv (``["lmcache", "server", ...]``) with
    LMCache's own parser and config builders. Raises ConfigError if LMCache refuses it."""
    os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
    from lmcache.cli.commands.server import ServerCommand
    from lmcache.v1.distributed.config import parse_args_to_config
    from lmcache.v1.multiprocess.config import parse_args_to_mp_server_config

    parser = argparse.ArgumentParser(prog="lmcache server", exit_on_error=False)
    ServerCommand().add_arguments(parser)
    try:
        args = parser.parse_args(list(server_argv[2:]))
        mp = parse_args_to_mp_server_config(args)
        storage = parse_args_to_config(args)
    except (argparse.ArgumentError, ValueError, SystemExit) as exc:
        raise ConfigError(Problem("lmcache server argv", f"LMCache's parser refuses it: {exc}",
                                  "kvp-admin render CONFIG shows the argv")) from None
    shard = False
    for adapter in storage.l2_adapter_config.adapters:
        params = getattr(adapter, "backend_params", None)
        if isinstance(params, dict) and "file_path" in params:
            shard = str(params.get("shard_dirs", "false")).lower() == "true"
            break
    return KeyScheme(int(mp.chunk_size), str(mp.hash_algorithm), shard,
                     bool(mp.separate_object_groups))


def chunk_files(scheme: KeyScheme, model_name: str, world_size: int,
                token_ids: Sequence[int], cache_salt: str = "") -> tuple[list[str], int]:
    """The relative paths (under the cache root) of the chunk files holding ``token_ids``'s
    complete chunks for every TP rank, in chunk order (rank-minor), and the chunk count.
    Raises ConfigError for a sequence LMCache refuses (e.g. too many tokens)."""
    from lmcache.v1.distributed.l2_adapters.nixl_store_agents.dynamic_nixl_store_agent import (
        _object_key_to_filename,
        _object_key_to_relpath,
    )
    from lmcache.v1.multiprocess.cache_control.key_resolver import resolve_object_keys

    hasher = _hasher(scheme)
    try:
        keys, chunks = resolve_object_keys(hasher, model_name, world_size, list(token_ids),
                                           cache_salt)
    except ValueError as exc:
        raise ConfigError(Problem("warm set", f"LMCache cannot key it: {exc}")) from None
    name = _object_key_to_relpath if scheme.shard_dirs else _object_key_to_filename
    return [name(k) for k in keys], chunks


_HASHERS: dict[tuple[int, str], object] = {}


def _hasher(scheme: KeyScheme) -> object:
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    key = (scheme.chunk_size, scheme.hash_algorithm)
    if key not in _HASHERS:
        _HASHERS[key] = TokenHasher(chunk_size=scheme.chunk_size,
                                    hash_algorithm=scheme.hash_algorithm)
    return _HASHERS[key]
