"""Identity, canonical JSON and namespace: golden values computed independently by jq."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpersist.config.identity import (
    IDENTITY_KEYS,
    CacheIdentity,
    identity_from_dict,
    identity_from_env,
    identity_problems,
    is_namespace,
    unpinned_namespace,
)
from kvpersist.errors import ConfigError

BASE = {
    "KVP_MODEL_ID": "meta-llama/Llama-3.1-8B-Instruct",
    "KVP_MODEL_REVISION": "0e9e39f249a16976918f6564b8830bc894c89659",
    "KVP_TOKENIZER_NAME": "meta-llama/Llama-3.1-8B-Instruct",
    "KVP_TOKENIZER_REVISION": "0e9e39f249a16976918f6564b8830bc894c89659",
    "KVP_KV_CACHE_DTYPE": "bfloat16",
    "KVP_BLOCK_SIZE": "16",
    "KVP_NUM_KV_HEADS": "8",
    "KVP_HEAD_DIM": "128",
    "KVP_TENSOR_PARALLEL_SIZE": "1",
    "KVP_CONNECTOR": "LMCacheMPConnector",
    "KVP_CONNECTOR_BUILD": "lmcache==0.5.6",
    "KVP_VLLM_BUILD": "vllm==0.32.0",
    "KVP_MAX_MODEL_LEN": "32768",
    "KVP_CHAT_TEMPLATE_SHA256": "a" * 64,
}


def jq_namespace(obj: dict[str, object]) -> str:
    """The namespace as an operator computes it by hand: jq -cjS . | sha256sum."""
    jq = shutil.which("jq")
    assert jq, "jq is required (the CI script installs it)"
    text = json.dumps(obj, indent=4)  # deliberately not canonical: jq must canonicalise
    out = subprocess.run([jq, "-cjS", "."], input=text.encode(), capture_output=True,
                         check=True).stdout
    return "kvp-" + hashlib.sha256(out).hexdigest()[:32]


def test_fields_are_exactly_the_fourteen_of_the_spec() -> None:
    assert list(IDENTITY_KEYS) == [
        "model_id", "model_revision", "tokenizer_name", "tokenizer_revision",
        "kv_cache_dtype", "block_size", "num_kv_heads", "head_dim", "tensor_parallel_size",
        "connector", "connector_build", "vllm_build", "max_model_len", "chat_template_sha256",
    ]


def test_canonical_json_is_byte_identical_to_jq() -> None:
    ident = identity_from_env(BASE)
    out = subprocess.run(["jq", "-cjS", "."], input=json.dumps(ident.as_dict()).encode(),
                         capture_output=True, check=True).stdout
    assert ident.canonical_json().encode("utf-8") == out
    # integers are JSON numbers, the rest strings
    assert '"block_size":16' in ident.canonical_json()
    assert '"tensor_parallel_size":1' in ident.canonical_json()


def test_golden_namespace_matches_jq_and_sha256sum() -> None:
    ident = identity_from_env(BASE)
    assert ident.namespace() == jq_namespace(ident.as_dict())
    assert is_namespace(ident.namespace())
    assert ident.lmcache_model_name() == ident.namespace()


def test_golden_namespace_literal() -> None:
    # A fixed value, so an accidental change of the canonical form breaks the build
    # (every deployed cache would silently become unreachable).
    assert identity_from_env(BASE).namespace() == "kvp-dbc063b8930b41129761c0dd292652b6"


def test_non_ascii_values_match_jq() -> None:
    env = dict(BASE, KVP_MODEL_ID="组织/模型-ü")
    ident = identity_from_env(env)
    assert ident.namespace() == jq_namespace(ident.as_dict())


def _mutations() -> dict[str, str]:
    return {
        "KVP_MODEL_ID": "meta-llama/Llama-3.1-8B",
        "KVP_MODEL_REVISION": "1" * 40,
        "KVP_TOKENIZER_NAME": "other/tokenizer",
        "KVP_TOKENIZER_REVISION": "2" * 40,
        "KVP_KV_CACHE_DTYPE": "fp8_e4m3",
        "KVP_BLOCK_SIZE": "32",
        "KVP_NUM_KV_HEADS": "4",
        "KVP_HEAD_DIM": "64",
        "KVP_TENSOR_PARALLEL_SIZE": "2",
        "KVP_CONNECTOR": "OtherConnector",
        "KVP_CONNECTOR_BUILD": "lmcache==0.5.7",
        "KVP_VLLM_BUILD": "vllm==0.33.0",
        "KVP_MAX_MODEL_LEN": "8192",
        "KVP_CHAT_TEMPLATE_SHA256": "b" * 64,
    }


@pytest.mark.parametrize("key", list(IDENTITY_KEYS.values()))
def test_changing_any_one_field_changes_the_namespace(key: str) -> None:
    base = identity_from_env(BASE).namespace()
    changed = identity_from_env(dict(BASE, **{key: _mutations()[key]})).namespace()
    assert changed != base


_hex = st.text("0123456789abcdef", min_size=40, max_size=40)


@settings(max_examples=200, deadline=None)
@given(field=st.sampled_from(list(IDENTITY_KEYS.values())), data=st.data())
def test_property_any_valid_change_changes_namespace(field: str, data: st.DataObject) -> None:
    original = BASE[field]
    if field in ("KVP_MODEL_REVISION", "KVP_TOKENIZER_REVISION"):
        new = data.draw(_hex)
    elif field == "KVP_CHAT_TEMPLATE_SHA256":
        new = data.draw(st.text("0123456789abcdef", min_size=64, max_size=64))
    elif field in ("KVP_BLOCK_SIZE", "KVP_NUM_KV_HEADS", "KVP_HEAD_DIM",
                   "KVP_TENSOR_PARALLEL_SIZE", "KVP_MAX_MODEL_LEN"):
        new = str(data.draw(st.integers(min_value=1, max_value=10**7)))
    elif field == "KVP_KV_CACHE_DTYPE":
        new = data.draw(st.sampled_from(["float16", "fp8_e4m3", "fp8_e5m2", "float32"]))
    elif field in ("KVP_CONNECTOR_BUILD", "KVP_VLLM_BUILD"):
        new = "pkg==" + data.draw(st.from_regex(r"[0-9]{1,3}\.[0-9]{1,3}", fullmatch=True))
    elif field == "KVP_CONNECTOR":
        new = data.draw(st.from_regex(r"[A-Z][A-Za-z0-9_]{0,20}", fullmatch=True))
    else:
        new = data.draw(st.from_regex(r"[a-z0-9][a-z0-9/._-]{0,30}", fullmatch=True))
    ident_a = identity_from_env(BASE)
    ident_b = identity_from_env(dict(BASE, **{field: new}))
    assert (ident_a.namespace() == ident_b.namespace()) == (original == new)


@pytest.mark.parametrize("key,value,needle", [
    ("KVP_MODEL_REVISION", "main", "40-char"),
    ("KVP_MODEL_REVISION", "0e9e39f", "40-char"),
    ("KVP_MODEL_REVISION", "0E9E39F249A16976918F6564B8830BC894C89659", "40-char"),
    ("KVP_TOKENIZER_REVISION", "v1.0", "40-char"),
    ("KVP_KV_CACHE_DTYPE", "auto", "not resolved"),
    ("KVP_KV_CACHE_DTYPE", "fp8", "not resolved"),
    ("KVP_KV_CACHE_DTYPE", "int3", "not a known"),
    ("KVP_BLOCK_SIZE", "0", "positive integer"),
    ("KVP_NUM_KV_HEADS", "-8", "positive integer"),
    ("KVP_HEAD_DIM", "12.5", "positive integer"),
    ("KVP_CONNECTOR_BUILD", "lmcache>=0.5", "pinned"),
    ("KVP_CONNECTOR_BUILD", "lmcache", "pinned"),
    ("KVP_VLLM_BUILD", "vllm==0.*", "pinned"),
    ("KVP_VLLM_BUILD", "vllm/vllm-openai:latest", "pinned"),
    ("KVP_CHAT_TEMPLATE_SHA256", "abc", "64 lowercase hex"),
    ("KVP_MODEL_ID", "has space", "whitespace"),
])
def test_uncertain_fields_are_refused(key: str, value: str, needle: str) -> None:
    problems = identity_problems(dict(BASE, **{key: value}))
    assert len(problems) == 1
    assert problems[0].where.endswith(key)
    assert needle in problems[0].message
    assert problems[0].fix  # every refusal says how to fix it


def test_all_missing_fields_reported_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        identity_from_env({"KVP_MODEL_ID": "x"})
    assert len(err.value.problems) == 13
    assert all("missing" in p.message for p in err.value.problems)


def test_image_digest_is_a_pinned_build() -> None:
    env = dict(BASE, KVP_VLLM_BUILD="vllm/vllm-openai@sha256:" + "c" * 64)
    assert identity_from_env(env).vllm_build.endswith("c" * 64)


def test_identity_round_trips_through_dict() -> None:
    ident = identity_from_env(BASE)
    assert identity_from_dict(ident.as_dict()) == ident
    assert isinstance(ident, CacheIdentity)


def test_unpinned_namespace_never_looks_pinned() -> None:
    ns = unpinned_namespace("0" * 32)
    assert ns.startswith("kvp-unpinned-") and is_namespace(ns)
    with pytest.raises(ValueError):
        unpinned_namespace("xyz")
