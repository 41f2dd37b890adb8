"""The pinned vLLM's own argument parser, described the way kvpersist's flag table describes
it (imports vLLM: integration tests only).

:func:`vllm_parser` builds the parser exactly as ``python -m vllm.entrypoints.openai.api_server``
does (the command the launcher runs); :func:`describe` reduces one of its actions to the
``(options, value)`` pair of :class:`kvpersist.config.engine_flags.Flag`.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def vllm_parser() -> Any:
    """A fresh parser of the pinned vLLM's API server (``make_arg_parser``)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return make_arg_parser(FlexibleArgumentParser(
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
    if name == "<lambda>":
        return "str"  # a transformation of the string (choices, device lists)
    raise AssertionError(f"unknown argparse type {fn!r}: teach describe() about it")


def describe(action: argparse.Action) -> tuple[tuple[str, ...], str]:
    """(option strings, value spec) of one vLLM parser action, as the flag table writes
    them: ``help``, ``flag`` (store_true), ``bool`` (--x/--no-x), ``KIND`` (one value),
    ``KIND+`` (one or more), ``KIND?`` (an optional value, else ``True``), ``append KIND``."""
    options = tuple(action.option_strings)
    cls = type(action).__name__
    if cls == "_HelpAction":
        return options, "help"
    if cls == "BooleanOptionalAction":
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


def snapshot(parser: Any) -> dict[str, tuple[tuple[str, ...], str]]:
    """dest -> (options, value) of every action of ``parser``."""
    out: dict[str, tuple[tuple[str, ...], str]] = {}
    for action in parser._actions:
        assert action.dest not in out, f"two actions for dest {action.dest}"
        out[action.dest] = describe(action)
    return out
