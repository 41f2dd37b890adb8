"""Compare a configured compatibility identity with what would run (pure).

:func:`check_identity` compares a :class:`~kvpersist.config.identity.CacheIdentity` field by
field with the facts of a model directory (:class:`~kvpersist.config.model_facts.ModelFacts`), the
installed software and the image, with the rules of :mod:`kvpersist.config.derive`. Every
field ends in one of four states:

* ``ok``: compared, equal;
* ``mismatch``: compared, different (a launch is refused);
* ``unchecked``: cannot be known here (no weights, a layout that does not record it, a
  container image by tag); the reason is given, and it never counts as passed;
* ``rendered``: kvpersist passes the value to vLLM, which uses it as given (block size,
  tensor parallelism, connector, KV dtype): there is nothing in the model to compare it with.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvpersist.config.identity import (
    ALL_IDENTITY_KEYS,
    MODEL_KV_DTYPES,
    CacheIdentity,
)
from kvpersist.config.model_dtype import kv_quantization
from kvpersist.config.model_facts import ModelFacts
from kvpersist.config.model_geometry import kv_geometry, max_model_len
from kvpersist.config.model_origin import origin
from kvpersist.config.model_template import template_digest
from kvpersist.errors import Problem
from kvpersist.system.software import (
    VENV_DISTS_LABEL,
    VENV_LABEL,
    ImageInfo,
    Installed,
    normalize,
)

_DIGEST = re.compile(r"(?:([^\s@]+)@)?(sha256:[0-9a-f]{64})\Z")
_PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)\Z")

OK, MISMATCH, UNCHECKED, RENDERED = "ok", "mismatch", "unchecked", "rendered"


@dataclass(frozen=True)
class FieldCheck:
    """One identity field compared with what will run."""

    name: str
    status: str
    configured: str | int
    found: str | int | None = None
    source: str = ""
    detail: str = ""
    fix: str = ""

    @property
    def key(self) -> str:
        return ALL_IDENTITY_KEYS[self.name]

    def problem(self) -> Problem:
        """The mismatch as a launch problem: ``KEY: config says X, SOURCE says Y``."""
        said = f"says {self.found}" if self.found is not None else "states no usable value"
        message = f"config says {self.configured}, {self.source} {said}"
        if self.detail:
            message += f" ({self.detail})"
        return Problem(self.key, message, self.fix)

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key, "status": self.status, "config": self.configured,
                "found": self.found, "source": self.source, "detail": self.detail,
                "fix": self.fix}


@dataclass(frozen=True)
class CheckContext:
    """What a check compares with: the model (None: not readable here, ``model_why`` says
    why), the installed software, and how vLLM will run."""

    model: ModelFacts | None
    model_why: str
    installed: Installed
    vllm_mode: str  # "process" or "container"
    vllm_launched: bool
    image: str = ""
    image_info: ImageInfo | None = None
    #: the digest of the distributions of the venv the image's labels say it runs, as
    #: installed now (None: no such label, or the venv is not on this host)
    venv_dists_now: str | None = None


REDERIVE = ("point KVP_MODEL_PATH at the weights this identity describes, or set the identity "
            "from these weights (`kvp-admin identity derive MODEL_DIR`; a new namespace)")
MALFORMED_FIX = ("the model states a value vLLM would use as it is or fail on, and kvpersist "
                 "cannot tell what it would cache: fix or download the model again, then "
                 "`kvp-admin identity derive MODEL_DIR`")


def check_identity(ident: CacheIdentity, ctx: CheckContext) -> tuple[FieldCheck, ...]:
    """Compare every field of ``ident`` with the facts of ``ctx``."""
    cfg = ident.as_dict()
    out: dict[str, FieldCheck] = {}
    m = ctx.model
    if m is None:
        for name in ("model_id", "model_revision", "tokenizer_name", "tokenizer_revision",
                     "num_kv_heads", "head_dim", "max_model_len", "chat_template_sha256"):
            out[name] = FieldCheck(name, UNCHECKED, cfg[name], detail=ctx.model_why)
        out["kv_cache_dtype"] = FieldCheck("kv_cache_dtype", UNCHECKED, cfg["kv_cache_dtype"],
                                           detail=ctx.model_why)
    else:
        out.update(_check_model(cfg, m))
    out["block_size"] = FieldCheck("block_size", RENDERED, cfg["block_size"],
                                   detail="kvpersist passes --block-size to vLLM")
    out["tensor_parallel_size"] = FieldCheck(
        "tensor_parallel_size", RENDERED, cfg["tensor_parallel_size"],
        detail="kvpersist passes --tensor-parallel-size to vLLM")
    out["connector"] = FieldCheck("connector", RENDERED, cfg["connector"],
                                  detail="kvpersist passes --kv-transfer-config to vLLM")
    out["connector_build"] = _check_connector(str(cfg["connector_build"]), ctx)
    out["vllm_build"] = _check_vllm(str(cfg["vllm_build"]), ctx)
    if ident.engine_args:
        out["engine_args"] = FieldCheck(
            "engine_args", RENDERED, " ".join(f"{k}={v}" for k, v in ident.engine_args),
            detail="kvpersist passes these flags to vLLM (its parser checks them at launch)")
    return tuple(out[name] for name in ALL_IDENTITY_KEYS if name in out)


def _check_model(cfg: Mapping[str, Any], m: ModelFacts) -> dict[str, FieldCheck]:
    out: dict[str, FieldCheck] = {}
    org = origin(m)
    for n in ("model_id", "tokenizer_name"):
        if org.repo_id:
            out[n] = _compare(n, cfg[n], org.repo_id, org.source, "", REDERIVE)
        else:
            out[n] = FieldCheck(n, UNCHECKED, cfg[n], detail=org.why_no_id)
    for n in ("model_revision", "tokenizer_revision"):
        if org.revision:
            out[n] = _compare(n, cfg[n], org.revision, org.source, "", REDERIVE)
        elif org.revisions and (len(org.revisions) > 1 or cfg[n] not in org.revisions):
            shown = ", ".join(org.revisions[:4]) + (f" and {len(org.revisions) - 4} more"
                                                    if len(org.revisions) > 4 else "")
            out[n] = FieldCheck(n, MISMATCH, cfg[n], shown, org.source,
                                org.why_no_revision, REDERIVE)
        else:
            out[n] = FieldCheck(n, UNCHECKED, cfg[n], detail=org.why_no_revision)
    where = m.file("config.json")
    kv, hd, _ = kv_geometry(m.config, where)
    limit = max_model_len(m.config, where)
    for d in (kv, hd, limit):
        if d.value is None and d.malformed:
            out[d.name] = FieldCheck(d.name, MISMATCH, cfg[d.name], None, where, d.note,
                                     MALFORMED_FIX)
    for d in (kv, hd):
        if d.name not in out:
            out[d.name] = (_compare(d.name, cfg[d.name], d.value, *_split(d.source, where))
                           if d.value is not None
                           else FieldCheck(d.name, UNCHECKED, cfg[d.name], detail=d.note))
    src, key = _split(limit.source, where)
    if "max_model_len" in out:
        pass  # malformed: a mismatch, above
    elif limit.value is None:
        out["max_model_len"] = FieldCheck("max_model_len", UNCHECKED, cfg["max_model_len"],
                                          detail=limit.note)
    elif int(cfg["max_model_len"]) > int(limit.value):
        out["max_model_len"] = FieldCheck(
            "max_model_len", MISMATCH, cfg["max_model_len"], limit.value, src,
            f"{key}: the model's maximum; vLLM refuses a longer --max-model-len",
            f"lower KVP_MAX_MODEL_LEN to at most {limit.value} (a new namespace), or "
            + REDERIVE)
    else:
        out["max_model_len"] = FieldCheck("max_model_len", OK, cfg["max_model_len"],
                                          limit.value, src,
                                          f"{key}: at most the model's maximum")
    tpl = template_digest(m)
    out["chat_template_sha256"] = (
        _compare("chat_template_sha256", cfg["chat_template_sha256"], tpl.value, tpl.source,
                 "", REDERIVE) if tpl.value is not None
        else FieldCheck("chat_template_sha256", UNCHECKED, cfg["chat_template_sha256"],
                        detail=tpl.note))
    declared = kv_quantization(m)
    kv_dtype = str(cfg["kv_cache_dtype"])
    if declared and kv_dtype in MODEL_KV_DTYPES:
        out["kv_cache_dtype"] = FieldCheck(
            "kv_cache_dtype", MISMATCH, kv_dtype, "fp8", m.file(declared),
            "vLLM applies the checkpoint's KV quantization under --kv-cache-dtype auto, "
            "which kvpersist renders for a model dtype",
            "set KVP_KV_CACHE_DTYPE to the stored fp8 dtype (e.g. fp8_e4m3; a new namespace)")
    else:
        out["kv_cache_dtype"] = FieldCheck(
            "kv_cache_dtype", RENDERED, kv_dtype,
            detail="kvpersist passes " + (f"--dtype {kv_dtype} --kv-cache-dtype auto"
                                          if kv_dtype in MODEL_KV_DTYPES
                                          else f"--kv-cache-dtype {kv_dtype}") + " to vLLM")
    return out


def _compare(name: str, configured: Any, found: Any, source: str, detail: str = "",
             fix: str = REDERIVE) -> FieldCheck:
    status = OK if str(configured) == str(found) else MISMATCH
    return FieldCheck(name, status, configured, found, source, detail,
                      fix if status == MISMATCH else "")


def _split(source: str, where: str) -> tuple[str, str]:
    """(file, what in it) of a source ``FILE: key...``."""
    if source.startswith(where + ": "):
        return where, source[len(where) + 2:]
    return source, ""


def _pin_fix(pin: str) -> str:
    return f"install {pin} in this Python, or pin what is installed (a new namespace)"


def _check_dist(name: str, pin: str, dists: tuple[tuple[str, str], ...], inst: Installed,
                what: str) -> FieldCheck:
    """A ``dist==version`` pin against this Python's distributions."""
    m = _PIN.match(pin)
    assert m is not None  # identity validation admits only pins and image digests
    dist, ver = m.groups()
    have = inst.version(dist)
    installed = ", ".join(f"{n}=={v}" for n, v in dists) or f"no {what}"
    src = "this Python's metadata"
    if have == ver:
        others = [f"{n}=={v}" for n, v in dists if normalize(n) != normalize(dist)]
        if others:
            return FieldCheck(name, MISMATCH, pin, installed, src,
                              f"{', '.join(others)} is installed too: it is ambiguous which "
                              "runs", "uninstall the other build")
        return FieldCheck(name, OK, pin, f"{dist}=={have}", src)
    return FieldCheck(name, MISMATCH, pin, installed if have is None else f"{dist}=={have}",
                      src, "", _pin_fix(pin))


def _image_digest(pin: str) -> str:
    m = _DIGEST.match(pin)
    return m.group(2) if m else ""


def _check_image(name: str, pin: str, ctx: CheckContext) -> FieldCheck:
    """An image digest pin against KVP_IMAGE (container mode)."""
    digest = _image_digest(pin)
    fix = ("run the pinned image (KVP_IMAGE=REF@" + digest + "), or pin KVP_VLLM_BUILD to "
           "KVP_IMAGE's digest (a new namespace)")
    own = _image_digest(ctx.image)
    if own:
        status = OK if own == digest else MISMATCH
        return FieldCheck(name, status, pin, ctx.image, "KVP_IMAGE", "",
                          fix if status == MISMATCH else "")
    info = ctx.image_info
    if info is None or not info.checked:
        why = info.reason if info is not None else "the image was not inspected"
        return FieldCheck(name, UNCHECKED, pin, detail=f"KVP_IMAGE={ctx.image} is a tag: {why}; "
                          "pin KVP_IMAGE by digest to make this checkable without the engine")
    status = OK if digest in info.digests() else MISMATCH
    found = ", ".join(sorted(info.digests())) or "no digest"
    src = f"{info.engine} image inspect {ctx.image}"
    built = info.labels.get(VENV_DISTS_LABEL, "")
    if status == OK and built and ctx.venv_dists_now and ctx.venv_dists_now != built:
        venv = info.labels.get(VENV_LABEL, "?")
        return FieldCheck(name, MISMATCH, pin, f"the venv {venv} it runs now holds other "
                          f"distributions ({ctx.venv_dists_now}, built with {built})", src,
                          "the image runs a bind-mounted venv that changed since it was built",
                          "rebuild the image (scripts/build-cpu-image.sh) and pin its digest "
                          "(a new namespace), or restore the venv")
    return FieldCheck(name, status, pin, found, src, "", fix if status == MISMATCH else "")


def _check_vllm(pin: str, ctx: CheckContext) -> FieldCheck:
    name = "vllm_build"
    if not ctx.vllm_launched:
        return FieldCheck(name, UNCHECKED, pin, detail="vLLM is not launched by this command "
                          "(the check runs where vLLM starts)")
    if ctx.vllm_mode == "container":
        if _image_digest(pin):
            return _check_image(name, pin, ctx)
        return FieldCheck(name, UNCHECKED, pin, detail=(
            f"vLLM runs in the image KVP_IMAGE={ctx.image}: which vLLM it holds is known only "
            "by running it; pin KVP_VLLM_BUILD to the image's @sha256 digest to check it"))
    if _image_digest(pin):
        found = ", ".join(f"{n}=={v}" for n, v in ctx.installed.vllm) or "no vLLM"
        return FieldCheck(name, MISMATCH, pin, found, "this Python's metadata",
                          "the config pins an image, but vLLM runs as a process here "
                          "(KVP_IMAGE unset)",
                          "pin the installed vLLM (name==version; a new namespace) or run the "
                          "image")
    return _check_dist(name, pin, ctx.installed.vllm, ctx.installed, "vLLM")


def _check_connector(pin: str, ctx: CheckContext) -> FieldCheck:
    name = "connector_build"
    if _image_digest(pin):
        if ctx.vllm_mode == "container" and ctx.vllm_launched:
            return _check_image(name, pin, ctx)
        return FieldCheck(name, UNCHECKED, pin, detail="the connector is pinned by an image "
                          "digest, and no image runs here")
    if ctx.vllm_mode == "container":
        have = ", ".join(f"{n}=={v}" for n, v in ctx.installed.lmcache) or "none"
        return FieldCheck(name, UNCHECKED, pin, detail=(
            f"the connector runs inside KVP_IMAGE={ctx.image or '?'}: its lmcache is known only "
            f"by running it (the cache server's here: {have})"))
    return _check_dist(name, pin, ctx.installed.lmcache, ctx.installed, "lmcache")
