"""Add persistence to an existing vLLM command line (the ``KV_PERSIST=1`` recipe hook).

``persist_argv`` is pure: given the recipe's vLLM argv and the deployment's rendering
(``kvp-admin render CONFIG --json``), it returns the argv with exactly the persistence
arguments applied:

* the model argument (``vllm serve MODEL``, ``--model MODEL`` or ``--model=MODEL``) becomes
  the namespace, a relative path resolved in the model-link directory where the namespace
  links to the weights — LMCache's model name, and every L2 file name, then carries the
  namespace;
* ``--served-model-name`` is added (the deployment's public name) if the recipe has none, so
  clients keep using the same name;
* ``--kv-transfer-config`` pointing at the deployment's cache server is appended, and the
  flags the deployment's vLLM release needs with LMCache's connector (``rendered_flags``:
  ``--disable-extensible-kv-cache`` for 0.34, docs/vllm-versions.md) — except while the
  namespace's canary has failed (the render's ``recompute``, docs/canary.md): then vLLM
  runs without the connector and recomputes, until ``kvp-admin canary reset``.

The recipe's arguments are read with the flag table of the release the rendering was made for
(``vllm.version`` of the render JSON).

Everything else is left byte-for-byte as it was. A recipe that already sets
``--kv-transfer-config``, serves other weights than the deployment's ``KVP_MODEL_PATH``, or
runs vLLM with other KV-affecting flags than the deployment's ``KVP_ENGINE_ARGS`` (read as
vLLM's parser reads them, see ``docs/engine-flags.md``) is refused (``HookError``): each
would silently mix caches or lose persistence.

``python -m kvpersist.deploy.hook RENDER_JSON_FILE -- ARGV...`` prints the new argv NUL-separated
(for ``mapfile -d ''``) — used by ``scripts/kv-persist-hook.sh``.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from kvpersist.config.engine_args import ArgsError, canonical_value, describe, parse
from kvpersist.config.engine_flags import KV, flags_for
from kvpersist.errors import EXIT_USAGE, KvpError
from kvpersist.system.untrusted import MAX_STATE_BYTES, UnreadableFile, read_json_object, show_path


class HookError(KvpError):
    """The recipe cannot be made persistent as it is (exit 2: fix the recipe)."""

    exit_code = EXIT_USAGE


def _find_model(argv: list[str]) -> tuple[int, str]:
    """Index and value of the model argument in a vLLM argv; raises HookError if none."""
    for i, arg in enumerate(argv):
        if arg == "--model" and i + 1 < len(argv):
            return i + 1, argv[i + 1]
        if arg.startswith("--model="):
            return i, arg.split("=", 1)[1]
    for i, arg in enumerate(argv):
        if arg == "serve" and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            return i + 1, argv[i + 1]
    raise HookError("cannot find the model in the vLLM command (expected `vllm serve MODEL` "
                    "or `--model MODEL`)")


def _same_path(a: str, b: str) -> bool:
    return os.path.normpath(a) == os.path.normpath(b) or (
        os.path.exists(a) and os.path.exists(b) and os.path.samefile(a, b))


def _vllm_args(argv: list[str]) -> list[str]:
    """The arguments vLLM's parser sees in a recipe's command: after ``-m MODULE`` or after
    ``serve`` (the model positional included), else after the program."""
    if "-m" in argv:
        return argv[argv.index("-m") + 2:]
    if "serve" in argv:
        return argv[argv.index("serve") + 1:]
    return argv[1:]


def _check_engine_args(argv: list[str], rendered: dict[str, Any]) -> None:
    """The recipe's KV-affecting flags must be the deployment's KVP_ENGINE_ARGS (canonical
    forms compared): the namespace names the computation. Unpinned: nothing is reused."""
    identity = rendered["manifest"].get("identity")
    if not identity:
        return
    version = _version(rendered)
    flags = flags_for(version)
    try:
        parsed = parse(_vllm_args(argv), version)
    except ArgsError as exc:
        raise HookError(f"vLLM's parser would refuse the recipe's arguments: {exc}") from exc
    mine: dict[str, str] = {}
    for dest in parsed.dests:
        if flags[dest].cls == KV:
            try:
                mine[dest] = canonical_value(flags[dest], parsed.values[dest])
            except ValueError as exc:
                raise HookError(f"the recipe's {describe(dest, version)}: {exc}") from exc
    wanted: dict[str, str] = identity.get("engine_args", {})
    if mine != wanted:
        diff = sorted(d for d in set(mine) | set(wanted) if mine.get(d) != wanted.get(d))
        raise HookError("the recipe's KV-affecting vLLM flags differ from the deployment's "
                        f"KVP_ENGINE_ARGS for {', '.join(describe(d, version) for d in diff)} "
                        "(recipe: "
                        f"{json.dumps(mine, sort_keys=True)}, KVP_ENGINE_ARGS: "
                        f"{json.dumps(wanted, sort_keys=True)}): the namespace would describe "
                        "another computation; make them agree")


def _version(rendered: dict[str, Any]) -> str | None:
    """The release a rendering was made for (None: an older rendering, 0.32.0's table)."""
    version = (rendered.get("vllm") or {}).get("version")
    return version if isinstance(version, str) else None


def _release_flags(rendered: dict[str, Any]) -> list[str]:
    flags = (rendered.get("vllm") or {}).get("rendered_flags") or []
    return [f for f in flags if isinstance(f, str)]


def persist_argv(argv: list[str], rendered: dict[str, Any]) -> list[str]:
    """The recipe's ``argv`` with the persistence arguments of ``rendered`` applied."""
    if any(a == "--kv-transfer-config" or a.startswith("--kv-transfer-config=") for a in argv):
        raise HookError("the recipe already sets --kv-transfer-config; remove it, the hook "
                        "adds the deployment's")
    try:
        owned = [d for d in parse(_vllm_args(argv), _version(rendered)).dests
                 if d == "enable_extensible_kv_cache"]
    except ArgsError:
        owned = []  # refused with its message by the engine-args check below
    if owned and _release_flags(rendered):
        raise HookError("the recipe sets --enable-extensible-kv-cache (or its negation); "
                        "remove it: the hook adds what LMCache's connector needs "
                        f"({' '.join(_release_flags(rendered))}, docs/vllm-versions.md)")
    idx, model = _find_model(argv)
    _check_engine_args(argv, rendered)
    link = rendered["model_link"]
    if not _same_path(model, link["target"]):
        raise HookError(f"the recipe serves {model!r} but the deployment's KVP_MODEL_PATH is "
                        f"{link['target']!r}: its identity would describe other weights")
    out = list(argv)
    if out[idx].startswith("--model="):
        out[idx] = f"--model={rendered['namespace']}"
    else:
        out[idx] = rendered["namespace"]
    if not any(a == "--served-model-name" or a.startswith("--served-model-name=") for a in out):
        served = rendered["manifest"]["deployment"]["served_model_name"]
        out += ["--served-model-name", served]
    if rendered.get("recompute"):  # the namespace's canary failed: no cache connector
        return [*out, *_release_flags(rendered)]
    ktc = json.dumps(rendered["kv_transfer_config"], sort_keys=True, separators=(",", ":"))
    return [*out, "--kv-transfer-config", ktc, *_release_flags(rendered)]


def read_rendered(path: str) -> dict[str, Any]:
    """The rendering at ``path`` (``kvp-admin render CONFIG --json``), read as untrusted
    (:mod:`kvpersist.system.untrusted`: a regular file, links followed, at most
    :data:`~kvpersist.system.untrusted.MAX_STATE_BYTES`, depth-limited, finite numbers) and
    checked for the fields the hook uses, each of its type. Raises HookError (exit 2) naming
    the file and the field."""
    fix = "write it again with `kvp-admin render CONFIG --json`"
    try:
        doc = read_json_object(path, max_bytes=MAX_STATE_BYTES, fix=fix)
    except FileNotFoundError:
        raise HookError(f"{show_path(path)}: no such file; {fix}") from None
    except UnreadableFile as exc:
        raise HookError(str(exc)) from None
    manifest = doc.get("manifest")
    ident = manifest.get("identity") if isinstance(manifest, dict) else None
    checks = [
        ("namespace", isinstance(doc.get("namespace"), str)),
        ("model_link.target", isinstance(doc.get("model_link"), dict)
         and isinstance(doc["model_link"].get("target"), str)),
        ("kv_transfer_config", isinstance(doc.get("kv_transfer_config"), dict)),
        ("manifest.deployment.served_model_name", isinstance(manifest, dict)
         and isinstance(manifest.get("deployment"), dict)
         and isinstance(manifest["deployment"].get("served_model_name"), str)),
        ("manifest.identity", ident is None or isinstance(ident, dict) and isinstance(
            ident.get("engine_args", {}), dict) and all(
            isinstance(v, str) for v in ident.get("engine_args", {}).values())),
    ]
    for field, ok in checks:
        if not ok:
            raise HookError(f"{show_path(path)}: {field} is missing or of the wrong type; "
                            f"{fix}")
    return doc


def split_args(args: list[str] | None, usage: str) -> tuple[str, list[str]] | None:
    """``FIRST -- REST...`` of a hook entry point's command line (``sys.argv`` when None),
    or None after printing ``usage`` (the caller exits 2)."""
    args = list(sys.argv[1:] if args is None else args)
    if len(args) < 2 or args[1] != "--":
        print(f"usage: {usage}", file=sys.stderr)
        return None
    return args[0], args[2:]


def main(args: list[str] | None = None) -> int:
    """``python -m kvpersist.deploy.hook RENDER_JSON_FILE -- ARGV...``: the new argv on
    stdout, NUL-separated; returns 0, 1 (the recipe cannot be made persistent) or 2 (a usage
    error, or a rendering that cannot be read or is not one), the message on stderr."""
    split = split_args(args, "python -m kvpersist.deploy.hook RENDER_JSON_FILE -- VLLM ARGV...")
    if split is None:
        return 2
    first, recipe = split
    try:
        rendered = read_rendered(first)
    except HookError as exc:
        print(f"kv-persist-hook: {exc}", file=sys.stderr)
        return 2
    try:
        new = persist_argv(recipe, rendered)
    except HookError as exc:
        print(f"kv-persist-hook: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write("".join(a + "\0" for a in new))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
