"""The installed vLLM's own argument parser, described the way kvpersist's flag tables
describe it (imports vLLM: integration tests, and ``tests/versions/_probe.py`` in a venv
with another release; never pytest, so that the probe runs where pytest is not installed).

:func:`vllm_parser` builds the parser of the installed release exactly as its API server
does (``make_arg_parser(FlexibleArgumentParser())``, found through kvpersist's seam);
:func:`describe` reduces one of its actions to the ``(options, value)`` pair of
:class:`kvpersist.config.engine_flags.Flag` (every spelling the parser registers, the ones
``EnableDisableAction`` hides from help included); :func:`coverage_problems` compares a
parser with a flag table; :func:`corpus` and :data:`VARIANTS` are the spellings the pure
parser and the canonical form are tested on.
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Mapping
from typing import Any

from kvpersist.config.engine_flags import Flag
from kvpersist.system import vllm_seam

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def vllm_parser() -> Any:
    """A fresh parser of the installed vLLM's API server (``make_arg_parser``)."""
    parts = vllm_seam.parts(vllm_seam.installed_version_in_process())
    return parts.make_arg_parser(parts.FlexibleArgumentParser(
        description="vLLM OpenAI-Compatible RESTful API server."))


def _type_kind(fn: Any) -> str:
    """The value kind of an argparse ``type`` callable, looking through vLLM's wrappers."""
    if fn is None or fn is str:
        return "str"
    name = getattr(fn, "__name__", "")
    if fn is int:
        return "int"
    if fn is float:
        return "float"
    inner = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ())
             if callable(getattr(c, "cell_contents", None))]
    if name == "_optional_type":
        return _type_kind(inner[0]) + "|none"
    if name == "_parse_type":
        return _type_kind(inner[0])
    if name == "loads":
        return "json"
    if name == "parse_dataclass":
        return "dataclass"
    if name == "union_dict_and_str":
        return "dict_or_str"
    if name == "human_readable_int":
        return "hrint"
    if name == "human_readable_int_or_auto":
        return "hrint_auto"
    if name == "parse_reasoning_parser":
        return "str"  # 0.33+: the text, with 'none' read as unset (a kv-neutral flag)
    if name == "<lambda>":
        return "str"  # a transformation of the string (choices, device lists)
    raise AssertionError(f"unknown argparse type {fn!r}: teach describe() about it")


def spellings(parser: Any, action: argparse.Action) -> tuple[str, ...]:
    """Every option string ``parser`` registers for ``action``, in registration order (vLLM's
    EnableDisableAction keeps ``--no-X`` registered but out of ``option_strings``)."""
    return tuple(o for o, a in parser._option_string_actions.items() if a is action)


def describe(action: argparse.Action, parser: Any) -> tuple[tuple[str, ...], str]:
    """(option strings, value spec) of one vLLM parser action, as the flag table writes
    them: ``help``, ``flag`` (store_true), ``bool`` (--x/--no-x, and 0.33's --enable-x/
    --disable-x), ``KIND`` (one value), ``KIND+`` (one or more), ``KIND?`` (an optional
    value, else ``True``), ``append KIND``."""
    options = spellings(parser, action)
    cls = type(action).__name__
    if cls == "_HelpAction":
        return options, "help"
    if cls in ("BooleanOptionalAction", "EnableDisableAction"):
        return options, "bool"
    if cls in ("_StoreTrueAction",):
        return options, "flag"
    kind = _type_kind(action.type)
    if cls == "_AppendAction":
        assert action.nargs is None
        return options, f"append {kind}"
    assert cls in ("_StoreAction", "LoRAParserAction", "DeprecatedLogConfigFileAction"), cls
    if action.nargs is None:
        return options, kind
    if action.nargs == "+":
        return options, kind + "+"
    if action.nargs == "?":
        assert action.const is True or not options, (action.dest, action.const)
        return options, kind + "?"
    raise AssertionError(f"{action.dest}: nargs {action.nargs!r} is not in the flag table's "
                         "vocabulary")


Snapshot = dict[str, tuple[tuple[str, ...], str]]


def snapshot(parser: Any) -> Snapshot:
    """dest -> (options, value) of every action of ``parser``."""
    out: Snapshot = {}
    for action in parser._actions:
        assert action.dest not in out, f"two actions for dest {action.dest}"
        out[action.dest] = describe(action, parser)
    return out


def coverage_problems(snap: Mapping[str, tuple[tuple[str, ...], str]],
                      flags: Mapping[str, Flag], version: str) -> list[str]:
    """Why the flag table ``flags`` of release ``version`` does not describe a parser whose
    :func:`snapshot` is ``snap``: a destination it does not classify (with the row to add),
    a spelling it does not know, one it has that vLLM does not, another value shape."""
    out = []
    for dest, (opts, value) in snap.items():
        if dest not in flags:
            shown = " ".join(o for o in opts if not o.startswith("--no-"))
            out.append(f"vLLM {version} has {dest} ({shown}, {value}): classify it in "
                       "kvpersist/config/engine_flag_changes.py as "
                       f"({dest!r}, {shown!r}, {value!r}, ???, 'why')")
            continue
        flag = flags[dest]
        if set(opts) - set(flag.options):
            out.append(f"vLLM {version} spells {dest} also "
                       f"{' '.join(sorted(set(opts) - set(flag.options)))}: not in the table")
        if set(flag.options) - set(opts):
            out.append(f"the table spells {dest} also "
                       f"{' '.join(sorted(set(flag.options) - set(opts)))}: vLLM {version} "
                       "does not")
        if tuple(opts) != flag.options and set(opts) == set(flag.options):
            out.append(f"{dest}: spellings in another order (abbreviations resolve alike, "
                       "but the table should follow vLLM)")
        if value != flag.value:
            out.append(f"{dest}: vLLM {version} reads a {value} value, the table a "
                       f"{flag.value}")
    out += [f"the table has {dest}, vLLM {version} does not" for dest in flags if dest not in snap]
    return out


# --------------------------------------------------------------------------- the corpus


def _sample(action: argparse.Action, flag: Flag) -> str:
    if action.choices:
        return str(next(iter(action.choices)))
    return {"int": "2", "float": "0.5", "hrint": "1k", "hrint_auto": "2k",
            "json": '{"a": 1}', "dataclass": "{}", "dict_or_str": '{"a": 1}'}.get(flag.kind, "x")


def _prefixes(option: str, options: list[str]) -> list[str]:
    """The shortest unambiguous abbreviation of a long option, and an ambiguous one."""
    out = []
    for n in range(3, len(option)):
        prefix = option[:n]
        matches = [o for o in options if o.startswith(prefix)]
        if matches == [option]:
            out.append(prefix)
            break
        if len(matches) > 1 and not out:
            out.append(prefix)
    return out


def corpus(parser: Any, flags: Mapping[str, Flag]) -> list[str]:
    """Spellings of every flag of ``parser`` (underscores, abbreviations, ``=``, joined short
    options, dotted keys, every registered negation) and a fixed list of awkward ones."""
    longs = [o for o in parser._option_string_actions if o.startswith("--")]
    out: list[str] = []
    for action in parser._actions:
        flag = flags[action.dest]
        if flag.action == "help" or not action.option_strings or flag.dest == "config":
            continue  # (--config reads a file: test_config_file_is_owned_whatever_it_holds)
        value = _sample(action, flag)
        for option in spellings(parser, action):
            spelled = [option]
            if option.startswith("--"):
                spelled.append("--" + option[2:].replace("-", "_"))
                spelled += _prefixes(option, longs)
            for s in spelled:
                if flag.action in ("flag", "bool"):
                    out += [s, f"{s}=1"]
                elif flag.nargs == "+":
                    out += [f"{s} {value} {value}", f"{s}={value}", s]
                elif flag.nargs == "?":
                    out += [s, f"{s} {value}", f"{s}={value}"]
                else:
                    out += [f"{s} {shlex.quote(value)}", f"{s}={shlex.quote(value)}", s]
            if not option.startswith("--") and flag.action == "store" and flag.nargs is None:
                out.append(f"{option}{value}")  # joined short option: -qfp8, -tp4
        if flag.kind in ("json", "dataclass", "dict_or_str"):
            out += [f"{flag.name}.a 1", f"{flag.name}.a.b=x {flag.name}.c+ 1,2",
                    f"{flag.name.replace('-', '_')}.a 1"]
    out += [
        "--kv_cache_dtype=fp8_e5m2 --block_size 16", "--max-model 100", "-tp4", "-tp=4",
        "-t 4", "--quant fp8", "-qfp8", "--no-enf", "--enforce-eager=true", "-O3", "-O=3",
        "-O 3", "-O", "-Odecode", "positional", "-- --x", "a b", "--seed -1", "--seed=-1",
        "-1", "--hf-token", "--hf-token abc", "--kv-transfer-config.kv_role kv_both",
        "--hf-overrides.rope_scaling.factor 4 --hf-overrides.rope_theta 1e6",
        "-cc.mode=3 -cc.cudagraph_capture_sizes+ 1,2", "--lora-modules a=b c=d",
        "--middleware a --middleware b", "--help=all", "-h", "--api-key a b --port 9000",
        "--enable-lora --max-loras 2 --max_lora_rank=16", "-ep -dp 2 -dph",
        "--no-data-parallel-hybrid-lb", "--quantization fp8 --quantization awq",
        "--served-model-name a b --max-num-seqs 4", "-asc 2", "-pcp 2 -dcp 2",
        "--device-memory-utilization 0.5", "--optimization-level 2 -O3",
        # 0.33+: EnableDisableAction's pairs and their abbreviations
        "--disable-prefix-caching", "--disable-prefix", "--enable-sliding-window",
        "--enable-sli", "--disable-chunked-prefill --enable-prefix-caching",
        "--disable-lora", "--disable-expert-parallel -ep",
    ]
    return out


def syntax_error(message: str) -> bool:
    return any(s in message for s in ("unrecognized arguments", "ambiguous option",
                                      "expected one argument", "expected at least one",
                                      "ignored explicit argument", "needs a value",
                                      "IndexError", "list index out of range"))


class Refused(Exception):
    pass


def strict(parser: Any) -> Any:
    """``parser`` with every default 'not given' and refusing by exception."""
    for action in parser._actions:
        action.default = argparse.SUPPRESS

    def error(message: str) -> None:
        raise Refused(message)

    parser.error = error
    return parser


def verdict(parser: Any, argv: list[str]) -> dict[str, Any]:
    """What the strict ``parser`` makes of ``argv``: {"dests"} or {"refused"} (a syntax or
    value refusal, with its text) or {"exit"} (help)."""
    try:
        return {"dests": sorted(vars(parser.parse_args(list(argv))))}
    except SystemExit:
        return {"exit": True}
    except (Refused, argparse.ArgumentError, ValueError, IndexError) as exc:
        return {"refused": f"{type(exc).__name__}: {exc}"}


# --------------------------------------------------------------------------- canonical form

VARIANTS = [
    ["--quantization fp8", "--quantization=fp8", "-q fp8", "-qfp8", "-q=fp8",
     "--quantization awq", "--quantization ''", "--quantization None"],
    ["--enforce-eager", "--enforce_eager", "--enf", "--no-enforce-eager", "--no-enf"],
    ["--hf-overrides.rope_theta 1e6 --hf-overrides.rope_scaling.factor 4",
     "--hf-overrides '{\"rope_scaling\":{\"factor\":4},\"rope_theta\":1000000.0}'",
     "--hf-overrides '{\"rope_scaling\":{\"factor\":4.0},\"rope_theta\":1e6}'",
     "--hf-overrides.rope_theta 1e5", "--hf-overrides yarn", "--hf-overrides ' {\"a\": 1} '"],
    ["-O3", "-O=3", "-O 3", "--optimization-level 3", "--optimization_level=3", "-O2",
     "-O0"],
    ["-cc.mode=3", "--compilation-config '{\"mode\":3}'", "-cc '{ \"mode\" : 3 }'",
     "-cc '{\"mode\": 0}'", "-cc '{\"max_cudagraph_capture_size\": 1k}'",
     "-cc.max_cudagraph_capture_size=1000"],
    ["-pp 2", "--pipeline-parallel-size=02", "--pipeline_parallel_size 2", "-pp 3"],
    ["--max-loras 2", "--max_loras=2", "--max-loras 3"],
    ["--kv-cache-dtype-skip-layers 0 2", "--kv_cache_dtype_skip_layers 0 2",
     "--kv-cache-dtype-skip-layers 0", "--kv-cache-dtype-skip-layers 2 0"],
    ["--attention-backend FLEX_ATTENTION", "--attention_backend=FLEX_ATTENTION",
     "--attention-backend TRITON_ATTN"],
    ["--mamba-block-size 8", "--mamba-block-size ''", "--mamba-block-size None",
     "--mamba-block-size 16"],
    ["--speculative-config.method ngram --speculative-config.num_speculative_tokens 3",
     "--speculative-config '{\"num_speculative_tokens\": 3, \"method\": \"ngram\"}'",
     "-sc '{\"method\": \"ngram\"}'"],
    ["--video-pruning-rate 0.5", "--video-pruning-rate .50", "--video-pruning-rate 0.25"],
]

#: the same, for the spellings only 0.33 and later read (EnableDisableAction)
VARIANTS_033 = [
    ["--disable-sliding-window", "--enable-sliding-window", "--no-disable-sliding-window",
     "--enable-sli"],
    ["--enable-hybrid-kv-cache-manager", "--no-disable-hybrid-kv-cache-manager",
     "--disable-hybrid-kv-cache-manager"],
    ["--monokernel", "--no-monokernel"],
]
