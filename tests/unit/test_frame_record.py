"""The frame record's rule and format (pure): a frame recorded under another chunk's name is
found (a rename over, a rename to a new name, a swap, a copy, a restore of another chunk's
old frame), a chunk LMCache stores again (a fresh IV) or an older frame of the same chunk is
learned, never flagged; the record file is refused unless it is exactly what the encoder
writes (issue 38, item 4)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpersist.l2.layout import ChunkName, parse_chunk_name
from kvpersist.l2.verify import frame_record as fr
from kvpersist.l2.verify.frame_record import FrameRecord, Verdict, decode, encode, judge

NS = "kvp-" + "5e" * 16


def name(i: int, salt: str | None = None) -> str:
    return ChunkName(NS, 0x01000100, 0, f"{i:08x}" + "c3" * 28, salt).filename()


A, B, C = name(1), name(2), name(3)


def iv() -> bytes:
    return os.urandom(12)


def recorded(**files: bytes) -> FrameRecord:
    """A record that saw ``files`` (name -> identity) in a complete listing."""
    rec = FrameRecord(NS)
    check(rec, files)
    return rec


def check(rec: FrameRecord, now: dict[str, bytes],
          present: set[str] | None = None) -> dict[str, Verdict]:
    """Judge ``now`` (every file read, the listing complete unless ``present``) and learn."""
    judged = judge(rec, now, set(now) if present is None else present)
    rec.learn(judged, now, {n: (i + 1, 7) for i, n in enumerate(now)})
    return judged.verdicts


def test_the_identity_is_the_iv_after_the_version_byte() -> None:
    header = bytes([1]) + bytes(range(12)) + b"rest"
    assert fr.identity_of(header) == bytes(range(12))
    assert fr.identity_of(bytes([2]) + bytes(12)) is None  # another frame version
    assert fr.identity_of(bytes([1]) + bytes(11)) is None  # too short
    assert fr.identity_of(b"") is None


def test_first_sight_learns_every_frame() -> None:
    rec = FrameRecord(NS)
    a, b = iv(), iv()
    assert check(rec, {A: a, B: b}) == {A: Verdict.NEW, B: Verdict.NEW}
    assert rec.owner(a) == A and rec.owner(b) == B and rec.changed
    assert check(rec, {A: a, B: b}) == {A: Verdict.UNCHANGED, B: Verdict.UNCHANGED}


def test_a_rename_over_another_chunk_is_moved_and_the_source_is_gone() -> None:
    a, b = iv(), iv()
    rec = recorded(**{A: a, B: b})
    judged = judge(rec, {B: a}, {B})  # mv A B
    assert judged.verdicts == {B: Verdict.MOVED} and judged.gone == (A,)
    assert f"recorded under {A}" in judged.details[B] and "is gone" in judged.details[B]
    rec.learn(judged, {B: a}, {})
    # a finding is not learned: B keeps its frame, so the next check finds it again
    assert rec.live[B].identity == b and rec.owner(a) == A
    assert judge(rec, {B: a}, {B}).verdicts == {B: Verdict.MOVED}


def test_a_rename_to_a_name_never_recorded_is_moved() -> None:
    a = iv()
    rec = recorded(**{A: a})
    judged = judge(rec, {C: a}, {C})  # mv A C: C was never seen
    assert judged.verdicts == {C: Verdict.MOVED} and judged.gone == (A,)


def test_a_swap_of_two_files_is_two_moved() -> None:
    a, b = iv(), iv()
    rec = recorded(**{A: a, B: b})
    judged = judge(rec, {A: b, B: a}, {A, B})
    assert judged.verdicts == {A: Verdict.MOVED, B: Verdict.MOVED} and judged.gone == ()
    assert "holds another frame now" in judged.details[A]


def test_a_copy_over_another_chunk_is_moved_the_original_stays() -> None:
    """cp A B after both were recorded: A is not read (its file did not change), B is."""
    a, b = iv(), iv()
    rec = recorded(**{A: a, B: b})
    judged = judge(rec, {B: a}, {A, B})
    assert judged.verdicts == {B: Verdict.MOVED}
    assert "holds it too" in judged.details[B]


def test_an_unknown_frame_under_two_names_is_dup() -> None:
    x = iv()
    judged = judge(FrameRecord(NS), {A: x, B: x}, {A, B})
    assert judged.verdicts == {A: Verdict.DUP, B: Verdict.DUP}
    assert set(judged.findings()) == {A, B}


def test_lmcache_storing_a_chunk_again_is_learned_never_flagged() -> None:
    """LMCache never writes into a published file: it stores a chunk afresh (a new IV drawn
    from os.urandom) once its file was removed (quarantine, prune, eviction), or over it
    (tmp + rename) when two stores race. Either way the name holds a frame never seen."""
    a1, a2, a3 = iv(), iv(), iv()
    rec = recorded(**{A: a1})
    assert check(rec, {}, set()) == {}  # A quarantined: gone
    assert A not in rec.live and rec.owner(a1) == A
    assert check(rec, {A: a2}) == {A: Verdict.NEW}  # stored afresh
    assert check(rec, {A: a3}) == {A: Verdict.REWRITTEN}  # replaced by a racing store
    assert rec.live[A].identity == a3 and rec.owner(a2) == A and rec.owner(a1) == A


def test_an_older_frame_of_the_same_chunk_is_restored_not_flagged() -> None:
    """Decided: a frame this very name held before (a restore of the chunk's own file from
    a backup) holds the same chunk's KV -- the name is the hash of the chunk's tokens in the
    namespace -- so it is learned back, never a finding."""
    a1, a2 = iv(), iv()
    rec = recorded(**{A: a1})
    check(rec, {A: a2})
    assert check(rec, {A: a1}) == {A: Verdict.RESTORED}
    assert rec.live[A].identity == a1 and rec.owner(a2) == A


def test_another_chunks_old_frame_restored_under_a_name_is_moved() -> None:
    """A restore from the wrong backup: B's file replaced by A's frame of before A was
    stored again."""
    a1, a2, b = iv(), iv(), iv()
    rec = recorded(**{A: a1, B: b})
    check(rec, {A: a2, B: b})
    judged = judge(rec, {B: a1}, {A, B})
    assert judged.verdicts == {B: Verdict.MOVED}
    assert "held before" in judged.details[B]


def test_a_partial_listing_retires_nothing() -> None:
    a, b = iv(), iv()
    rec = recorded(**{A: a, B: b})
    judged = judge(rec, {A: a}, None)
    assert judged.gone == () and judged.verdicts == {A: Verdict.UNCHANGED}


def test_known_is_the_same_inode_and_ctime() -> None:
    rec = FrameRecord(NS)
    a = iv()
    rec.learn(judge(rec, {A: a}, {A}), {A: a}, {A: (11, 22)})
    assert rec.known(A, 11, 22)
    assert not rec.known(A, 11, 23) and not rec.known(A, 12, 22) and not rec.known(B, 11, 22)
    # learned without a stat (scrub of a window, say): never "known", always read
    rec.learn(judge(rec, {B: iv()}, None), {B: rec.live[A].identity[::-1]}, {})
    assert not rec.known(B, 0, 0)
    # an unchanged name read without a stat keeps the stat it was recorded with
    rec.learn(judge(rec, {A: a}, None), {A: a}, {})
    assert rec.known(A, 11, 22)


def test_retired_frames_are_bounded_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fr, "RETIRED_MIN", 3)
    rec = FrameRecord(NS)
    ivs = [iv() for _ in range(6)]
    for i, x in enumerate(ivs):  # the same name stored afresh six times
        check(rec, {A: x}, {A})
        assert rec.live[A].identity == ivs[i]
    assert list(rec.retired) == ivs[2:5]  # three retired, the newest kept
    assert rec.owner(ivs[0]) is None and rec.owner(ivs[4]) == A


def test_a_full_record_learns_no_new_name(monkeypatch: pytest.MonkeyPatch) -> None:
    rec = FrameRecord(NS)
    check(rec, {A: iv()})
    monkeypatch.setattr(fr, "MAX_RECORD_BYTES", len(encode(rec)) + 10)
    check(rec, {A: rec.live[A].identity, B: iv()})
    assert B not in rec.live and rec.full == 1


# --------------------------------------------------------------------------- the format


def test_the_format_round_trips_names_salts_stats_and_history() -> None:
    rec = FrameRecord(NS)
    salted, tp = name(4, "tenant-7\u00e9\n"), ChunkName(NS, 0x02010201, 0x1f, "ab" * 4).filename()
    now = {A: iv(), B: iv(), salted: iv(), tp: iv()}
    rec.learn(judge(rec, now, set(now)), now, {A: (1, 2), B: (3, -4)})
    check(rec, {A: iv()}, set(now))
    data = encode(rec)
    back = decode(data, NS)
    assert back.live == rec.live and back.retired == rec.retired and not back.changed
    assert all(parse_chunk_name(n) is not None for n in [*back.live, *back.retired.values()])
    assert encode(back) == data


@given(st.lists(st.tuples(st.integers(0, 0xFFFFFFFF), st.integers(0, 0xFFFFFFFF),
                          st.binary(min_size=1, max_size=fr.MAX_HASH_BYTES),
                          st.one_of(st.none(), st.text(
                              st.characters(blacklist_characters="@/\\\x00",
                                            blacklist_categories=("Cs",)),
                              min_size=1, max_size=8))),
                max_size=20, unique_by=lambda t: (t[0], t[1], t[2], t[3])))
@settings(max_examples=60, deadline=None)
def test_any_chunk_names_round_trip(keys: list[tuple[int, int, bytes, str | None]]) -> None:
    rec = FrameRecord(NS)
    now = {ChunkName(NS, r, g, h.hex(), s).filename(): iv() for r, g, h, s in keys}
    rec.learn(judge(rec, now, set(now)), now, {n: (5, 6) for n in now})
    assert decode(encode(rec), NS).live == rec.live


@pytest.mark.parametrize(("damage", "why"), [
    (lambda d: b"NOTFRAME" + d[8:], "not a kvpersist frame record"),
    (lambda d: d[:8] + b"\x02\x00" + d[10:], "format version 2"),
    (lambda d: d[:-1] + bytes([d[-1] ^ 1]), "checksum"),
    (lambda d: d[:40] + d[41:], "checksum"),
    (lambda d: d[:10], "too short"),
    (lambda d: b"", "too short"),
])
def test_a_damaged_record_is_refused(damage: object, why: str) -> None:
    rec = recorded(**{A: iv(), B: iv()})
    with pytest.raises(ValueError, match=why):
        decode(damage(encode(rec)), NS)  # type: ignore[operator]


def _resealed(body: bytes) -> bytes:
    import hashlib

    return body + hashlib.blake2b(body, digest_size=16).digest()


def test_counts_the_bytes_cannot_hold_and_another_namespace_are_refused() -> None:
    data = encode(recorded(**{A: iv()}))
    body = bytearray(data[:-16])
    head = 8 + 2 + 1 + len(NS)
    body[head:head + 4] = (1 << 31).to_bytes(4, "little")  # 2 billion live entries
    with pytest.raises(ValueError, match="more entries than it holds"):
        decode(_resealed(bytes(body)), NS)
    with pytest.raises(ValueError, match="not of kvp-"):
        decode(data, "kvp-" + "00" * 16)


def test_an_entry_that_is_not_a_chunk_name_is_refused() -> None:
    rec = FrameRecord(NS)
    salted = name(9, "ok")
    rec.learn(judge(rec, {salted: iv()}, None), {salted: iv()}, {})
    data = encode(rec)
    body = bytearray(data[:-16])
    at = body.rindex(b"ok")
    body[at:at + 2] = b"@x"  # a salt LMCache refuses
    with pytest.raises(ValueError, match="not a chunk name"):
        decode(_resealed(bytes(body)), NS)
    body[at:at + 2] = b"\xff\xfe"  # not UTF-8
    with pytest.raises(ValueError, match="not a chunk name"):
        decode(_resealed(bytes(body)), NS)


def test_a_record_repeating_a_frame_is_refused() -> None:
    x = iv()
    rec = recorded(**{A: x, B: iv()})
    data = bytearray(encode(rec)[:-16])
    at = data.rindex(rec.live[B].identity)
    data[at:at + 12] = x
    with pytest.raises(ValueError, match="repeats"):
        decode(_resealed(bytes(data)), NS)


def test_bytes_per_chunk_of_lmcache_names() -> None:
    """What docs/benchmarks.md quotes: a live entry of a 32-byte chunk hash, no salt."""
    rec = FrameRecord(NS)
    now = {ChunkName(NS, 0x01000100, 0, os.urandom(32).hex()).filename(): iv()
           for _ in range(1000)}
    rec.learn(judge(rec, now, set(now)), now, {n: (1, 1) for n in now})
    per = (len(encode(rec)) - len(encode(FrameRecord(NS)))) / 1000
    assert per == fr._ENTRY.size + 32 == 71
