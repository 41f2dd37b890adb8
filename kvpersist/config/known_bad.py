"""Models and software known to make LMCache's MP connector serve wrong KV silently (pure).

Each entry names the upstream issue, says what it matches and why it is refused: ``identity
derive`` and ``launch`` (``--check`` included) refuse a deployment it matches unless the
operator opts in (``KVP_ALLOW_KNOWN_CORRUPTION=true``, ``derive
--allow-known-corruption``), and an opted-in deployment must keep its canary on
(docs/canary.md). The table is data: an entry is added when an upstream issue, or a canary
failure in kvpersist's own tests, shows a combination corrupting output.

* LMCache #4247 (and #2845): hybrid models, whose layers keep a recurrent state (Mamba,
  Mamba2, gated DeltaNet, linear or lightning attention, short convolutions) beside
  attention. LMCache stores and restores the attention KV only; on a prefix hit vLLM skips
  the prefix for every layer, so the recurrent layers start from a state that was never
  restored: "token salad" on shared-prefix hits, no error anywhere.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

HYBRID_ISSUE = "https://github.com/LMCache/LMCache/issues/4247"

#: architectures (config.json ``architectures``) with recurrent-state layers
HYBRID_ARCHITECTURES = frozenset({
    "BambaForCausalLM", "FalconH1ForCausalLM", "FalconMambaForCausalLM",
    "GraniteMoeHybridForCausalLM", "JambaForCausalLM", "KimiLinearForCausalLM",
    "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Mamba2ForCausalLM", "MambaForCausalLM",
    "MiniMaxM1ForCausalLM", "MiniMaxText01ForCausalLM", "NemotronHForCausalLM",
    "Plamo2ForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForCausalLM",
    "Qwen3_5MoeForConditionalGeneration", "Zamba2ForCausalLM",
})
#: layer kinds (``layer_types``, ``layers_block_type``) that keep a recurrent state
RECURRENT_LAYER_KINDS = frozenset({
    "mamba", "mamba2", "linear_attention", "gated_delta_net", "gdn", "conv", "short_conv",
    "lightning", "linear", "kda", "ssm", "recurrent", "rwkv",
})
#: config keys only recurrent-state models have
RECURRENT_KEYS = ("ssm_state_size", "mamba_d_state", "mamba_d_ssm", "mamba_n_heads",
                  "linear_num_value_heads", "linear_conv_kernel_dim", "hybrid_override_pattern",
                  "attn_layer_indices", "conv_L_cache")


@dataclass(frozen=True)
class KnownBad:
    """A match: the upstream issue and what in the model or software matched."""

    issue: str
    why: str

    def message(self) -> str:
        return f"{self.why}: LMCache's MP connector serves wrong KV for it silently ({self.issue})"


def _configs(config: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The config and its nested language-model config (multimodal models)."""
    out = [config]
    for key in ("text_config", "language_config", "llm_config"):
        nested = config.get(key)
        if isinstance(nested, Mapping):
            out.append(nested)
    return out


def _kinds(value: Any) -> set[str]:
    if isinstance(value, str):  # hybrid_override_pattern "M-M-*-": handled by key
        return set()
    if isinstance(value, Sequence):
        return {str(v).lower() for v in value if isinstance(v, str)}
    return set()


def hybrid(config: Mapping[str, Any]) -> KnownBad | None:
    """The model of ``config`` (config.json) keeps recurrent state beside attention."""
    for c in _configs(config):
        archs = c.get("architectures")
        names = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
        for a in names:
            if a in HYBRID_ARCHITECTURES:
                return KnownBad(HYBRID_ISSUE, f"{a} is a hybrid model (recurrent-state "
                                "layers beside attention)")
        for key in ("layer_types", "layers_block_type", "block_types"):
            found = _kinds(c.get(key)) & RECURRENT_LAYER_KINDS
            if found:
                return KnownBad(HYBRID_ISSUE, f"config.json {key} lists recurrent-state "
                                f"layers ({', '.join(sorted(found))})")
        keys = [k for k in RECURRENT_KEYS if k in c]
        if keys:
            return KnownBad(HYBRID_ISSUE, f"config.json has recurrent-state settings "
                            f"({', '.join(keys)})")
    return None


def known_bad(config: Mapping[str, Any]) -> list[KnownBad]:
    """Every entry of the table the model of ``config`` matches."""
    return [m for m in (hybrid(config),) if m is not None]


OPT_IN = ("KVP_ALLOW_KNOWN_CORRUPTION=true (derive: --allow-known-corruption) runs it anyway "
          "with the canary checking the cache path at every launch (docs/canary.md)")

__all__ = ["HYBRID_ARCHITECTURES", "HYBRID_ISSUE", "OPT_IN", "KnownBad", "hybrid",
           "known_bad"]
