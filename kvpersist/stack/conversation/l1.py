"""Drop chunk keys from a running cache server through its admin API (I/O, HTTP).

LMCache 0.5.6's MP server (``lmcache/v1/multiprocess/http_apis/cache_api.py`` and
``cache_control/object_service.py``) answers ``DELETE /cache/objects`` with a JSON body
``{"keys": [EncodedObjectKey...], "tier": "l1"|"l2"|"all", "force": bool, "adapter": str}``:
a key-addressed delete, at most 10,000 keys a request, answering 200 with
``{"deleted", "skipped", "ok"[, "error"]}``.

- ``tier: "l1"``: ``StorageManager.delete_l1_keys`` removes each key held in L1 (host
  memory); a key read- or write-locked by a request in flight is skipped (counted in
  ``skipped``) unless ``force``, which kvpersist never sets (it could corrupt a transfer).
- ``tier: "l2"`` with ``adapter: "nixl_store_dynamic"``: the adapter's ``delete`` drops each
  key from its in-memory index (and unlinks the file it names, which ``forget`` has removed
  already). This matters: a key the server stored or found since its start stays in that
  index after its file is gone, and a lookup would then count it as an L2 hit whose load
  fails. A key a lookup holds pinned at that moment stays in the index (the adapter skips
  it silently). ``deleted`` counts the whole batch, whatever was in the index.

No other route is used; ``/cache/clear`` (everything) never. ``GET /healthcheck`` tells a dry
run whether a server answers.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvpersist.errors import KvpError
from kvpersist.system.http_client import Refused, Unreachable
from kvpersist.system.lmcache_client import LMCacheClient

#: LMCache's ``object_service.MAX_DELETE_BATCH``
MAX_BATCH = 10_000
#: the L2 adapter of the NVMe tier (its ``type_name`` in ``GET /config/adapters``)
NVME_ADAPTER = "nixl_store_dynamic"
TIMEOUT_S = 30.0


class ServerDown(KvpError):
    """No cache server answers at the URL (nothing it holds in memory to forget)."""


@dataclass(frozen=True)
class Deleted:
    """What the server answered, summed over the batches."""

    deleted: int
    skipped: int


def answers(base_url: str, timeout: float = 5.0) -> bool:
    """Whether a cache server answers ``GET /healthcheck`` at ``base_url``."""
    return LMCacheClient(base_url, timeout).healthy()


def delete_objects(base_url: str, keys: Sequence[dict[str, Any]], *, tier: str,
                   adapter: str | None = None, timeout: float = TIMEOUT_S) -> Deleted:
    """``DELETE /cache/objects`` for ``keys`` (EncodedObjectKey dicts) on ``tier``, in
    batches of :data:`MAX_BATCH`. Raises ServerDown when the server does not answer at all,
    KvpError for any other answer than 200 with ``ok`` true."""
    client = LMCacheClient(base_url, timeout)
    deleted = skipped = 0
    for i in range(0, len(keys), MAX_BATCH):
        body: dict[str, Any] = {"keys": list(keys[i:i + MAX_BATCH]), "tier": tier,
                                "force": False}
        if adapter is not None:
            body["adapter"] = adapter
        try:
            r = client.delete_objects(body)
        except Refused:
            raise ServerDown(f"no cache server answers at {base_url}") from None
        except Unreachable as exc:
            raise KvpError(f"DELETE /cache/objects ({tier}): {exc}") from None
        doc = r.object()
        if r.status != 200 or doc.get("ok") is not True:
            detail = doc.get("detail") or doc.get("error") or r.text()
            raise KvpError(f"DELETE /cache/objects ({tier}) answered {r.status}: "
                           f"{str(detail)[:300]}")
        counts = [doc.get("deleted", 0), doc.get("skipped", 0)]
        if not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= len(keys)
                   for n in counts):
            raise KvpError(f"DELETE /cache/objects ({tier}) answered counts that are not "
                           f"whole numbers from 0 to {len(keys)}: {str(counts)[:200]}")
        deleted += counts[0]
        skipped += counts[1]
    return Deleted(deleted, skipped)


def delete_from_l1(base_url: str, keys: Sequence[dict[str, Any]], *, attempts: int = 4,
                   wait_s: float = 1.0) -> Deleted:
    """Drop ``keys`` from L1; while some are locked by requests in flight, send them again
    (all of them: a key already gone is a no-op) up to ``attempts`` times, ``wait_s`` apart.
    A lock lasts as long as the request's lookup and load (a lookup never followed by a
    load, or its lock release, holds it until LMCache's read-lock TTL). Returns the keys
    removed and those still locked at the end. Raises as :func:`delete_objects`."""
    deleted = 0
    res = Deleted(0, 0)
    for i in range(max(1, attempts)):
        if i:
            time.sleep(wait_s)
        res = delete_objects(base_url, keys, tier="l1")
        deleted += res.deleted
        if not res.skipped:
            break
    return Deleted(deleted, res.skipped)
