"""The flag table and the pure parser against the pinned vLLM's own parser (imports vLLM).

* every dest of vLLM's serve parser is in the table, described as vLLM has it, and every
  table entry still exists: a vLLM upgrade cannot slip a flag in unclassified;
* on a corpus of spellings (underscores, abbreviations, ``=``, joined short options, dotted
  keys, ``--config``, ``-tp``, ``--no-`` switches, ``-O``) the pure parser sets the dests
  vLLM sets, and refuses what vLLM refuses for its syntax;
* the canonical form of KVP_ENGINE_ARGS is equal exactly where vLLM's values are, and
  rendered back it sets the same values;
* the launch-time check (a ``python -c`` in this Python) gives vLLM's verdict.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvpersist.config.engine_args import (
    ArgsError,
    canonical_engine_args,
    canonical_value,
    engine_argv,
    parse,
)
from kvpersist.config.engine_flag_table import VLLM_VERSION
from kvpersist.config.engine_flags import FLAGS, KV
from kvpersist.stack.vllm_args import COMPARE, check_vllm_args

from ._vllm_parser import snapshot, vllm_parser

pytestmark = pytest.mark.integration


class Refused(Exception):
    pass


@pytest.fixture(scope="module")
def real() -> Any:
    """vLLM's parser with every default 'not given', refusing by exception."""
    parser = vllm_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS

    def error(message: str) -> None:
        raise Refused(message)

    parser.error = error
    return parser


def vllm_parse(parser: Any, argv: list[str]) -> dict[str, Any]:
    return dict(vars(parser.parse_args(list(argv))))


def test_installed_vllm_is_the_pinned_one() -> None:
    import vllm

    assert vllm.__version__ == VLLM_VERSION


def test_every_flag_of_vllms_parser_is_classified() -> None:
    snap = snapshot(vllm_parser())
    unclassified = {d: v for d, v in snap.items() if d not in FLAGS}
    gone = sorted(set(FLAGS) - set(snap))
    changed = {d: (snap[d], (FLAGS[d].options, FLAGS[d].value)) for d in snap
               if d in FLAGS and snap[d] != (FLAGS[d].options, FLAGS[d].value)}
    rows = "\n".join(f"    ({d!r}, {' '.join(o for o in opts if not o.startswith('--no-'))!r}, "
                     f"{v!r}, ???, 'why'),"
                     for d, (opts, v) in unclassified.items())
    assert not unclassified, ("classify these flags in kvpersist/config/engine_flag_table.py:\n"
                              f"{rows}")
    assert not gone, f"no longer in vLLM's parser: {gone}"
    assert not changed, f"described differently by vLLM (vLLM, table): {changed}"


# --------------------------------------------------------------------------- the corpus


def _sample(action: argparse.Action) -> str:
    if action.choices:
        return str(next(iter(action.choices)))
    flag = FLAGS[action.dest]
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


def corpus() -> list[str]:
    parser = vllm_parser()
    longs = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
    out: list[str] = []
    for action in parser._actions:
        flag = FLAGS[action.dest]
        if flag.action == "help" or not action.option_strings or flag.dest == "config":
            continue  # (--config reads a file: test_config_file_is_owned_whatever_it_holds)
        value = _sample(action)
        for option in action.option_strings:
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
    ]
    return out


def _syntax_error(message: str) -> bool:
    return any(s in message for s in ("unrecognized arguments", "ambiguous option",
                                      "expected one argument", "expected at least one",
                                      "ignored explicit argument", "needs a value",
                                      "IndexError", "list index out of range"))


@pytest.mark.parametrize("text", corpus())
def test_pure_parser_sets_what_vllms_parser_sets(real: Any, text: str) -> None:
    argv = shlex.split(text)
    try:
        pure = parse(argv).dests
    except ArgsError as exc:
        pure_error = str(exc)
        with pytest.raises((Refused, argparse.ArgumentError, IndexError, SystemExit)):
            vllm_parse(real, argv)
        assert pure_error
        return
    if "help" in pure:
        with pytest.raises(SystemExit):
            vllm_parse(real, argv)
        return
    try:
        theirs = sorted(vllm_parse(real, argv))
    except (Refused, argparse.ArgumentError, ValueError) as exc:
        # vLLM converts and validates values; the pure parser reads only the syntax
        assert not _syntax_error(str(exc)), f"pure parser accepted {argv}: {exc}"
        return
    assert pure == theirs


def test_config_file_is_owned_whatever_it_holds(real: Any, tmp_path: Path) -> None:
    cfg = tmp_path / "args.yaml"
    cfg.write_text("quantization: fp8\nmax-model-len: 100\nenforce-eager: true\n")
    assert sorted(vllm_parse(real, ["--config", str(cfg)])) == [
        "enforce_eager", "max_model_len", "quantization"]
    assert parse(["--config", str(cfg)]).dests == ["config"]  # owned: refused unread


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


_COMPARE: dict[str, Any] = {}
exec(COMPARE, _COMPARE)  # the launch check's comparison of parsed values


def _same(a: Any, b: Any) -> bool:
    return bool(_COMPARE["same"](a, b))


@pytest.mark.parametrize("group", VARIANTS, ids=lambda g: g[0].split()[0])
def test_canonical_form_is_equal_exactly_where_vllms_values_are(real: Any,
                                                                 group: list[str]) -> None:
    forms, values = [], []
    for text in group:
        argv = shlex.split(text)
        form = canonical_engine_args(argv)
        assert all(FLAGS[d].cls == KV for d in form)
        theirs = vllm_parse(real, argv)
        assert sorted(theirs) == sorted(form), text
        # rendered back, the canonical form sets the same values in vLLM
        again = vllm_parse(real, engine_argv(form))
        assert sorted(again) == sorted(theirs)
        assert all(_same(again[d], theirs[d]) for d in theirs), (text, engine_argv(form))
        forms.append(form)
        values.append(theirs)
    splits = []
    for (fa, va), (fb, vb) in itertools.combinations(zip(forms, values, strict=True), 2):
        same_vllm = sorted(va) == sorted(vb) and all(_same(va[d], vb[d]) for d in va)
        if fa == fb:
            assert same_vllm, (fa, va, vb)  # never one namespace for two computations
        elif same_vllm:
            splits.append((fa, fb))
    # the only spellings vLLM reads alike that get two forms: 4 and 4.0 in JSON (a harmless
    # second namespace, never a shared one)
    assert all(fa.keys() == fb.keys() and all(_json_equal(fa[d], fb[d]) for d in fa)
               for fa, fb in splits), splits


def _json_equal(a: str, b: str) -> bool:
    try:
        return a == b or json.loads(a) == json.loads(b)
    except ValueError:
        return False


def test_canonical_values_of_every_kv_flag_read_back(real: Any) -> None:
    """Every KV-affecting flag, with a sample value, survives canonical form and render."""
    parser = vllm_parser()
    for action in parser._actions:
        flag = FLAGS[action.dest]
        if flag.cls != KV:
            continue
        if flag.action in ("flag", "bool"):
            argv = [flag.name]
        elif flag.nargs == "+":
            argv = [flag.name, _sample(action)]
        else:
            argv = [f"{flag.name}={_sample(action)}"]
        try:
            theirs = vllm_parse(real, argv)
        except (Refused, argparse.ArgumentError):
            continue  # not a valid sample for this flag's type
        form = {flag.dest: canonical_value(flag, parse(argv).values[flag.dest])}
        again = vllm_parse(real, engine_argv(form))
        assert _same(again[flag.dest], theirs[flag.dest]), (argv, engine_argv(form))


# --------------------------------------------------------------------------- launch check


def test_launch_check_with_vllms_own_parser() -> None:
    env = {"VLLM_TARGET_DEVICE": "cpu", "PATH": "/usr/bin:/bin"}
    base = ["--model", "kvp-x", "--max-model-len", "4096"]
    engine_text = "--enf --hf-overrides.rope_theta 1e6"
    engine = canonical_engine_args(shlex.split(engine_text))
    extra = ["--max_num_seqs=4", "--disable-log-stats"]
    start = time.monotonic()
    ok = check_vllm_args([*base, *engine_argv(engine), *extra], extra, engine_text, engine,
                         python=sys.executable, env=env)
    seconds = time.monotonic() - start
    assert ok.problems == (), ok.problems
    assert "own parser agrees" in ok.notes[0] and seconds < 120
    # vLLM reads the KV-affecting and owned dests in the extra arguments, whatever spelling
    bad_extra = ["--kv_cache_dtype=fp8_e5m2", "--quant", "fp8"]
    bad = check_vllm_args([*base, *bad_extra], bad_extra, "", {}, python=sys.executable,
                          env=env)
    assert any("ambiguous option: --quant" in p.message for p in bad.problems), bad.problems
    bad_extra = ["--kv_cache_dtype=fp8_e5m2", "-qfp8", "--block_size", "16"]
    bad = check_vllm_args([*base, *bad_extra], bad_extra, "", {}, python=sys.executable,
                          env=env)
    text = " ".join(p.message for p in bad.problems)
    assert "owns: --block-size, --kv-cache-dtype" in text and "--quantization" in text
