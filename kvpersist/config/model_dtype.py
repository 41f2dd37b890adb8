"""The KV dtype vLLM stores for a checkpoint under ``--kv-cache-dtype auto`` (pure).

The checkpoint's ``torch_dtype``/``dtype`` when it is bfloat16 or float16. float32 (vLLM's
``auto`` serves it in a platform-dependent half type), a missing or contradictory dtype, and a
checkpoint that declares a quantized KV cache (which vLLM applies under ``--kv-cache-dtype
auto``) are refused as ambiguous; so is a dtype key that is present but not a string (never
skipped for the other key).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from kvpersist.config.derived_field import Derived, unknown
from kvpersist.config.model_facts import (
    SHOWN_CHARS,
    ModelFacts,
    bad_text_config,
    shown,
    text_config,
)


def kv_quantization(m: ModelFacts) -> str:
    """Where the checkpoint declares a quantized KV cache (which vLLM applies under
    ``--kv-cache-dtype auto``), or ''."""
    qc = m.config.get("quantization_config")
    hq = m.hf_quant_config
    places: list[tuple[str, Any]] = [
        ("config.json: quantization_config", qc),
        ("config.json: quantization_config.quantization",
         qc.get("quantization") if isinstance(qc, Mapping) else None),
        ("hf_quant_config.json", hq),
        ("hf_quant_config.json: quantization",
         hq.get("quantization") if isinstance(hq, Mapping) else None),
    ]
    for where, d in places:
        if not isinstance(d, Mapping):
            continue
        for k in ("kv_cache_scheme", "kv_cache_quant_algo"):
            if d.get(k) is not None:
                return f"{where}.{k} = {json.dumps(d[k], sort_keys=True)[:80]}"
    return ""


def model_dtype(m: ModelFacts) -> Derived:
    """The KV dtype vLLM uses for this checkpoint with ``--kv-cache-dtype auto``, when
    that is not ambiguous."""
    where = m.file("config.json")
    declared = kv_quantization(m)
    if declared:
        return unknown("kv_cache_dtype", f"the checkpoint declares a quantized KV cache "
                        f"({declared}): vLLM stores 'fp8' (e4m3 on CUDA, e4m3fnuz on ROCm); "
                        "name the stored dtype with --kv-cache-dtype (e.g. fp8_e4m3)")
    bad = bad_text_config(m.config, where)
    if bad:
        return unknown("kv_cache_dtype", f"{bad}: pass --kv-cache-dtype")
    tc, p = text_config(m.config)
    found: dict[str, str] = {}
    for prefix, cfg in (("", m.config), (p, tc)):
        for k in ("torch_dtype", "dtype"):
            value = cfg.get(k)
            if value is None:
                continue
            if not isinstance(value, str):
                return unknown("kv_cache_dtype", f"{where}: {prefix}{k} is {shown(value)}, "
                               "not a dtype name: pass --kv-cache-dtype")
            found[prefix + k] = value
    values = set(found.values())
    if not values:
        return unknown("kv_cache_dtype", f"{where} names no torch_dtype/dtype: pass "
                        "--kv-cache-dtype")
    if len(values) > 1:
        return unknown("kv_cache_dtype", f"{where} names several dtypes "
                        f"({', '.join(f'{k}={v[:SHOWN_CHARS]}' for k, v in sorted(found.items()))}"
                        "): pass --kv-cache-dtype")
    (value,) = values
    key = sorted(found)[0]
    if value in ("bfloat16", "float16"):
        return Derived("kv_cache_dtype", value, f"{where}: {key} (vLLM's --dtype auto)")
    if value == "float32":
        return unknown("kv_cache_dtype", f"{where}: {key} is float32, which vLLM's auto "
                        "serves in a half type that depends on the platform: pass "
                        "--kv-cache-dtype bfloat16, float16 or float32")
    return unknown("kv_cache_dtype", f"{where}: {key} is {value[:SHOWN_CHARS]!r}, not a KV "
                    "dtype kvpersist can name: pass --kv-cache-dtype")
