"""Drive a real ``lmcache server`` the way vLLM's workers do, without a model or a GPU.

This uses LMCache's own multiprocess client stack (``ServerBenchClient`` of
``lmcache bench server``: the request client, the engine-driven transfer context and the
IPC cache keys that ``LMCacheMPWorkerAdapter`` sends) with CPU tensors, under the
deployment's LMCache model name, so the files it stores are named exactly as vLLM's would
be (``<namespace>_<kv_rank>_<group>_<hash>.bin``). TP > 1 is simulated with several
worker ranks, each writing its own file per chunk.

The bench client fixes the model name to ``test-model`` in a module constant; the driver
sets that constant for the duration of a session (client side only: the server and the
storage code are stock). lmcache and torch are imported lazily.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

_LOCK = threading.Lock()


def shape_spec(num_kv_heads: int, head_dim: int, num_layers: int, *, block_size: int = 128,
               num_blocks: int = 256, dtype: str = "bfloat16") -> str:
    """LMCache KV shape spec ``(2,NB,BS,NH,HS):dtype:L`` for a classic split-K/V model."""
    return f"(2,{num_blocks},{block_size},{num_kv_heads},{head_dim}):{dtype}:{num_layers}"


#: The tiny demo model's KV geometry (configs/cpu-demo): 4 layers, 2 KV heads, head dim 64.
DEMO_TINY_SPEC = shape_spec(2, 64, 4)


@dataclass(frozen=True)
class Lookup:
    """Hit count of one lookup, in chunks."""

    hit_chunks: int
    total_chunks: int


class KVDriver:
    """A connected set of simulated workers. Use :func:`connect`."""

    def __init__(self, client: Any, log: list[str], pristine: bool = False) -> None:
        self._client = client
        self.log = log
        self._serial = 0
        # the simulated engines' KV as generated (``recompute``), per worker and layer
        self._pristine: list[dict[str, Any]] = [
            {name: t.clone() for name, t in w.kv_caches.items()} for w in client._workers
        ] if pristine else []

    def _request(self, seq: int, kind: str) -> Any:
        # a request id is never reused (as vLLM's are not): a lookup the client gave up on
        # may still be running on the server under its id
        self._serial += 1
        req = self._client.create_request(seq, f"kvp-{kind}-{seq}-{self._serial}", kind)
        if req is None:
            raise ValueError("request shorter than one chunk")
        return req

    def store(self, seq: int) -> list[str]:
        """Store sequence ``seq`` (all full chunks, every rank); return per-chunk digests of
        the stored bytes. Raises RuntimeError if any rank's store failed."""
        req = self._request(seq, "store")
        result = self._client.store(req, 0, req.num_full_tokens)
        if result is None or not result.succeeded:
            raise RuntimeError(f"store of sequence {seq} failed: {result}")
        digests = self._client.compute_checksums(req, 0, req.num_full_tokens) or []
        self._client.end_session(req)
        return list(digests)

    def store_tokens(self, token_ids: Sequence[int]) -> int:
        """Store the complete chunks of an arbitrary token sequence (e.g. a warm set's ids, as
        vLLM's workers would after computing its prefill) on every rank; return the chunks
        stored. Raises ValueError for fewer tokens than one chunk or more than the simulated
        KV cache holds, RuntimeError if a rank's store failed."""
        import dataclasses

        base = self._request(0, "store")
        block = base.num_full_tokens // base.num_blocks
        full = len(token_ids) // base.chunk_size * base.chunk_size
        if not full:
            raise ValueError("fewer tokens than one chunk")
        if full // block > self._client._num_blocks:
            raise ValueError("more tokens than the simulated KV cache holds")
        req = dataclasses.replace(base, token_ids=tuple(token_ids), num_full_tokens=full,
                                  total_chunks=full // base.chunk_size, block_offset=0,
                                  num_blocks=full // block)
        result = self._client.store(req, 0, full)
        if result is None or not result.succeeded:
            raise RuntimeError(f"store of {len(token_ids)} tokens failed: {result}")
        self._client.end_session(req)
        return int(req.total_chunks)

    def recompute(self, seq: int) -> list[str]:
        """What vLLM does after a miss: compute ``seq``'s KV again, then store it (every chunk,
        every rank); return the per-chunk digests. The simulated engines' blocks of ``seq`` get
        back the values generated at connect time: a retrieve may have written other bytes
        there since (sequences share blocks). Needs ``connect(..., pristine=True)``; raises
        RuntimeError without it."""
        from lmcache.cli.commands.bench.server_bench.helpers import _tensor_is_mla

        if not self._pristine:
            raise RuntimeError("recompute needs connect(..., pristine=True)")
        req = self._client.create_request(seq, "kvp-recompute", "recompute")
        for worker, pristine in zip(self._client._workers, self._pristine, strict=True):
            for name, t in worker.kv_caches.items():
                dim = 0 if _tensor_is_mla(t) else 1
                t.narrow(dim, req.block_offset, req.num_blocks).copy_(
                    pristine[name].narrow(dim, req.block_offset, req.num_blocks))
        return self.store(seq)

    def lookup(self, seq: int) -> Lookup:
        """Look sequence ``seq`` up (L1, then L2 on disk, prefetching into L1)."""
        req = self._request(seq, "lookup")
        res = self._client.lookup(req)
        self._client.end_session(req)
        if not res.succeeded:
            raise RuntimeError(f"lookup of sequence {seq} failed: {res.error}")
        return Lookup(res.hit_chunks, res.total_chunks)

    def lookup_and_retrieve(self, seq: int, *, prefix: bool = False,
                            ) -> tuple[Lookup, list[str] | None]:
        """Look ``seq`` up; on a full hit zero the destination blocks, retrieve, and return
        the digests of what arrived (None when not every chunk hit). With ``prefix``, a
        partial hit retrieves the chunks that hit, as vLLM does (it recomputes the rest), and
        returns their digests (None when nothing hit or the retrieve failed)."""
        req = self._request(seq, "retrieve")
        res = self._client.lookup(req)
        lk = Lookup(res.hit_chunks if res.succeeded else 0, res.total_chunks)
        digests: list[str] | None = None
        tokens = 0
        if res.succeeded and res.is_full_hit:
            tokens = req.num_full_tokens
        elif prefix and res.succeeded and res.hit_chunks > 0:
            tokens = res.hit_chunks * req.chunk_size
        if tokens:
            self._client.zero_destination(req, 0, tokens)
            out = self._client.retrieve(req, 0, tokens)
            if out is not None and out.succeeded:
                digests = list(self._client.compute_checksums(req, 0, tokens) or [])
        self._client.end_session(req)
        return lk, digests


@contextmanager
def connect(rpc_url: str, http_url: str, model_name: str, *, tp_size: int = 1,
            num_tokens: int = 1024, kvcache_shape_spec: str = DEMO_TINY_SPEC,
            pristine: bool = False) -> Iterator[KVDriver]:
    """Connect ``tp_size`` simulated workers to the server at ``rpc_url`` (``tcp://h:p``)
    under ``model_name``; yield a :class:`KVDriver`; always close.

    Each request holds ``num_tokens + 1`` tokens. ``pristine`` keeps a copy of the generated
    KV (for :meth:`KVDriver.recompute`; the size of the simulated KV cache again). Raises
    RuntimeError if registration fails.
    """
    from lmcache.cli.commands.bench.server_bench import helpers
    from lmcache.cli.commands.bench.server_bench.client import ServerBenchClient
    from lmcache.cli.commands.bench.server_bench.config import BenchConfig

    config = BenchConfig(
        rpc_url=rpc_url, http_url=http_url, mode="cpu", transfer_mode="auto",
        tp_size=tp_size, use_mla=False, num_tokens=num_tokens,
        kvcache_shape_spec=kvcache_shape_spec, num_blocks=256, block_size=128,
    )
    log: list[str] = []
    with _LOCK:
        saved = helpers._MODEL_NAME
        helpers._MODEL_NAME = model_name
        client = ServerBenchClient(config, log.append)
        try:
            client.start()
            yield KVDriver(client, log, pristine)
        finally:
            try:
                client.close()
            finally:
                helpers._MODEL_NAME = saved
