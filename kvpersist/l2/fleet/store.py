"""The fleet records on the shared tier's store (I/O; the rules are in
:mod:`kvpersist.l2.fleet.records`): write and delete one host's record and its namespace's index
entry, read a namespace's records through its index, or by a scan when the index is not
kvpersist's.

The index is untrusted like every key: it is read by one script (``EVAL``) that asks its
size first (``SCARD``) and sends its members only when there are at most
:data:`~kvpersist.l2.fleet.records.MAX_INDEX_MEMBERS` of them, each no longer than a host id
(:data:`~kvpersist.l2.fleet.records.MAX_HOST_ID_BYTES`); a key of another type, or a larger set, is
foreign: never fetched, never changed (a write then leaves it as it is and says so). Records
are read by :func:`~kvpersist.l2.shared.store.read_values` (bounded the same way).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpersist.l2.fleet.records import (
    MAX_HOST_ID_BYTES,
    MAX_INDEX_MEMBERS,
    Stored,
    index_key,
    parse_record_key,
    record_key,
)
from kvpersist.l2.fleet.records import match_pattern as records_pattern
from kvpersist.l2.shared.store import (
    READ_BATCH,
    ForeignKey,
    SharedStore,
    array,
    decode_key,
    is_wrong_type,
    raw_key,
    read_values,
    replies,
    unexpected,
)

#: read a set of at most ARGV[1] members, each at most ARGV[2] bytes: {0, longer, members...}
#: (``longer``: members left out for their length, never sent); {-2, count} for a larger set
#: (none sent), {-1} for a key of another type. SCARD first where the ACL grants it (one
#: that does not, as recommended by kvpersist 0.2.0, has the script count SMEMBERS' answer
#: inside the store instead: bounded all the same, one ACL LOG entry per read)
_SET_BOUNDED = ("local n = redis.pcall('scard', KEYS[1]) "
                "if type(n) == 'table' then "
                "if string.find(n.err, 'WRONGTYPE', 1, true) == 1 then return {-1} end "
                "n = nil end "
                "if n and n > tonumber(ARGV[1]) then return {-2, n} end "
                "local m = redis.pcall('smembers', KEYS[1]) "
                "if m.err then "
                "if string.find(m.err, 'WRONGTYPE', 1, true) == 1 then return {-1} end "
                "return m end "
                "if #m > tonumber(ARGV[1]) then return {-2, #m} end "
                "local out = {0, 0} "
                "for _, v in ipairs(m) do "
                "if #v > tonumber(ARGV[2]) then out[2] = out[2] + 1 "
                "else out[#out + 1] = v end end "
                "return out")


def write_record(store: SharedStore, ns: str, host: str, value: str, ttl_s: int) -> int:
    """Write (or refresh) one host's record of ``ns`` with its TTL and add the host to the
    namespace's index (whose TTL restarts, once the index took the host: it outlives every
    record it names); then drop the index members whose records lapsed and those that are
    no host ids. Returns how many were dropped. Raises ForeignKey when the index's key is
    not kvpersist's (another type, or a set too large to be an index): the record is
    written, the foreign key is left as it is (its members and its TTL too)."""
    idx = index_key(ns)
    found = read_index(store, ns, with_values=False)
    if found.members is None:
        store.client.set(record_key(ns, host), value, ex=ttl_s)
        raise ForeignKey(_not_indexed(ns, host, found.problem))
    pipe = store.client.pipeline(transaction=False)
    pipe.set(record_key(ns, host), value, ex=ttl_s)
    pipe.sadd(idx, host)
    if is_wrong_type(replies(pipe)[1]):  # replaced meanwhile
        raise ForeignKey(_not_indexed(ns, host, "holds another type than a set"))
    store.client.expire(idx, ttl_s)
    others = [m for m, _ in found.members if m != host]
    gone = [m for m, there in zip(others, _exist(store, [record_key(ns, m) for m in others]),
                                  strict=True) if not there]
    drop = [*gone, *found.strangers]
    if drop:
        store.client.srem(idx, *(raw_key(m) for m in drop))
    return len(drop)


def _not_indexed(ns: str, host: str, why: str) -> str:
    return (f"{index_key(ns)} {why} (not kvpersist's index of {ns}): the record "
            f"{record_key(ns, host)} is written but not indexed (other hosts find it by a "
            "scan); delete that key and the next write indexes the record")


def _exist(store: SharedStore, keys: list[str]) -> list[bool]:
    """Does each of ``keys`` exist (pipelined ``EXISTS``, no value fetched)?"""
    out: list[bool] = []
    for i in range(0, len(keys), READ_BATCH):
        pipe = store.client.pipeline(transaction=False)
        for k in keys[i:i + READ_BATCH]:
            pipe.exists(raw_key(k))
        out += [bool(r) for r in replies(pipe)]
    return out


def delete_record(store: SharedStore, ns: str, host: str) -> bool:
    """Delete one host's record of ``ns`` and its index entry (an index of another type is
    left as it is); True if the record existed."""
    pipe = store.client.pipeline(transaction=False)
    pipe.delete(record_key(ns, host))
    pipe.srem(index_key(ns), host)
    return bool(replies(pipe)[0])


@dataclass(frozen=True)
class IndexRead:
    """A namespace's index as read.

    ``members``: (host id, record value) of each member that is a host id; None when the
    index's key is not kvpersist's index (``problem`` says why: another type, too many
    members). ``strangers``: the members read that are no host ids (not read further);
    ``problem`` also counts them and those left unread for their length."""

    members: list[tuple[str, Stored]] | None
    problem: str = ""
    strangers: tuple[str, ...] = ()


def read_index(store: SharedStore, ns: str, *, with_values: bool = True) -> IndexRead:
    """The members of ``ns``'s index (one bounded script: at most
    :data:`~kvpersist.l2.fleet.records.MAX_INDEX_MEMBERS` members, each at most
    :data:`~kvpersist.l2.fleet.records.MAX_HOST_ID_BYTES`, or none at all) and, ``with_values``,
    their records (:func:`~kvpersist.l2.shared.store.read_values`: a record that lapsed has
    the value None). No scan. Raises what the store raises."""
    reply = store.client.eval(_SET_BOUNDED, 1, raw_key(index_key(ns)), MAX_INDEX_MEMBERS,
                              MAX_HOST_ID_BYTES)
    status = array(reply, "a script", ints=1)[0]
    if status == -1:
        return IndexRead(None, "holds another type than a set")
    reply = array(reply, "a script", ints=2)
    if status == -2:
        return IndexRead(None, f"is a set of {reply[1]:,} members, more than the "
                         f"{MAX_INDEX_MEMBERS:,} hosts an index may name")
    if status != 0 or len(reply) > 2 + MAX_INDEX_MEMBERS or not all(
            isinstance(m, bytes) for m in reply[2:]):
        raise unexpected("a script", reply)
    read = sorted(decode_key(m) for m in reply[2:])
    members = [m for m in read if parse_record_key(record_key(ns, m)) is not None]
    strangers = tuple(m for m in read if parse_record_key(record_key(ns, m)) is None)
    left_out = reply[1] + len(strangers)
    problem = (f"has {left_out:,} member(s) that are not host ids (skipped as foreign; the "
               "next write of a record removes those no longer than a host id)"
               if left_out else "")
    if not with_values:
        return IndexRead([(m, None) for m in members], problem, strangers)
    values = read_values(store, [record_key(ns, m) for m in members])
    return IndexRead([(m, v) for m, (_, v) in zip(members, values, strict=True)], problem,
                     strangers)


def scan_record_keys(store: SharedStore, ns: str) -> list[str]:
    """Every record key of ``ns`` found by a SCAN of every node: what readers fall back on
    when the index is not kvpersist's (slow on a large store)."""
    return [k for _, page in store.scan(records_pattern(ns)) for k in page
            if (parse_record_key(k) or ("", ""))[0] == ns]
