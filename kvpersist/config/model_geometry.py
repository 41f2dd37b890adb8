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
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvpersist.config.derived_field import Derived, unknown
from kvpersist.config.model_facts import text_config

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
#: keys that show a model whose layers do not all share one KV geometry
HETEROGENEOUS_KEYS = ("swa_num_key_value_heads", "swa_head_dim", "v_head_dim",
                      "swa_v_head_dim", "global_head_dim", "num_global_key_value_heads")


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def kv_geometry(config: Mapping[str, Any], where: str) -> tuple[Derived, Derived, list[str]]:
    """(num_kv_heads, head_dim, notes) as vLLM computes them from ``config``; ``where``
    names the file in sources."""
    tc, p = text_config(config)
    notes: list[str] = []
    if tc.get("kv_lora_rank") is not None and "compress_ratios" not in tc:
        rank = _positive_int(tc.get("kv_lora_rank"))
        rope = _positive_int(tc.get("qk_rope_head_dim"))
        if rank is None or rope is None:
            why = f"{where} has an MLA kv_lora_rank but no usable {p}qk_rope_head_dim"
            return unknown("num_kv_heads", why), unknown("head_dim", why), notes
        notes.append("MLA model: vLLM caches one latent vector per token and layer (1 x "
                     f"{rank + rope} values); with VLLM_MLA_DISABLE=1 it would cache full "
                     "heads instead, a different geometry")
        return (Derived("num_kv_heads", 1, f"{where}: {p}kv_lora_rank (MLA: one latent "
                        "vector per token, cached as a single head)"),
                Derived("head_dim", rank + rope, f"{where}: {p}kv_lora_rank {rank} + "
                        f"{p}qk_rope_head_dim {rope} (MLA latent)"),
                notes)
    heads = _positive_int(tc.get("num_attention_heads"))
    kv: Derived | None = None
    for key in KV_HEAD_KEYS:
        if tc.get(key) is not None:
            value = _positive_int(tc.get(key))
            kv = Derived("num_kv_heads", value, f"{where}: {p}{key}") if value else \
                unknown("num_kv_heads", f"{where}: {p}{key} is not a positive integer")
            break
    if kv is None:
        kv = (Derived("num_kv_heads", heads, f"{where}: {p}num_attention_heads (no "
                      "num_key_value_heads: multi-head attention caches every head)")
              if heads else unknown("num_kv_heads", f"{where} names neither "
                                     f"{p}num_key_value_heads nor {p}num_attention_heads"))
    head_dim = _positive_int(tc.get("head_dim"))
    if head_dim:
        hd = Derived("head_dim", head_dim, f"{where}: {p}head_dim")
    elif _positive_int(tc.get("hidden_size_per_head")):
        hd = Derived("head_dim", tc["hidden_size_per_head"], f"{where}: {p}hidden_size_per_head")
    elif heads and _positive_int(tc.get("hidden_size")):
        hidden = tc["hidden_size"]
        hd = Derived("head_dim", hidden // heads,
                     f"{where}: {p}hidden_size {hidden} / {p}num_attention_heads {heads}")
    else:
        hd = unknown("head_dim", f"{where} names neither {p}head_dim nor "
                      f"{p}hidden_size and {p}num_attention_heads")
    odd = [f"{p}{k}={tc[k]}" for k in HETEROGENEOUS_KEYS
           if tc.get(k) is not None and tc.get(k) not in (kv.value, hd.value)]
    if odd:
        notes.append(f"not every layer shares one KV geometry ({', '.join(odd)}): the identity "
                     "records the values vLLM reports for the model as a whole "
                     f"(num_kv_heads {kv.value}, head_dim {hd.value}); the model id and "
                     "revision pin the rest")
    return kv, hd, notes


def max_model_len(config: Mapping[str, Any], where: str) -> Derived:
    """vLLM's derived maximum length of ``config`` (what --max-model-len may not exceed)."""
    tc, p = text_config(config)
    best: float = math.inf
    key = ""
    for k in MAX_LEN_KEYS:
        v = tc.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v < best:
            best, key = v, k
    mml = tc.get("model_max_length")
    if isinstance(mml, (int, float)) and not isinstance(mml, bool) and mml:
        best, key = mml, "model_max_length"  # Command-R: vLLM takes it as is
    if best == math.inf or best <= 0:
        return unknown("max_model_len", f"{where} names no maximum length "
                        f"({p}max_position_embeddings or an alias)")
    factor = 1.0
    rope_type = ""
    if "gemma3" not in str(config.get("model_type", "")):
        for rp in _rope_parameters(tc):
            kind = str(rp.get("rope_type") or rp.get("type") or "default")
            if kind not in ROPE_UNSCALED and isinstance(rp.get("factor"), (int, float)):
                factor, rope_type = float(rp["factor"]), kind
    value = int(best * factor)
    src = f"{where}: {p}{key}"
    if factor != 1.0:
        src += f" {best:g} x RoPE factor {factor:g} ({rope_type})"
    return Derived("max_model_len", value, src)


def _rope_parameters(tc: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    rope = tc.get("rope_parameters")
    if not isinstance(rope, Mapping):
        rope = tc.get("rope_scaling")
    if not isinstance(rope, Mapping) or not rope:
        return []
    if all(isinstance(v, Mapping) for v in rope.values()):  # one per layer type
        return [v for v in rope.values() if isinstance(v, Mapping) and v]
    return [rope]
