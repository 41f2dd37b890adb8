"""The compatibility identity of a deployment and its namespace (pure).

A cached KV block may only be reused by a deployment that would have computed the same
bytes. :class:`CacheIdentity` holds exactly the fields that decide those bytes; its
namespace is ``"kvp-" + sha256(canonical JSON)[:32]``, and that namespace is the model name
LMCache sees, so the files of different identities never meet on disk.

The canonical JSON is byte-identical to ``jq -cS`` of the same object, so an operator can
recompute a namespace by hand::

    jq -cjS . manifest-identity.json | sha256sum | cut -c1-32

One more, optional, key: ``KVP_ENGINE_ARGS``, the vLLM flags that change the KV cache
(:mod:`kvpersist.config.engine_flags`). Its canonical form (dest -> canonical value text, see
:func:`kvpersist.config.engine_args.canonical_engine_args`) enters the canonical JSON as the
object ``engine_args``; when it is empty that field is absent, so the canonical JSON is the
14 fields and every namespace computed without it stays where it was.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvpersist.config.engine_args import canonical_engine_args, engine_args_problem
from kvpersist.config.values import describe_char, forbidden_char, parse_uint
from kvpersist.errors import ConfigError, Problem
from kvpersist.system.vllm_seam import version_of_build

NAMESPACE_PREFIX = "kvp-"
UNPINNED_PREFIX = "kvp-unpinned-"
NAMESPACE_RE = re.compile(r"kvp-(?:unpinned-)?[0-9a-f]{32}\Z")
PINNED_NAMESPACE_RE = re.compile(r"kvp-[0-9a-f]{32}\Z")

_HEX40 = re.compile(r"[0-9a-f]{40}\Z")
_HEX64 = re.compile(r"[0-9a-f]{64}\Z")
# A pinned build: name==exact-version (no ranges, wildcards or local paths), or an image
# reference by digest.
_PINNED_BUILD = re.compile(
    r"(?:[A-Za-z0-9][A-Za-z0-9._-]*==[0-9A-Za-z][0-9A-Za-z.+!_-]*"
    r"|(?:[^\s@]+@)?sha256:[0-9a-f]{64})\Z"
)
_CONNECTOR = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

#: KV-cache dtypes that name the stored bytes exactly. ``auto`` (depends on the model) and
#: ``fp8`` (e4m3 on CUDA, e4m3fnuz on ROCm) are refused as uncertain.
RESOLVED_KV_DTYPES = frozenset(
    {"bfloat16", "float16", "float32", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla"}
)
#: KV dtypes equal to a model dtype: rendered as ``--dtype X --kv-cache-dtype auto``.
MODEL_KV_DTYPES = frozenset({"bfloat16", "float16", "float32"})


@dataclass(frozen=True)
class CacheIdentity:
    """Everything that decides the bytes of a KV block. Build with :func:`identity_from_env`."""

    model_id: str
    model_revision: str
    tokenizer_name: str
    tokenizer_revision: str
    kv_cache_dtype: str
    block_size: int
    num_kv_heads: int
    head_dim: int
    tensor_parallel_size: int
    connector: str
    connector_build: str
    vllm_build: str
    max_model_len: int
    chat_template_sha256: str
    #: canonical KVP_ENGINE_ARGS as sorted (dest, value text) pairs; () when not set
    engine_args: tuple[tuple[str, str], ...] = ()

    def as_dict(self) -> dict[str, Any]:
        """The 14 fields as a plain dict (JSON keys = field names), plus ``engine_args``
        (an object of strings) only when KVP_ENGINE_ARGS is set."""
        out: dict[str, Any] = {name: getattr(self, name) for name in IDENTITY_KEYS}
        if self.engine_args:
            out["engine_args"] = dict(self.engine_args)
        return out

    def canonical_json(self) -> str:
        """Sorted keys, no whitespace, UTF-8: the same bytes ``jq -cS`` prints (sans newline)."""
        return canonical_json(self.as_dict())

    def namespace(self) -> str:
        """``kvp-`` + the first 32 hex chars of sha256(canonical JSON)."""
        digest = hashlib.sha256(self.canonical_json().encode("utf-8")).hexdigest()
        return NAMESPACE_PREFIX + digest[:32]

    def lmcache_model_name(self) -> str:
        """The ``model_name`` vLLM passes to LMCache: the namespace itself.

        vLLM hands LMCache its ``--model`` value; the launcher runs vLLM with the relative
        path ``kvp-<32hex>`` (a link to the real weights), so every L2 file name of this
        deployment starts with ``<namespace>_`` and the namespace is recovered exactly.
        """
        return self.namespace()


#: identity field -> env key, in the documented order: the 14 required fields.
IDENTITY_KEYS: dict[str, str] = {f.name: "KVP_" + f.name.upper() for f in fields(CacheIdentity)
                                 if f.name != "engine_args"}
#: optional identity fields -> env key: absent from the canonical JSON when empty
OPTIONAL_IDENTITY_KEYS: dict[str, str] = {"engine_args": "KVP_ENGINE_ARGS"}
#: every identity field -> env key
ALL_IDENTITY_KEYS: dict[str, str] = {**IDENTITY_KEYS, **OPTIONAL_IDENTITY_KEYS}
_INT_FIELDS = frozenset(f.name for f in fields(CacheIdentity) if f.type in ("int", int))


def canonical_json(obj: Mapping[str, object]) -> str:
    """Canonical JSON text of ``obj``: sorted keys, separators ``,`` and ``:``, UTF-8."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def unpinned_namespace(token_hex: str) -> str:
    """A one-off namespace from 32 random hex chars supplied by the caller.

    It can never equal a pinned namespace (different prefix) nor, with fresh randomness, any
    earlier one: an unpinned deployment never reads anything it did not write this run.
    """
    if not re.fullmatch(r"[0-9a-f]{32}", token_hex):
        raise ValueError("token_hex must be 32 lowercase hex chars")
    return UNPINNED_PREFIX + token_hex


def is_namespace(text: str) -> bool:
    """True if ``text`` is a kvpersist namespace (pinned or unpinned)."""
    return bool(NAMESPACE_RE.match(text))


def identity_problems(values: Mapping[str, str], source: str = "identity.env") -> list[Problem]:
    """Every problem with the identity keys in ``values`` (env key -> raw string)."""
    problems: list[Problem] = []
    for name, key in IDENTITY_KEYS.items():
        where = f"{source}: {key}"
        raw = values.get(key)
        if raw is None or raw.strip() == "":
            problems.append(Problem(where, "missing", _FIX[name]))
            continue
        message = _check_field(name, raw)
        if message:
            problems.append(Problem(where, message, _FIX[name]))
    raw = values.get(OPTIONAL_IDENTITY_KEYS["engine_args"], "")
    if raw.strip():
        try:
            parse_engine_args(raw, vllm_version(values))
        except ValueError as exc:
            problems.append(Problem(f"{source}: KVP_ENGINE_ARGS", str(exc), _FIX["engine_args"]))
    return problems


def vllm_version(values: Mapping[str, str]) -> str | None:
    """The vLLM release a config's values name (KVP_VLLM_BUILD, else KVP_IMAGE's tag), or
    None (:func:`kvpersist.system.vllm_seam.version_of_build`)."""
    return version_of_build(values.get(IDENTITY_KEYS["vllm_build"], ""),
                            values.get("KVP_IMAGE", ""))


def parse_engine_args(raw: str, version: str | None = None) -> tuple[tuple[str, str], ...]:
    """The canonical form of a KVP_ENGINE_ARGS value (shell-word split, as
    KVP_VLLM_EXTRA_ARGS) as vLLM ``version``'s parser reads it; raises ValueError naming
    every problem."""
    bad = forbidden_char(raw)
    if bad is not None:
        raise ValueError(f"contains {describe_char(bad)}")
    if "$" in raw or "`" in raw:
        raise ValueError("contains $ or a backtick (values are never expanded)")
    try:
        argv = shlex.split(raw)
    except ValueError as exc:
        raise ValueError(f"cannot be split like a shell word list: {exc}") from exc
    return tuple(canonical_engine_args(argv, version).items())


def identity_from_env(values: Mapping[str, str], source: str = "identity.env") -> CacheIdentity:
    """Build a :class:`CacheIdentity` from env keys; raise :class:`ConfigError` listing all
    problems (missing or uncertain fields) at once."""
    problems = identity_problems(values, source)
    if problems:
        raise ConfigError(problems, source)
    kwargs: dict[str, Any] = {}
    for name, key in IDENTITY_KEYS.items():
        raw = values[key].strip()
        kwargs[name] = int(raw) if name in _INT_FIELDS else raw
    engine = values.get(OPTIONAL_IDENTITY_KEYS["engine_args"], "")
    kwargs["engine_args"] = (parse_engine_args(engine, vllm_version(values)) if engine.strip()
                             else ())
    return CacheIdentity(**kwargs)


def identity_from_dict(data: Mapping[str, object]) -> CacheIdentity:
    """Rebuild an identity from its JSON form (e.g. a manifest); raises ConfigError."""
    env = {IDENTITY_KEYS[k]: str(v) for k, v in data.items() if k in IDENTITY_KEYS}
    extra = sorted(set(data) - set(ALL_IDENTITY_KEYS))
    if extra:
        raise ConfigError([Problem("identity", f"unknown field(s) {', '.join(extra)}")])
    ident = identity_from_env(env, "identity")
    if "engine_args" not in data:
        return ident
    engine = data["engine_args"]
    if not isinstance(engine, Mapping) or not engine:
        raise ConfigError([Problem("identity", "engine_args must be a non-empty object "
                                   "(absent when KVP_ENGINE_ARGS is empty)")])
    message = engine_args_problem(engine, vllm_version(env))
    if message:
        raise ConfigError([Problem("identity", message)])
    return CacheIdentity(**{**{n: getattr(ident, n) for n in IDENTITY_KEYS},
                            "engine_args": tuple(sorted(engine.items()))})


def diff_identities(a: CacheIdentity, b: CacheIdentity) -> list[tuple[str, object, object]]:
    """The fields whose values differ, as (field, value in a, value in b); an unset
    ``engine_args`` reads as {}."""
    da, db = a.as_dict(), b.as_dict()
    return [(k, da.get(k, {}), db.get(k, {})) for k in ALL_IDENTITY_KEYS
            if da.get(k, {}) != db.get(k, {})]


def _check_field(name: str, raw: str) -> str:
    """Return an error message for one identity field value, or '' if it is fine."""
    value = raw.strip()
    bad = forbidden_char(value)
    if bad is not None:
        return f"contains {describe_char(bad)}"
    if "$" in value or "`" in value:
        return "contains $ or a backtick (values are never expanded)"
    if name in _INT_FIELDS:
        number = parse_uint(value, 18)
        if number is None or number <= 0:
            return f"must be a positive integer, got {value!r}"
        return ""
    if name in ("model_revision", "tokenizer_revision"):
        if not _HEX40.match(value):
            return f"must be a full 40-char lowercase commit SHA, got {value!r}"
    elif name == "chat_template_sha256":
        if not _HEX64.match(value):
            return f"must be 64 lowercase hex chars, got {value!r}"
    elif name == "kv_cache_dtype":
        if value not in RESOLVED_KV_DTYPES:
            why = "is not resolved" if value in ("auto", "fp8") else "is not a known KV dtype"
            return f"{value!r} {why}; one of {', '.join(sorted(RESOLVED_KV_DTYPES))}"
    elif name in ("connector_build", "vllm_build"):
        if not _PINNED_BUILD.match(value):
            return ("must be pinned exactly (name==version or an image @sha256 digest), "
                    f"got {value!r}")
    elif name == "connector":
        if not _CONNECTOR.match(value):
            return f"must be a connector class name, got {value!r}"
    elif any(ch.isspace() for ch in value):
        return f"must not contain whitespace, got {value!r}"
    return ""


_FIX = {
    "model_id": "set the model id, e.g. meta-llama/Llama-3.1-8B-Instruct",
    "model_revision": "pin the weights' commit: `git -C WEIGHTS rev-parse HEAD` or the hub's "
    "full revision SHA",
    "tokenizer_name": "set the tokenizer repo (usually the model id)",
    "tokenizer_revision": "pin the tokenizer's full commit SHA",
    "kv_cache_dtype": "set the effective KV dtype (the model dtype when vLLM uses 'auto')",
    "block_size": "set vLLM's --block-size (16 on GPU by default, 128 on the CPU build)",
    "num_kv_heads": "num_key_value_heads from the model's config.json",
    "head_dim": "head_dim from config.json (hidden_size / num_attention_heads if absent)",
    "tensor_parallel_size": "set vLLM's --tensor-parallel-size",
    "connector": "LMCacheMPConnector",
    "connector_build": "pin it, e.g. lmcache==0.5.6",
    "vllm_build": "pin it, e.g. vllm==0.32.0 or image@sha256:<digest>",
    "max_model_len": "set vLLM's --max-model-len",
    "chat_template_sha256": "compute it: kvp-admin identity template-sha TEMPLATE",
    "engine_args": "only KV-affecting vLLM flags, each once (docs/engine-flags.md); KV-neutral "
    "ones go in KVP_VLLM_EXTRA_ARGS",
}
