"""The weights fingerprint's pure logic: which files count, combining, records, comparing,
the cache-hit decision and the refusal's wording (kvpersist/config/fingerprint.py)."""

from __future__ import annotations

import hashlib
import json

import pytest

from kvpersist.config import fingerprint as fp
from kvpersist.config.fingerprint import (
    CacheEntry,
    Comparison,
    FileDigest,
    StatKey,
    WeightsRecord,
    cache_id,
    combine,
    compare,
    decide,
    entries_to_keep,
    make_record,
    refusal,
)

A, B, C = "a" * 64, "b" * 64, "c" * 64
KEY = StatKey(dev=1, ino=2, size=3, mtime_ns=4, ctime_ns=5)


@pytest.mark.parametrize("name", [
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "model.safetensors.index.json", "chat_template.json",
    "chat_template.jinja", "tokenizer.model", "merges.txt", "vocab.txt", "qwen.tiktoken",
    "model-00001-of-00004.safetensors", "pytorch_model.bin", "consolidated.pth", "weights.pt",
    "model-q4.gguf", "modeling_custom.py", "params.json",
])
def test_files_vllm_loads_count(name: str) -> None:
    assert fp.counts(name)


@pytest.mark.parametrize("name", [
    "", ".gitattributes", ".cache", ".hidden.json", "README.md", "LICENSE", "image.png",
    "model.safetensors.part", "notes.md", "flax_model.msgpack", "tf_model.h5",
])
def test_other_files_do_not_count(name: str) -> None:
    assert not fp.counts(name)


def test_combine_is_the_sha256_of_a_documented_canonical_json() -> None:
    files = [FileDigest("model.safetensors", 10, B), FileDigest("config.json", 2, A)]
    text = ('{"files":[["config.json",2,"' + A + '"],["model.safetensors",10,"' + B + '"]],'
            '"scheme":"kvpersist.weights/1"}')
    assert combine(files) == hashlib.sha256(text.encode()).hexdigest()
    assert combine(reversed(files)) == combine(files)  # order does not matter


@pytest.mark.parametrize("other", [
    [FileDigest("config.json", 2, C), FileDigest("model.safetensors", 10, B)],  # content
    [FileDigest("config.json", 3, A), FileDigest("model.safetensors", 10, B)],  # size
    [FileDigest("conf.json", 2, A), FileDigest("model.safetensors", 10, B)],  # name
    [FileDigest("model.safetensors", 10, B)],  # a file less
    [FileDigest("config.json", 2, A), FileDigest("model.safetensors", 10, B),
     FileDigest("extra.py", 1, C)],  # a file more
])
def test_any_difference_changes_the_fingerprint(other: list[FileDigest]) -> None:
    base = [FileDigest("config.json", 2, A), FileDigest("model.safetensors", 10, B)]
    assert combine(other) != combine(base)


def test_combine_refuses_a_name_twice_and_takes_odd_names() -> None:
    with pytest.raises(ValueError, match="twice"):
        combine([FileDigest("a.json", 1, A), FileDigest("a.json", 1, A)])
    odd = "caf\udce9\n.json"  # not UTF-8 on disk, with a newline
    assert len(combine([FileDigest(odd, 1, A)])) == 64


def test_record_round_trip_and_tampering() -> None:
    rec = make_record([FileDigest("model.safetensors", 10, B), FileDigest("config.json", 2, A)],
                      "/m", recorded_at="2026-01-01T00:00:00Z", recorded_by="kvpersist x")
    data = json.loads(json.dumps(rec.to_dict()))
    assert data["bytes"] == 12 and data["scheme"] == fp.SCHEME
    assert WeightsRecord.from_dict(data) == rec
    edited = json.loads(json.dumps(data))
    edited["files"]["config.json"]["sha256"] = C
    with pytest.raises(ValueError, match="does not match its files"):
        WeightsRecord.from_dict(edited)
    with pytest.raises(ValueError, match="newer kvpersist"):
        WeightsRecord.from_dict({**data, "scheme": "kvpersist.weights/2"})
    for bad in (None, [], {"scheme": fp.SCHEME}, {**data, "files": {"x": {"size": "1"}}}):
        with pytest.raises(ValueError):
            WeightsRecord.from_dict(bad)
    assert fp.record_from_manifest({"schema": "kvpersist.manifest/1"}) is None
    assert fp.record_from_manifest({"weights": data}) == rec


def test_compare_first_same_changed() -> None:
    old = make_record([FileDigest("config.json", 2, A), FileDigest("model.safetensors", 10, B),
                       FileDigest("gone.py", 1, C)], "/m")
    assert compare(None, old).verdict == "first"
    same = make_record(list(old.files), "/elsewhere")  # same bytes elsewhere: the same
    assert compare(old, same).verdict == "same"
    new = make_record([FileDigest("config.json", 2, A), FileDigest("model.safetensors", 10, C),
                       FileDigest("new.json", 1, C)], "/m")
    cmp = compare(old, new)
    assert (cmp.verdict, cmp.changed, cmp.added, cmp.removed) == (
        "changed", ("model.safetensors",), ("new.json",), ("gone.py",))
    assert cmp.to_dict()["changed"] == ["model.safetensors"]


def test_refusal_names_the_namespace_the_files_and_the_fix() -> None:
    old = make_record([FileDigest(f"m-{i}.safetensors", 1, A) for i in range(7)], "/m",
                      recorded_at="2026-01-01T00:00:00Z")
    new = make_record([FileDigest(f"m-{i}.safetensors", 1, B) for i in range(7)], "/m")
    p = refusal("kvp-" + "0" * 32, "/m", compare(old, new), new)
    text = str(p)
    assert p.where == "KVP_MODEL_PATH"
    assert f"changed since kvp-{'0' * 32} was first served on 2026-01-01T00:00:00Z" in text
    assert "the weights at KVP_MODEL_PATH (/m)" in text
    assert "changed: m-0.safetensors, m-1.safetensors, m-2.safetensors, m-3.safetensors " \
           "and 3 more" in text
    assert f"fingerprint {old.short} -> {new.short}" in text
    assert p.fix == "bump KVP_MODEL_REVISION, or restore them"
    bare = refusal("kvp-x", "/m", Comparison("changed", added=("a.json",)), new)
    assert "(added: a.json)" in str(bare)


# --------------------------------------------------------------------------- cache decision
def _entry(key: StatKey = KEY, named: str = "", source: str = "read") -> CacheEntry:
    return CacheEntry(key, A, source, named)


OTHER = StatKey(1, 2, 3, 4, 6)  # ctime moved


@pytest.mark.parametrize("key,cached,named,want", [
    (KEY, _entry(), "", ("cache", A)),                   # same stat: the cached digest
    (KEY, _entry(named=B), B, ("cache", A)),             # cache wins over names
    (OTHER, _entry(), "", ("read", "")),                 # stat changed, no name: read
    (OTHER, _entry(named=B), B, ("read", "")),           # same name, file changed: read
    (OTHER, _entry(named=B), C, ("named", C)),           # a new download, a new name
    (KEY, None, B, ("named", B)),                        # first sight of a named file
    (KEY, None, "", ("read", "")),                       # first sight, no name
])
def test_cache_hit_decision(key: StatKey, cached: CacheEntry | None, named: str,
                            want: tuple[str, str]) -> None:
    d = decide(key, cached, named, "hub-blob")
    assert (d.how, d.sha256) == want


def test_a_new_inode_where_the_cache_knew_another_is_read_whatever_its_name() -> None:
    """A file replaced by rename (a copy changed, its mtime restored, renamed over the blob or
    the ``--local-dir`` file): the name still says the old digest, the inode is new."""
    assert decide(KEY, None, B, "hub-blob", replaced=True).how == "read"
    assert decide(KEY, None, B, "hf-metadata", replaced=True).how == "read"
    assert decide(KEY, None, "", replaced=True).how == "read"
    assert decide(KEY, _entry(), B, "hub-blob", replaced=True).how == "cache"  # same inode


def test_rehash_ignores_cache_and_names() -> None:
    assert decide(KEY, _entry(), B, "hub-blob", rehash=True).how == "read"


def test_every_stat_field_is_part_of_the_key() -> None:
    for i in range(5):
        values = KEY.to_list()
        values[i] += 1
        assert decide(StatKey.from_list(values), _entry()).how == "read"


def test_cache_entry_and_stat_key_parsing() -> None:
    e = CacheEntry(KEY, A, "hub-blob", A)
    assert CacheEntry.from_dict(json.loads(json.dumps(e.to_dict()))) == e
    for bad in ([1, 2, 3], [1, 2, 3, 4, "5"], None, [1, 2, 3, 4, True]):
        with pytest.raises(ValueError):
            StatKey.from_list(bad)
    for bad in ({**e.to_dict(), "sha256": "x"}, {**e.to_dict(), "source": "cache"},
                {**e.to_dict(), "named": "abc"}, "x"):
        with pytest.raises(ValueError):
            CacheEntry.from_dict(bad)


def test_cache_entries_kept() -> None:
    now = 10**9
    k = {n: StatKey(1, n, 10, 20, 30) for n in range(1, 10)}
    entries = {cache_id(k[1]): ("/m/a", now, k[1]),              # used now
               cache_id(k[2]): ("/gone", now - 86400, k[2]),     # moved aside a day ago
               cache_id(k[8]): ("/gone2", now - 40 * 86400, k[8]),  # gone for 40 days
               cache_id(k[3]): ("/m/b", now, k[3]),              # same inode, changed since
               cache_id(k[4]): ("/m/a", now - 10, k[4]),         # replaced at /m/a
               cache_id(k[5]): ("/m/a", now - 20, k[5]),
               cache_id(k[6]): ("/m/a", now - 30, k[6]),         # the third one: dropped
               cache_id(k[7]): ("/n/c", 50, k[7])}               # another model's, unchanged
    now_at = {"/gone": None, "/gone2": None, "/m/b": StatKey(1, 3, 11, 20, 31),
              "/m/a": k[1], "/n/c": k[7]}
    keep = entries_to_keep(entries, {cache_id(k[1])}, now_at, now)
    assert keep == {cache_id(k[n]) for n in (1, 2, 4, 5, 7)}


def test_cache_entries_capped_most_recent_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fp, "MAX_ENTRIES", 3)
    k = {n: StatKey(1, n, 10, 20, 30) for n in range(1, 6)}
    entries = {cache_id(k[n]): (f"/p{n}", 100 + n, k[n]) for n in k}
    keep = entries_to_keep(entries, {cache_id(k[1])}, {f"/p{n}": k[n] for n in k}, 200)
    assert keep == {cache_id(k[n]) for n in (1, 5, 4)}
