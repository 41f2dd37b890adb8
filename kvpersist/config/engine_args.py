"""Read vLLM arguments as the pinned vLLM's parser does, without importing vLLM (pure).

``kvp-admin`` commands that do not launch must not import vLLM (it imports torch), yet the
checks of ``KVP_VLLM_EXTRA_ARGS`` and ``KVP_ENGINE_ARGS`` must see what vLLM's parser would
set, not what a string rule guesses. So this module rebuilds vLLM's parser from the flag
table (:mod:`kvpersist.config.engine_flags`: every option string and the shape of every
value) on Python's own :mod:`argparse`, the module vLLM's ``FlexibleArgumentParser``
extends, and repeats what that subclass does to the argument list first:

* ``--config FILE`` is left as the option it is (vLLM would splice the file's arguments in:
  the flag is owned, so it is refused either way);
* in ``--key_name...`` the part before the first ``.`` and ``=`` has ``_`` read as ``-``;
* ``-O3``, ``-O=3`` and ``-O 3`` become ``--optimization-level 3``;
* dotted keys (``--hf-overrides.rope_scaling.factor 4``, ``-cc.mode=3``, ``--x.list+ a,b``)
  are merged into one JSON object per option and appended as ``--option JSON``.

argparse then resolves abbreviations (``--max-model`` is ``--max-model-len``, ``-t`` is
``-tp``), ``=`` values, joined short options (``-qfp8``), ``--no-X`` booleans and ``--``,
and refuses what vLLM's parser refuses for its syntax (unknown or ambiguous options, missing
values). It does not convert values (vLLM's types and choices): :func:`canonical_engine_args`
does that for the flags ``KVP_ENGINE_ARGS`` accepts, and the launch runs vLLM's own parser
(:mod:`kvpersist.stack.vllm_args`), which has the last word. argparse's own rules change
between Python releases: the emulation is exact when kvp-admin runs on vLLM's Python version
(tests/integration/test_engine_flags_vllm.py compares the two on ~4300 spellings).
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from typing import Any, NoReturn

from kvpersist.config.engine_flags import KV, NEUTRAL, OWNED, Flag, flags_for
from kvpersist.config.values import describe_char, forbidden_char
from kvpersist.errors import UsageError
from kvpersist.system.vllm_seam import table_version

ENGINE_KEY = "KVP_ENGINE_ARGS"
EXTRA_KEY = "KVP_VLLM_EXTRA_ARGS"


class ArgsError(UsageError, ValueError):
    """vLLM's parser would refuse the argument list (its syntax)."""


@dataclass(frozen=True)
class ParsedArgs:
    """What an argument list sets: dest -> raw value, and how often each dest was given."""

    values: dict[str, Any]
    counts: Counter[str] = field(default_factory=Counter)

    @property
    def dests(self) -> list[str]:
        return sorted(self.values)


# --------------------------------------------------------------------------- the parser


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ArgsError(message)


class _Record(argparse.Action):
    """Stores what argparse hands over, untouched, and counts the dest."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        flag: Flag = getattr(self, "kvp_flag")  # noqa: B009 (set by _parser)
        if flag.action in ("flag", "help"):
            value: Any = True
        elif flag.action == "bool":
            value = option_string not in flag.negative
        elif flag.action == "append":
            value = [*getattr(namespace, self.dest, []), values]
        else:
            value = values
        setattr(namespace, self.dest, value)
        counts = namespace.__dict__.setdefault("__counts__", Counter())
        counts[self.dest] += 1


@cache
def _parser(version: str | None) -> _Parser:
    """argparse with the option strings and arities of the release whose table reads
    ``version`` (built once per release, on first use)."""
    parser = _Parser(prog="vllm", add_help=False, allow_abbrev=True, exit_on_error=False)
    for flag in flags_for(version).values():
        kwargs: dict[str, Any] = {"action": _Record, "default": argparse.SUPPRESS}
        if flag.action in ("flag", "help", "bool"):
            kwargs["nargs"] = 0
        elif flag.nargs is not None:
            kwargs["nargs"] = flag.nargs
        if not flag.options:
            action = parser.add_argument(flag.dest, **kwargs)
        else:
            action = parser.add_argument(*flag.options, dest=flag.dest, **kwargs)
        action.kvp_flag = flag  # type: ignore[attr-defined]
    return parser


def parse(argv: Sequence[str], version: str | None = None) -> ParsedArgs:
    """What the parser of vLLM ``version`` (None: 0.32.0; an unsupported one: the newest
    table) would set for ``argv`` (raw values). Raises :class:`ArgsError`."""
    namespace = argparse.Namespace()
    try:
        _parser(version).parse_args(flexible_preprocess(list(argv)), namespace)
    except argparse.ArgumentError as exc:
        raise ArgsError(str(exc)) from exc
    values = dict(vars(namespace))
    counts = values.pop("__counts__", Counter())
    return ParsedArgs(values, counts)


# --------------------------------------------------------------------------- FlexibleArgumentParser


_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def human_readable_int(value: str) -> int:
    """vLLM's ``human_readable_int``: ``1k`` = 1000, ``1K`` = 1024, else ``int()``."""
    value = value.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if match:
        number, suffix = match.groups()
        if suffix in "kmgt":
            return int(float(number) * _DECIMAL[suffix])
        try:
            return int(number) << (10 * ("KMGT".index(suffix) + 1))
        except ValueError as exc:
            raise ValueError(f"decimals are not allowed with {suffix}") from exc
    return int(value)


def flexible_preprocess(args: list[str]) -> list[str]:
    """The argument list vLLM 0.32's ``FlexibleArgumentParser.parse_args`` hands to argparse
    (for an argument list that does not start with ``serve``; ``--config`` kept as is)."""
    processed: list[str] = []
    for i, arg in enumerate(args):
        if arg.startswith("--help="):
            processed.append("--help")
        elif arg.startswith("--"):
            if "=" in arg:
                key, value = arg.split("=", 1)
                processed.append(f"{_dashes(key)}={value}")
            else:
                processed.append(_dashes(arg))
        elif arg.startswith("-O") and arg != "-O":
            processed += ["--optimization-level", arg[3:] if arg[2] == "=" else arg[2:]]
        elif arg == "-O" and i + 1 < len(args) and args[i + 1] in {"0", "1", "2", "3"}:
            processed.append("--optimization-level")
        else:
            processed.append(arg)
    delete: set[int] = set()
    dict_args: dict[str, dict[str, Any]] = {}
    for i, arg in enumerate(processed):
        if i in delete:
            continue
        if arg.startswith("--") and "." not in arg:
            continue
        if arg.startswith("-") and "." in arg:
            if "=" in arg:
                arg, value_str = arg.split("=", 1)
                if "." not in arg:
                    continue  # the '.' was only in the value
            else:
                if i + 1 >= len(processed):
                    raise ArgsError(f"{arg} needs a value")  # vLLM: IndexError
                value_str = processed[i + 1]
                delete.add(i + 1)
            if arg.endswith("+"):
                arg = arg[:-1]
                value_str = json.dumps(list(value_str.split(",")))
            key, *keys = arg.split(".")
            parsed: Any
            try:
                parsed = json.loads(value_str)
            except json.JSONDecodeError:
                try:
                    parsed = human_readable_int(value_str)
                except (ValueError, argparse.ArgumentTypeError):
                    parsed = value_str
            nested: Any = parsed
            for k in reversed(keys):
                nested = {k: nested}
            _merge(dict_args.setdefault(key, {}), nested)
            delete.add(i)
    out = [a for i, a in enumerate(processed) if i not in delete]
    for key, merged in dict_args.items():
        out += [key, json.dumps(merged)]
    return out


def _dashes(key: str) -> str:
    """``_`` -> ``-`` from after the leading ``--`` up to the first ``.``."""
    head, dot, rest = key[2:].partition(".")
    return "--" + head.replace("_", "-") + dot + rest


def _merge(original: dict[str, Any], update: dict[str, Any]) -> None:
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(original.get(k), dict):
            _merge(original[k], v)
        elif isinstance(v, list) and isinstance(original.get(k), list):
            original[k] += v
        else:
            original[k] = v


# --------------------------------------------------------------------------- KVP_VLLM_EXTRA_ARGS


def describe(dest: str, version: str | None = None) -> str:
    """``--flag (dest)`` for messages."""
    flag = flags_for(version).get(dest)
    if flag is not None and not flag.options:
        return f"a positional argument ({dest})"
    name = flag.name if flag else dest
    return name if name.lstrip("-").replace("-", "_") == dest else f"{name} ({dest})"


def classify_dests(dests: Sequence[str], allowed: str,
                   version: str | None = None) -> list[str]:
    """Messages for every dest that may not be set where only class ``allowed`` may
    (``kv-neutral`` for the extra arguments, ``kv-affecting`` for the engine arguments), by
    the table of vLLM ``version``."""
    flags = flags_for(version)
    owned = [d for d in dests if d in flags and flags[d].cls == OWNED]
    kv = [d for d in dests if d in flags and flags[d].cls == KV]
    neutral = [d for d in dests if d in flags and flags[d].cls == NEUTRAL]
    unknown = [d for d in dests if d not in flags]

    def names(ds: list[str]) -> str:
        return ", ".join(describe(d, version) for d in ds)

    messages: list[str] = []
    if owned:
        messages.append(f"sets flags kvpersist owns: {names(owned)} "
                        "(it renders them from the configuration, or they would override "
                        "what it renders)")
    if kv and allowed != KV:
        messages.append(f"sets KV-affecting flags: {names(kv)}; they "
                        f"change the KV cache, so they belong in {ENGINE_KEY} (identity.env), "
                        "which puts them in the namespace")
    if neutral and allowed != NEUTRAL:
        messages.append(f"sets KV-neutral flags: {names(neutral)}; put "
                        f"them in {EXTRA_KEY}")
    if unknown:
        messages.append(f"sets flags the flag table of vLLM {table_version(version)} does not "
                        f"classify: {', '.join(unknown)} (another vLLM release?)")
    return messages


def extra_args_problems(argv: Sequence[str], version: str | None = None) -> list[str]:
    """Why ``KVP_VLLM_EXTRA_ARGS`` (already split into words) may not be passed to vLLM
    ``version``; [] if every flag it sets is KV-neutral."""
    if not argv:
        return []
    try:
        parsed = parse(argv, version)
    except ArgsError as exc:
        return [f"vLLM's parser would refuse them: {exc}"]
    return classify_dests(parsed.dests, NEUTRAL, version)


# --------------------------------------------------------------------------- KVP_ENGINE_ARGS


def canonical_engine_args(argv: Sequence[str], version: str | None = None) -> dict[str, str]:
    """The canonical form of ``KVP_ENGINE_ARGS`` (split into words): dest -> canonical value
    text, one entry per flag set. Spellings vLLM reads alike give the same form
    (``--quantization fp8``, ``--quantization=fp8``, ``-q fp8``, ``--hf-overrides.a 1`` and
    ``--hf-overrides '{"a": 1}'``). Raises ValueError listing every problem: a syntax vLLM
    refuses, a flag that is not KV-affecting, a flag given twice, a value vLLM cannot convert.
    The form is keyed by dest, so the same flags give the same form in every release that
    reads them alike; ``version`` only decides which spellings are read and how.
    """
    if not argv:
        return {}
    try:
        parsed = parse(argv, version)
    except ArgsError as exc:
        raise ValueError(f"vLLM's parser would refuse them: {exc}") from exc
    flags = flags_for(version)
    problems = classify_dests(parsed.dests, KV, version)
    twice = sorted(d for d, n in parsed.counts.items() if n > 1)
    if twice:
        problems.append(f"sets {', '.join(describe(d, version) for d in twice)} more than "
                        "once (dotted keys "
                        "of one option merge; otherwise give each flag once)")
    out: dict[str, str] = {}
    for dest in parsed.dests:
        flag = flags.get(dest)
        if flag is None or flag.cls != KV:
            continue
        try:
            out[dest] = canonical_value(flag, parsed.values[dest])
        except ValueError as exc:
            problems.append(f"{describe(dest, version)}: {exc}")
    if problems:
        raise ValueError("; ".join(problems))
    return dict(sorted(out.items()))


def canonical_value(flag: Flag, raw: Any) -> str:
    """The canonical text of one parsed value of ``flag`` (see :func:`canonical_engine_args`).
    Equal texts mean equal values for vLLM; raises ValueError where vLLM's conversion would
    fail."""
    if flag.action in ("flag", "bool", "help"):
        return "true" if raw else "false"
    if flag.nargs == "+" or flag.action == "append":
        if any(not str(v).strip() for v in raw):
            raise ValueError("an empty value in the list")
        items = [_scalar(flag, str(v)) for v in raw]
        return json.dumps(items, separators=(",", ":"), ensure_ascii=False)
    if flag.nargs == "?":
        return "true" if raw is True else json.dumps(_scalar(flag, raw), ensure_ascii=False)
    return _scalar(flag, str(raw))


_OBJECT = re.compile(r"(?s)^\s*{.*}\s*$")
_HUMAN_NUMBER = re.compile(r"\b\d+(?:\.\d+)?[kKmMgGtT]\b")


def _scalar(flag: Flag, raw: str) -> str:
    kind = flag.kind
    if flag.optional and raw in ("", "None"):
        return "None"
    if kind == "str":
        return raw
    if kind == "int":
        try:
            return str(int(raw))
        except ValueError:
            raise ValueError(f"{raw!r} is not an integer") from None
    if kind in ("hrint", "hrint_auto"):
        if kind == "hrint_auto" and (raw.strip() == "-1" or raw.strip().lower() == "auto"):
            return "-1"
        try:
            return str(human_readable_int(raw))
        except ValueError:
            raise ValueError(f"{raw!r} is not an integer (1k, 2M... allowed)") from None
    if kind == "float":
        try:
            number = float(raw)
        except ValueError:
            raise ValueError(f"{raw!r} is not a number") from None
        return repr(number)
    if kind == "dict_or_str" and not _OBJECT.match(raw):
        return raw
    text = raw
    if kind == "dataclass":
        parts = re.split(r'("(?:[^"\\]|\\.)*")', raw)
        for i in range(0, len(parts), 2):
            parts[i] = _HUMAN_NUMBER.sub(lambda m: str(human_readable_int(m.group())),
                                         parts[i])
        text = "".join(parts)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON ({exc.msg} at {exc.pos})") from None
    out = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    bad = forbidden_char(out)
    if bad is not None:  # an escape such as \u007f: jq would print it differently
        raise ValueError(f"its JSON holds {describe_char(bad)}")
    return out


def engine_argv(canonical: Mapping[str, str], version: str | None = None) -> list[str]:
    """vLLM arguments that set exactly the canonical ``KVP_ENGINE_ARGS`` (sorted by dest):
    what the launcher passes, so vLLM runs what the namespace describes. A false on/off
    flag is ``--no-X``, which every supported release reads. Raises KeyError for a dest
    release ``version`` does not have."""
    out: list[str] = []
    flags = flags_for(version)
    for dest, text in sorted(canonical.items()):
        flag = flags[dest]
        if flag.action == "bool":
            out.append(flag.name if text == "true" else "--no-" + flag.name[2:])
        elif flag.action == "flag":
            out.append(flag.name)
        elif flag.nargs == "+":
            out += [flag.name, *json.loads(text)]
        elif flag.action == "append":
            out += [f"{flag.name}={v}" for v in json.loads(text)]
        elif flag.nargs == "?":
            out.append(flag.name if text == "true" else f"{flag.name}={json.loads(text)}")
        else:
            out.append(f"{flag.name}={text}")
    return out


def engine_args_problem(canonical: Mapping[str, Any], version: str | None = None) -> str:
    """Why a stored ``engine_args`` object (a manifest's) is not a canonical form, or ''."""
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in canonical.items()):
        return "engine_args must map flag names to strings"
    try:
        again = canonical_engine_args(engine_argv(canonical, version), version)
    except (KeyError, ValueError) as exc:
        return f"engine_args is not valid: {exc}"
    return "" if again == dict(canonical) else "engine_args is not in canonical form"
