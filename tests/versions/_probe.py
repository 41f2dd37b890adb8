"""What one vLLM release's own code says, run in that release's Python (``python -m
tests.versions._probe < REQUEST``; the repository is the working directory). Imports vLLM;
never pytest (the release's venv has kvpersist, not the test extras).

Request (JSON on stdin): ``rendered`` (``kvp-admin render --json`` of a config of this
release), ``model`` (the weights directory), ``entries`` (warm-set entries: chat and
completion requests), ``template_sha256``, ``also`` (more renderings: their ``serve`` and
``kv_transfer`` are answered under ``also``). Answer (one JSON line on stdout):

* ``version``: ``vllm.__version__``;
* ``snapshot``: every dest of the API server's parser, described as the flag table does;
* ``corpus``: vLLM's strict verdict on every spelling of :func:`_vllm_parser.corpus`;
* ``variants``: per canonical-form group, vLLM's values of each text and of the canonical
  form rendered back, compared by the launch check's own comparison;
* ``serve``: the rendered arguments parsed as the release starts vLLM (``vllm serve`` for
  0.33/0.34: the CLI's own subparser; the API server's parser for 0.32): the model, the
  extensible KV cache, the kv-transfer config;
* ``kv_transfer``: the rendered ``--kv-transfer-config`` built into the release's own
  ``KVTransferConfig``, and how it reaches the KV cache (``kv_cache_access``), with and
  without ``kv_connector_module_path``;
* ``extensible``: 0.34's decision (``VllmConfig._resolve_extensible_kv_cache``) on the same
  inputs with the CUDA platform stood in for (this machine has no GPU, and vLLM's own
  config cannot be built here: "vLLM on x86 CPUs requires Triton");
* ``tokens``: the entries' token ids through kvpersist's tokenizer (the warm-up's and
  ``forget``'s, :func:`kvpersist.stack.warm.tokens.tokenize`). 0.34's CPU platform refuses
  to build any ``VllmConfig`` on an x86 CPU without triton-cpu (which PyPI does not serve),
  so vLLM's render pipeline (its own render server's too) cannot start here; a GPU host
  takes the CUDA platform instead. Only then the probe stands in for that one platform check
  (``vllm.triton_utils.HAS_TRITON``) and says so in ``platform_stand_in``.
"""

from __future__ import annotations

import json
import shlex
import sys
from types import SimpleNamespace
from typing import Any

from kvpersist.config.engine_args import canonical_engine_args, engine_argv
from kvpersist.config.engine_flags import flags_for
from kvpersist.config.warmset import WarmEntry
from kvpersist.errors import ConfigError
from kvpersist.stack.vllm_args import COMPARE
from kvpersist.stack.warm.tokens import tokenize
from kvpersist.system import vllm_seam
from tests.integration._vllm_parser import (
    VARIANTS,
    VARIANTS_033,
    corpus,
    snapshot,
    strict,
    verdict,
    vllm_parser,
)

_SAME: dict[str, Any] = {}
exec(COMPARE, _SAME)


def _plain(v: Any) -> Any:
    """``v`` as the launch check compares it, as JSON (a dataclass: its fields)."""
    out = json.loads(json.dumps(_SAME["plain"](v), default=str))
    return out[1] if isinstance(out, list) and len(out) == 2 and isinstance(out[1], dict) \
        else out


def _variants(version: str) -> list[dict[str, Any]]:
    parser = strict(vllm_parser())
    groups = VARIANTS + (VARIANTS_033 if version != "0.32.0" else [])
    out = []
    for group in groups:
        rows = []
        for text in group:
            argv = shlex.split(text)
            theirs = vars(parser.parse_args(list(argv)))
            form = canonical_engine_args(argv, version)
            again = vars(parser.parse_args(engine_argv(form, version)))
            rows.append({"text": text, "form": form, "values": _plain(theirs),
                         "rendered_back_same": sorted(again) == sorted(theirs) and all(
                             _SAME["same"](again[d], theirs[d]) for d in theirs)})
        out.append({"group": group[0], "rows": rows})
    return out


def _serve_parse(version: str, argv: list[str]) -> dict[str, Any]:
    rel = vllm_seam.RELEASES[version]
    if rel.serve[-1] == "serve":  # vllm serve: the CLI's subparser, as its main() builds it
        from vllm.entrypoints.cli.serve import ServeSubcommand

        parts = vllm_seam.parts(version)
        parser = parts.FlexibleArgumentParser(description="vLLM CLI")
        sub = parser.add_subparsers(required=False, dest="subparser")
        ServeSubcommand().subparser_init(sub)
        args = parser.parse_args(["serve", *argv])
    else:
        args = vllm_parser().parse_args(list(argv))
    ktc = getattr(args, "kv_transfer_config", None)
    return {"model_tag": getattr(args, "model_tag", None), "model": getattr(args, "model", None),
            "tensor_parallel_size": getattr(args, "tensor_parallel_size", None),
            "block_size": getattr(args, "block_size", None),
            "served_model_name": getattr(args, "served_model_name", None),
            "enable_extensible_kv_cache": getattr(args, "enable_extensible_kv_cache", "absent"),
            "kv_transfer_config": None if ktc is None else _plain(ktc)}


def _kv_transfer(version: str, ktc: dict[str, Any]) -> dict[str, Any]:
    KVTransferConfig = vllm_seam.parts(version).KVTransferConfig  # noqa: N806
    built = KVTransferConfig(**ktc)
    out: dict[str, Any] = {"built": _plain(built)}
    if hasattr(built, "kv_cache_access"):  # 0.34: how the connector reaches the KV cache
        without = KVTransferConfig(**{k: v for k, v in ktc.items()
                                      if k != "kv_connector_module_path"})
        access = type(built.kv_cache_access())
        out["access"] = {"module_path": built.kv_cache_access().name or "IN_PROCESS",
                         "no_module_path": without.kv_cache_access().name}
        out["access_enum"] = [m.name for m in access]
        out["extensible"] = _extensible(version, built, without)
    return out


def _extensible(version: str, built: Any, without: Any) -> dict[str, Any]:
    """0.34's own decision on the extensible KV cache, for the rendered kv-transfer config
    with and without the module path, requested unset (vLLM's default) and off (what
    kvpersist renders), with ``current_platform`` a stand-in CUDA platform: the GPU is the one
    part that cannot run here."""
    import vllm.platforms
    from vllm.config import VllmConfig

    cuda = SimpleNamespace(is_cuda_alike=lambda: True, is_rocm=lambda: False)
    real = vllm.platforms.__dict__.get("current_platform")
    vllm.platforms.current_platform = cuda  # type: ignore[attr-defined]
    try:
        out = {}
        for name, ktc in (("module_path", built), ("no_module_path", without)):
            for requested in (None, False):
                holder = SimpleNamespace(
                    cache_config=SimpleNamespace(
                        _extensible_kv_cache_resolved=False,
                        enable_extensible_kv_cache=requested, kv_cache_memory_bytes=None,
                        num_gpu_blocks_override=None),
                    kv_transfer_config=ktc, lora_config=None,
                    parallel_config=SimpleNamespace(enable_elastic_ep=False))
                try:
                    VllmConfig._resolve_extensible_kv_cache(holder)
                    result: Any = holder.cache_config.enable_extensible_kv_cache
                except Exception as exc:  # noqa: BLE001 (reported as vLLM said it)
                    result = f"{type(exc).__name__}: {exc}"
                out[f"{name}, requested {requested}"] = result
        return out
    finally:
        if real is None:
            del vllm.platforms.current_platform
        else:
            vllm.platforms.current_platform = real


def main() -> None:
    req = json.load(sys.stdin)
    version = vllm_seam.installed_version_in_process()
    flags = flags_for(version)
    parser = vllm_parser()
    rendered = req["rendered"]
    strict_parser = strict(vllm_parser())
    entries = [WarmEntry(i + 1, "messages" if "messages" in e else "prompt", e)
               for i, e in enumerate(req["entries"])]
    stand_in = ""
    try:
        tok = tokenize(rendered["vllm_argv"], req["model"], entries,
                       expected_template_sha256=req["template_sha256"], source="probe")
    except ConfigError as exc:
        if "requires Triton (triton-cpu)" not in str(exc):
            raise
        import vllm.triton_utils

        vllm.triton_utils.HAS_TRITON = True  # what a GPU host's platform check passes
        stand_in = f"HAS_TRITON (without it: {exc.problems[0].message})"
        tok = tokenize(rendered["vllm_argv"], req["model"], entries,
                       expected_template_sha256=req["template_sha256"], source="probe")
    out = {
        "version": version,
        "snapshot": {d: [list(o), v] for d, (o, v) in snapshot(parser).items()},
        "corpus": {text: verdict(strict_parser, shlex.split(text))
                   for text in corpus(parser, flags)},
        "variants": _variants(version),
        "serve": _serve_parse(version, rendered["vllm_argv"]),
        "kv_transfer": _kv_transfer(version, rendered["kv_transfer_config"]),
        # other configs of this release (the shipped GPU deployment), rendered the same way
        "also": {name: {"serve": _serve_parse(version, r["vllm_argv"]),
                        "kv_transfer": _kv_transfer(version, r["kv_transfer_config"])}
                 for name, r in req.get("also", {}).items()},
        "tokens": tok.token_ids,
        "platform_stand_in": stand_in,
        "template_sha256": tok.template_sha256,
    }
    print("KVP-PROBE " + json.dumps(out, default=str))


if __name__ == "__main__":
    main()
