"""The chunk keys of token sequences on every tier, by LMCache's own code (imports lmcache).

As the warm-up does (:mod:`kvpersist.stack.warm.chunk_keys`, whose :class:`KeyScheme` parses the
deployment's server argv with LMCache's parser): ``TokenHasher`` hashes each complete chunk
chained over its prefix, ``key_resolver.resolve_object_keys`` expands each chunk into one
``ObjectKey`` per TP rank in object group 0 (with the request's ``cache_salt``), the
``nixl_store_dynamic`` adapter names its file (``_object_key_to_filename`` or, with
``shard_dirs``, ``_object_key_to_relpath``) and the shared tier's resp and valkey adapters
its wire key (``_object_key_to_string``; kvpersist renders no ``key_prefix``). Nothing of the
hash or of the naming is re-implemented here.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpersist.errors import ConfigError, Problem
from kvpersist.l2.forget.plan import ChunkKey
from kvpersist.stack.warm.chunk_keys import KeyScheme


def chunk_keys(scheme: KeyScheme, model_name: str, world_size: int,
               sequences: Sequence[Sequence[int]], cache_salt: str = "") -> list[ChunkKey]:
    """Every key of every complete chunk of ``sequences`` (request ``i + 1`` is
    ``sequences[i]``), in sequence, chunk and rank order; a chunk two sequences share (a
    common prefix) is listed each time. Raises ConfigError for what LMCache refuses to key
    (too many tokens, a salt holding ``@``, ``/``, ``\\`` or NUL, or longer than 128)."""
    from lmcache.v1.distributed.l2_adapters.native_connector_l2_adapter import (
        _object_key_to_string,
    )
    from lmcache.v1.distributed.l2_adapters.nixl_store_agents.dynamic_nixl_store_agent import (
        _object_key_to_filename,
        _object_key_to_relpath,
    )
    from lmcache.v1.multiprocess.cache_control.key_resolver import resolve_object_keys
    from lmcache.v1.multiprocess.token_hasher import TokenHasher

    hasher = TokenHasher(chunk_size=scheme.chunk_size, hash_algorithm=scheme.hash_algorithm)
    name = _object_key_to_relpath if scheme.shard_dirs else _object_key_to_filename
    out: list[ChunkKey] = []
    for n, ids in enumerate(sequences, start=1):
        try:
            keys, chunks = resolve_object_keys(hasher, model_name, world_size, list(ids),
                                               cache_salt)
        except ValueError as exc:
            raise ConfigError(Problem(f"request {n} ({len(ids)} tokens)",
                                      f"LMCache cannot key it: {exc}")) from None
        per_chunk = len(keys) // chunks if chunks else 0
        for i, k in enumerate(keys):
            out.append(ChunkKey(n, i // per_chunk, int(k.kv_rank), k.chunk_hash.hex(),
                                k.cache_salt, name(k), _object_key_to_string(k)))
    return out
