"""File-name layout of LMCache's nixl_store_dynamic L2 files (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpersist.l2.layout import (
    ChunkName,
    Kind,
    KvRank,
    classify,
    is_namespace,
    is_pinned_namespace,
    is_shard_dir_name,
    manifest_relpath,
    namespace_of_prefix,
    parse_chunk_name,
    parse_temp_name,
    prefix_for_model_name,
    temp_name,
)

NS = "kvp-" + "0123456789abcdef" * 2
UNPINNED = "kvp-unpinned-" + "f" * 32
HASH = "9a" * 16


def test_flat_name_of_a_pinned_namespace() -> None:
    c = parse_chunk_name(f"{NS}_01000100_0_{HASH}.bin")
    assert c == ChunkName(NS, 0x01000100, 0, HASH, None)
    assert c.namespace == NS
    assert c.rank == KvRank(world_size=1, global_rank=0, local_world_size=1, local_rank=0)


def test_tp4_rank3_and_group_hex() -> None:
    c = parse_chunk_name(f"{NS}_04030403_1f_{HASH}.bin")
    assert c is not None
    assert c.rank == KvRank(4, 3, 4, 3)
    assert c.group == 0x1F


def test_salt_is_parsed_and_round_trips() -> None:
    name = f"{UNPINNED}_02010201_0_{HASH}@user-42.bin"
    c = parse_chunk_name(name)
    assert c is not None and c.salt == "user-42" and c.prefix == UNPINNED
    assert c.filename() == name


def test_salt_with_underscores_falls_back_to_full_parse() -> None:
    name = f"{NS}_01000100_0_{HASH}@a_b_c.bin"
    c = parse_chunk_name(name)
    assert c is not None
    assert (c.prefix, c.salt, c.chunk_hash) == (NS, "a_b_c", HASH)


@pytest.mark.parametrize("salt", [
    "line\nbreak", "\x1b[2Jwipe", "tab\there", "a_01000100_0_ff", " ", "\u202eevil", "\x7f",
    "é" * 100, "x" * 128, "\r", "a.tmp.b",
])
def test_a_chunk_belongs_to_its_prefix_whatever_text_its_salt_holds(salt: str) -> None:
    """vLLM accepts any text in cache_salt, LMCache refuses only @ / \\ NUL and more than
    128 characters and appends it as it is: such a chunk is its prefix's, a namespace or
    any other model name (issue 40: a newline made another model's chunk foreign)."""
    for prefix in (NS, UNPINNED, "test-model", "my_model_v2"):
        name = f"{prefix}_01000100_0_{HASH}@{salt}.bin"
        c = parse_chunk_name(name)
        assert c is not None and (c.prefix, c.salt, c.chunk_hash) == (prefix, salt, HASH)
        assert c.filename() == name
        assert classify(name) == (Kind.CHUNK, c)
        assert classify(f"{name}.tmp.{'0f' * 16}") == (Kind.TEMP, c)
        shard = (HASH[0:2], HASH[2:4])
        assert classify(name, shard) == (Kind.CHUNK, c)


@pytest.mark.parametrize("salt", [
    "\udcff\udcfe", "s\udcff", "\udced\udca0\udc80",  # bytes that are not UTF-8
    "x@y", "\\back", "a/b", "n\x00ul", "x" * 129, "",
])
def test_a_salt_lmcache_cannot_have_written_makes_the_name_foreign(salt: str) -> None:
    """Issue 40: a salt of bytes that are not UTF-8 (vLLM cannot have sent it, so LMCache did
    not write it) was called foreign by report and deleted by prune. Every command now
    decides with this one parser: foreign, never touched."""
    for prefix in (NS, UNPINNED, "test-model"):
        name = f"{prefix}_01000100_0_{HASH}@{salt}.bin"
        assert parse_chunk_name(name) is None, name
        assert classify(name)[0] is Kind.FOREIGN
        assert classify(f"{name}.tmp.{'0f' * 16}")[0] is Kind.FOREIGN


@pytest.mark.parametrize("name", [
    f"{NS}_01000100_0_{HASH}@.bin",                  # empty salt
    f"{NS}_01000100_0_{HASH}\n@s.bin",               # the newline is before the salt
    f"{NS}\n_01000100_0_{HASH}@s.bin",
    f"{NS}_01000100_0_{HASH.upper()}@s\n.bin",
    f"{NS}_01000100_0_abc@s.bin",                   # an odd number of hash digits
    f"{NS}_01000100_00_{HASH}.bin",                 # a group LMCache writes as "0"
    f"{NS}_01000100_01_{HASH}.bin",
    f"{NS}_01000100_0_{HASH}.bin.tmp.{'0f' * 15}",  # a token shorter than uuid4().hex
    f"{NS}_01000100_0_{HASH}.bin.tmp.{'0F' * 16}",
    f"x@y_01000100_0_{HASH}.bin",                   # "@" in a model name: LMCache refuses it
])
def test_only_what_lmcache_writes_parses(name: str) -> None:
    assert parse_chunk_name(name) is None and classify(name)[0] is Kind.FOREIGN


@pytest.mark.parametrize("prefix", ["test-model", "--a--b", "my_model_v2", "org--m_1_2",
                                    "kvp-short"])
def test_prefixes_that_are_not_namespaces_still_parse(prefix: str) -> None:
    c = parse_chunk_name(f"{prefix}_01000100_0_{HASH}.bin")
    assert c is not None and c.prefix == prefix
    assert c.namespace is None


def test_prefix_with_underscores_parses_from_the_right() -> None:
    name = f"a_01000100_0_ff_01000100_2_{HASH}.bin"
    c = parse_chunk_name(name)
    assert c is not None
    assert c.prefix == "a_01000100_0_ff" and c.group == 2


@pytest.mark.parametrize("name", [
    f"{NS}_01000100_0_{HASH}",              # no .bin
    f"{NS}_01000100_0_{HASH}.BIN",
    f"{NS}_0100010_0_{HASH}.bin",            # 7-digit rank
    f"{NS}_010001000_0_{HASH}.bin",          # 9-digit rank
    f"{NS}_01000100_0_{HASH.upper()}.bin",   # upper-case hash
    f"{NS}_01000100__{HASH}.bin",            # empty group
    f"{NS}_01000100_0_.bin",                 # empty hash
    f"{NS}_01000100_0_{HASH}@.bin",          # empty salt
    f"{NS}_01000100_g_{HASH}.bin",           # non-hex group
    f"_01000100_0_{HASH}.bin",               # empty prefix
    f"{NS}_01000100_0_{HASH}.bin.bak",
    "README", ".bin", "notes.txt", "_.bin", "a_b_c_d.bin",
])
def test_malformed_names_are_foreign(name: str) -> None:
    assert parse_chunk_name(name) is None
    assert classify(name)[0] is Kind.FOREIGN


def test_temp_names() -> None:
    final = f"{NS}_01000100_0_{HASH}.bin"
    token = "0f" * 16
    t = f"{final}.tmp.{token}"
    c = parse_temp_name(t)
    assert c is not None and c.filename() == final
    assert temp_name(c, token) == t
    assert classify(t) == (Kind.TEMP, c)
    assert parse_temp_name(f"{final}.tmp.") is None
    assert parse_temp_name(f"{final}.tmp.xyz") is None
    assert classify(f"README.tmp.{token}")[0] is Kind.FOREIGN
    assert parse_chunk_name(t) is None


def test_shard_dirs_follow_lmcache() -> None:
    c = ChunkName(NS, 0x01000100, 0, "abcdef0123", "s")
    assert c.relpath(shard_dirs=True) == f"ab/cd/{c.filename()}"
    assert c.relpath() == c.filename()
    assert classify(c.filename(), ("ab", "cd")) == (Kind.CHUNK, c)
    # a chunk in the wrong shard directory is never LMCache's: foreign
    assert classify(c.filename(), ("ab", "ce"))[0] is Kind.FOREIGN
    assert classify(temp_name(c, "aa" * 16), ("ab", "cd"))[0] is Kind.TEMP
    assert classify(temp_name(c, "aa" * 16), ("00", "cd"))[0] is Kind.FOREIGN
    assert is_shard_dir_name("0f") and not is_shard_dir_name("0F")
    assert not is_shard_dir_name("abc")


def test_lmcache_own_name_functions_agree() -> None:
    """Cross-check against the adapter's own functions (lmcache is importable in tests)."""
    import importlib

    agent = importlib.import_module(
        "lmcache.v1.distributed.l2_adapters.nixl_store_agents.dynamic_nixl_store_agent")
    from lmcache.v1.distributed.api import ObjectKey

    key = ObjectKey(chunk_hash=bytes.fromhex(HASH), model_name="org/m_x", kv_rank=0x02010201,
                    object_group_id=3, cache_salt="s1")
    name = agent._object_key_to_filename(key)
    c = parse_chunk_name(name)
    assert c == ChunkName(prefix_for_model_name("org/m_x"), 0x02010201, 3, HASH, "s1")
    assert c.relpath(shard_dirs=True) == agent._object_key_to_relpath(key)


def test_namespaces() -> None:
    assert is_namespace(NS) and is_pinned_namespace(NS)
    assert is_namespace(UNPINNED) and not is_pinned_namespace(UNPINNED)
    assert not is_namespace("kvp-" + "A" * 32)
    assert not is_namespace(NS + "0")
    assert namespace_of_prefix("test-model") is None
    assert prefix_for_model_name("/a/b") == "--a--b"
    assert manifest_relpath(NS) == f".kvpersist/manifests/{NS}.json"


def test_kv_rank_rejects_out_of_range() -> None:
    with pytest.raises(ValueError):
        KvRank.decode(1 << 32)
    with pytest.raises(ValueError):
        KvRank(256, 0, 1, 0).encode()


_prefix = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_.", min_size=1, max_size=40)
_salt = st.one_of(st.none(), st.text(alphabet="abcxyz0123456789-.", min_size=1, max_size=12))


@given(prefix=_prefix, world=st.integers(1, 255), rank=st.integers(0, 255),
       group=st.integers(0, 2**20), digest=st.binary(min_size=2, max_size=32), salt=_salt)
def test_format_then_parse_round_trips(prefix: str, world: int, rank: int, group: int,
                                       digest: bytes, salt: str | None) -> None:
    kv = KvRank(world, rank, world, rank).encode()
    c = ChunkName(prefix, kv, group, digest.hex(), salt)
    parsed = parse_chunk_name(c.filename())
    assert parsed is not None
    # A prefix that itself ends like "_<8hex>_<hex>_<hex>" is ambiguous; the right-most
    # parse still yields the same file name.
    assert parsed.filename() == c.filename()
    if "_" not in prefix:
        assert parsed == c
    assert KvRank.decode(kv) == KvRank(world, rank, world, rank)


#: any text LMCache's ObjectKey takes as a salt (surrogates: bytes that are not UTF-8, which
#: no request carries, are left to the test above)
_lmcache_salt = st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="@/\\\0"),
                        min_size=1, max_size=128)


@given(model=st.text(st.characters(blacklist_categories=["Cs", "Cc", "Cf", "Zl", "Zp"],
                                   blacklist_characters="@/\\"), min_size=1, max_size=40)
       .filter(str.isprintable),
       digest=st.sampled_from([8, 16, 32]).flatmap(lambda n: st.binary(min_size=n, max_size=n)),
       group=st.integers(0, 2**16), salt=st.one_of(st.just(""), _lmcache_salt))
def test_every_name_lmcache_writes_parses_back_to_its_key(model: str, digest: bytes, group: int,
                                                         salt: str) -> None:
    """LMCache's own ``_object_key_to_filename`` of any key its ``ObjectKey`` accepts (hashes
    of 8, 16 and 32 bytes: the builtin hash, xxhash, blake3 and sha256) parses back to the
    same prefix, rank, group, hash and salt."""
    import importlib

    agent = importlib.import_module(
        "lmcache.v1.distributed.l2_adapters.nixl_store_agents.dynamic_nixl_store_agent")
    from lmcache.v1.distributed.api import ObjectKey

    key = ObjectKey(chunk_hash=digest, model_name=model, kv_rank=0x04020401,
                    object_group_id=group, cache_salt=salt)
    c = parse_chunk_name(agent._object_key_to_filename(key))
    assert c == ChunkName(prefix_for_model_name(model), 0x04020401, group, digest.hex(),
                          salt or None)


@given(st.text(max_size=60))
def test_parse_never_raises(name: str) -> None:
    kind, chunk = classify(name)
    assert (chunk is None) == (kind is Kind.FOREIGN)
