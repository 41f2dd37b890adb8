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
from kvpersist.config.engine_flags import FLAGS, KV
from kvpersist.stack.vllm_args import COMPARE, check_vllm_args
from kvpersist.system.vllm_seam import DEFAULT_VERSION

from ._vllm_parser import (
    VARIANTS,
    Refused,
    _sample,
    corpus,
    coverage_problems,
    snapshot,
    strict,
    syntax_error,
    vllm_parser,
)

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def real() -> Any:
    """vLLM's parser with every default 'not given', refusing by exception."""
    return strict(vllm_parser())


def vllm_parse(parser: Any, argv: list[str]) -> dict[str, Any]:
    return dict(vars(parser.parse_args(list(argv))))


def test_installed_vllm_is_the_pinned_one() -> None:
    import vllm

    assert vllm.__version__ == DEFAULT_VERSION


def test_every_flag_of_vllms_parser_is_classified() -> None:
    problems = coverage_problems(snapshot(vllm_parser()), FLAGS, DEFAULT_VERSION)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("text", corpus(vllm_parser(), FLAGS))
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
        assert not syntax_error(str(exc)), f"pure parser accepted {argv}: {exc}"
        return
    assert pure == theirs


def test_config_file_is_owned_whatever_it_holds(real: Any, tmp_path: Path) -> None:
    cfg = tmp_path / "args.yaml"
    cfg.write_text("quantization: fp8\nmax-model-len: 100\nenforce-eager: true\n")
    assert sorted(vllm_parse(real, ["--config", str(cfg)])) == [
        "enforce_eager", "max_model_len", "quantization"]
    assert parse(["--config", str(cfg)]).dests == ["config"]  # owned: refused unread


# --------------------------------------------------------------------------- canonical form

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
            argv = [flag.name, _sample(action, flag)]
        else:
            argv = [f"{flag.name}={_sample(action, flag)}"]
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
