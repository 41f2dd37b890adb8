"""The KV geometry and maximum length vLLM computes from a model's config (pure).

* KV geometry is vLLM's: ``num_key_value_heads`` (or the other names vLLM reads; all
  attention heads when absent), ``head_dim`` (else ``hidden_size / num_attention_heads``),
  from ``text_config`` when the model nests one. MLA models (DeepSeek-V2/V3 and the like,
  ``kv_lora_rank`` set) cache one latent vector per token and layer: 1 "head" of
  ``kv_lora_rank + qk_rope_head_dim`` values, which is what is stored. Models whose layers
  differ (MiMo-V2's sliding-window layers, separate V head sizes) are recorded by the
  values vLLM reports for the model as a whole (the full-attention layers'); the model id
  and revision pin the rest.
* The maximum length is vLLM's derived maximum: the smallest of ``max_position_embeddings``
  and its aliases, times the RoPE factor for the RoPE types vLLM scales.

Nothing is guessed from a value of the wrong type: a key that is present (not null) but not
a positive integer (a string, a float, a boolean, zero or less, more than
:data:`~kvpersist.config.model_facts.MAX_CONFIG_INT`), or a RoPE factor that is not a
positive finite number, makes the field unknown with that reason; it never falls back to the
next key, because vLLM would use the value as it is, or fail.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvpersist.config.derived_field import Derived, unknown
from kvpersist.config.model_facts import (
    MAX_CONFIG_INT,
    bad_text_config,
    config_int,
    quoted,
    shown,
    text_config,
)
from kvpersist.system.vllm_seam import ENV_MLA_DISABLE

#: config keys vLLM reads for the number of KV heads, in its order
KV_HEAD_KEYS = ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num",
                "num_attention_groups")
#: config keys vLLM reads for the maximum length (it takes the smallest)
MAX_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "model_max_length", "max_target_positions", "max_sequence_length",
                "max_seq_length", "seq_len")
#: RoPE types whose ``factor`` vLLM does not apply to the maximum length again
ROPE_UNSCALED = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling",
                 "default", "mrope")
#: model types vLLM 0.32 caches as MLA when ``kv_lora_rank`` is set (its
#: ``ModelArchConfigConvertor.is_deepseek_mla``); any other type with a ``kv_lora_rank`` caches
#: ordinary heads
MLA_MODEL_TYPES = frozenset((
    "axk1", "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "deepseek_v41",
    "dots3_note", "deepseek_mtp", "k3_dspark", "glm5_next", "glm5_next_text", "glm_moe_dsa",
    "glm4_moe_lite", "glm4_moe_lite_mtp", "kimi_k2", "kimi_linear", "longcat_flash",
    "pangu_ultra_moe", "pangu_ultra_moe_mtp", "bailing_hybrid", "bailing_hybrid_mtp",
    "bailing_hybrid_v3_mtp", "hy_v4", "hy_v4_mtp"))
#: keys that show a model whose layers do not all share one KV geometry
HETEROGENEOUS_KEYS = ("swa_num_key_value_heads", "swa_head_dim", "v_head_dim",
                      "swa_v_head_dim", "global_head_dim", "num_global_key_value_heads")


def kv_geometry(config: Mapping[str, Any], where: str) -> tuple[Derived, Derived, list[str]]:
    """(num_kv_heads, head_dim, notes) as vLLM computes them from ``config``; ``where``
    names the file in sources. A field is unknown, with why, when a key it is computed from
    is missing or present with a value vLLM could not use as a positive integer."""
    notes: list[str] = []
    bad = bad_text_config(config, where)
    if bad:
        return (unknown("num_kv_heads", bad, True), unknown("head_dim", bad, True), notes)
    tc, p = text_config(config)
    if (tc.get("kv_lora_rank") is not None and "compress_ratios" not in tc
            and tc.get("model_type") in MLA_MODEL_TYPES):
        return (*_mla(tc, where, p, notes), notes)
    heads, heads_why = config_int(tc, "num_attention_heads", where, p)
    kv = _kv_heads(tc, where, p, heads, heads_why)
    hd = _head_dim(tc, where, p, heads, heads_why)
    odd = [f"{p}{k}={quoted(tc[k])}" for k in HETEROGENEOUS_KEYS
           if tc.get(k) is not None and tc.get(k) not in (kv.value, hd.value)]
    if odd:
        notes.append(f"not every layer shares one KV geometry ({', '.join(odd)}): the identity "
                     "records the values vLLM reports for the model as a whole "
                     f"(num_kv_heads {kv.value}, head_dim {hd.value}); the model id and "
                     "revision pin the rest")
    return kv, hd, notes


def _mla(tc: Mapping[str, Any], where: str, p: str,
         notes: list[str]) -> tuple[Derived, Derived]:
    """MLA: one latent vector of kv_lora_rank + qk_rope_head_dim values per token."""
    rank, rank_why = config_int(tc, "kv_lora_rank", where, p)
    rope, rope_why = config_int(tc, "qk_rope_head_dim", where, p)
    if rank is None or rope is None:
        bad = bool(rank_why or rope_why)
        why = rank_why or rope_why or (f"{where} has an MLA kv_lora_rank but no usable "
                                       f"{p}qk_rope_head_dim")
        return unknown("num_kv_heads", why, bad), unknown("head_dim", why, bad)
    notes.append("MLA model: vLLM caches one latent vector per token and layer (1 x "
                 f"{rank + rope} values); with {ENV_MLA_DISABLE}=1 it would cache full "
                 "heads instead, a different geometry")
    return (Derived("num_kv_heads", 1, f"{where}: {p}kv_lora_rank (MLA: one latent "
                    "vector per token, cached as a single head)"),
            Derived("head_dim", rank + rope, f"{where}: {p}kv_lora_rank {rank} + "
                    f"{p}qk_rope_head_dim {rope} (MLA latent)"))


def _kv_heads(tc: Mapping[str, Any], where: str, p: str, heads: int | None,
              heads_why: str) -> Derived:
    """The first KV-head key vLLM reads that is set, else every attention head."""
    for key in KV_HEAD_KEYS:
        if tc.get(key) is not None:
            value, why = config_int(tc, key, where, p)
            return Derived("num_kv_heads", value, f"{where}: {p}{key}") if value else \
                unknown("num_kv_heads", why, True)
    if heads:
        return Derived("num_kv_heads", heads, f"{where}: {p}num_attention_heads (no "
                       "num_key_value_heads: multi-head attention caches every head)")
    return unknown("num_kv_heads", heads_why or f"{where} names neither "
                   f"{p}num_key_value_heads nor {p}num_attention_heads", bool(heads_why))


def _head_dim(tc: Mapping[str, Any], where: str, p: str, heads: int | None,
              heads_why: str) -> Derived:
    """head_dim, else hidden_size_per_head, else hidden_size / num_attention_heads: the
    first one set decides (a value of the wrong type is unknown, not skipped)."""
    for key in ("head_dim", "hidden_size_per_head"):
        if tc.get(key) is not None:
            value, why = config_int(tc, key, where, p)
            return Derived("head_dim", value, f"{where}: {p}{key}") if value else \
                unknown("head_dim", why, True)
    hidden, hidden_why = config_int(tc, "hidden_size", where, p)
    if hidden and heads:
        return Derived("head_dim", hidden // heads,
                       f"{where}: {p}hidden_size {hidden} / {p}num_attention_heads {heads}")
    return unknown("head_dim", hidden_why or heads_why or (
        f"{where} names neither {p}head_dim nor {p}hidden_size and {p}num_attention_heads"),
        bool(hidden_why or heads_why))


def max_model_len(config: Mapping[str, Any], where: str) -> Derived:
    """vLLM's derived maximum length of ``config`` (what --max-model-len may not exceed):
    unknown, with why, when a length key or a RoPE factor is present with a value vLLM could
    not use (see the module's docstring), or the product is past
    :data:`~kvpersist.config.model_facts.MAX_CONFIG_INT`."""
    bad = bad_text_config(config, where)
    if bad:
        return unknown("max_model_len", bad, True)
    tc, p = text_config(config)
    best = 0
    key = ""
    for k in MAX_LEN_KEYS:
        v, why = config_int(tc, k, where, p)
        if why:
            return unknown("max_model_len", why, True)
        if v is not None and (not best or v < best):
            best, key = v, k
    mml, _ = config_int(tc, "model_max_length", where, p)
    if mml:
        best, key = mml, "model_max_length"  # Command-R: vLLM takes it as is
    if not best:
        return unknown("max_model_len", f"{where} names no maximum length "
                        f"({p}max_position_embeddings or an alias)")
    factor: float = 1.0
    rope_type = ""
    if "gemma3" not in str(config.get("model_type", "")):
        for rp, rp_key in _rope_parameters(tc):
            kind = str(rp.get("rope_type") or rp.get("type") or "default")
            if kind in ROPE_UNSCALED or rp.get("factor") is None:
                continue  # vLLM: a null factor is 1.0
            value = rp["factor"]
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not 0 < value <= MAX_CONFIG_INT:
                return unknown("max_model_len", f"{where}: {p}{rp_key}.factor is "
                               f"{shown(value)}, not a positive number vLLM can scale the "
                               "maximum length by", True)
            factor, rope_type = float(value), kind[:40]
    scaled = best * factor
    if not math.isfinite(scaled) or scaled > MAX_CONFIG_INT:
        return unknown("max_model_len", f"{where}: {p}{key} {best:,} x RoPE factor "
                       f"{factor:g} is more than {MAX_CONFIG_INT:,} tokens", True)
    value = int(scaled)
    src = f"{where}: {p}{key}"
    if factor != 1.0:
        src += f" {best:g} x RoPE factor {factor:g} ({rope_type})"
    return Derived("max_model_len", value, src)


def _rope_parameters(tc: Mapping[str, Any]) -> list[tuple[Mapping[str, Any], str]]:
    """The RoPE parameter sets vLLM scales by, each with the key naming it in messages."""
    name = "rope_parameters"
    rope = tc.get(name)
    if not isinstance(rope, Mapping):
        name = "rope_scaling"
        rope = tc.get(name)
    if not isinstance(rope, Mapping) or not rope:
        return []
    if all(isinstance(v, Mapping) for v in rope.values()):  # one per layer type
        return [(v, f"{name}.{k}") for k, v in rope.items() if isinstance(v, Mapping) and v]
    return [(rope, name)]
