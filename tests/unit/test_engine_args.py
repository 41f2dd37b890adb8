"""KVP_ENGINE_ARGS and KVP_VLLM_EXTRA_ARGS, read as vLLM's parser reads them, without vLLM:
the flag table, the pure parser, the canonical form, the namespace, render, the recipe hook
and the verdict of the launch-time check (tests/integration/test_engine_flags_vllm.py holds
the same checks against the real parser)."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import subprocess

import pytest

from kvpersist.config.engine_args import (
    ArgsError,
    canonical_engine_args,
    engine_args_problem,
    engine_argv,
    extra_args_problems,
    flexible_preprocess,
    human_readable_int,
    parse,
)
from kvpersist.config.engine_flags import CLASSES, FLAGS, KINDS, KV, NEUTRAL, OWNED, markdown
from kvpersist.config.identity import (
    IDENTITY_KEYS,
    diff_identities,
    identity_from_dict,
    identity_from_env,
    identity_problems,
)
from kvpersist.deploy import hook
from kvpersist.errors import ConfigError
from kvpersist.stack import vllm_args
from kvpersist.stack.render import render
from kvpersist.system import vllm_seam

from ..conftest import REPO
from .test_identity import BASE, jq_namespace
from .test_render import TEMPLATES, dep

GOLDEN = "kvp-dbc063b8930b41129761c0dd292652b6"  # test_identity's BASE, 14 fields


def canon(text: str) -> dict[str, str]:
    return canonical_engine_args(shlex.split(text))


# --------------------------------------------------------------------------- the table


def test_table_is_well_formed() -> None:
    seen: dict[str, str] = {}
    for dest, flag in FLAGS.items():
        assert flag.dest == dest and flag.cls in CLASSES and flag.reason.strip()
        assert "|" not in flag.reason and "\n" not in flag.reason
        assert flag.kind in KINDS or flag.action in ("help", "flag", "bool"), dest
        for option in flag.options:
            assert option not in seen, f"{option} of {dest} is also {seen[option]}'s"
            seen[option] = dest
    classes = {c: sum(f.cls == c for f in FLAGS.values()) for c in CLASSES}
    assert classes == {OWNED: 20, KV: 98, NEUTRAL: 200}


@pytest.mark.parametrize("dest", [
    "quantization", "hf_overrides", "attention_backend", "code_revision",
    "pipeline_parallel_size", "enable_lora", "max_lora_rank", "lora_modules", "tokenizer_mode",
    "enforce_eager", "compilation_config", "optimization_level", "load_format", "model_impl",
    "speculative_config", "trust_remote_code", "kv_cache_dtype_skip_layers",
    "decode_context_parallel_size", "disable_sliding_window",
])
def test_issue_examples_are_kv_affecting(dest: str) -> None:
    # (vLLM 0.32 has no --calculate-kv-scales nor --rope-*: rope settings are --hf-overrides)
    assert FLAGS[dest].cls == KV


@pytest.mark.parametrize("dest", [
    "model", "model_tag", "served_model_name", "host", "port", "uds", "tensor_parallel_size",
    "dtype", "kv_cache_dtype", "max_model_len", "block_size", "kv_transfer_config", "tokenizer",
    "revision", "tokenizer_revision", "chat_template", "config", "kv_offloading_size",
    "kv_offloading_backend", "help",
])
def test_owned_flags(dest: str) -> None:
    assert FLAGS[dest].cls == OWNED


def test_docs_carry_the_table() -> None:
    text = (REPO / "docs" / "engine-flags.md").read_text()
    block = re.search(r"<!-- flag table: generated[^\n]*-->\n\n(.*)<!-- end of flag table -->",
                      text, re.S)
    assert block, "docs/engine-flags.md lost its generated block"
    assert block.group(1) == markdown(), (
        "docs/engine-flags.md is stale: replace the block with the output of "
        "`python -m kvpersist.config.engine_flags`")


# --------------------------------------------------------------------------- the pure parser


@pytest.mark.parametrize("text,dests", [
    ("--kv_cache_dtype=fp8_e5m2 --block_size 16", ["block_size", "kv_cache_dtype"]),
    ("--max-model 100", ["max_model_len"]),
    ("--kv-transfer-config.kv_role=kv_producer", ["kv_transfer_config"]),
    ("-tp 4", ["tensor_parallel_size"]), ("-tp=4", ["tensor_parallel_size"]),
    ("-t 4", ["tensor_parallel_size"]), ("-qfp8", ["quantization"]),
    ("--no-enf", ["enforce_eager"]), ("-O3", ["optimization_level"]),
    ("-O 2", ["optimization_level"]), ("-cc.mode=3", ["compilation_config"]),
    ("--config x.yaml", ["config"]), ("positional", ["model_tag"]), ("-- --x", ["model_tag"]),
    ("--enable_prefix_caching --max_num_seqs=4", ["enable_prefix_caching", "max_num_seqs"]),
    ("--help=all", ["help"]), ("-ep -dp 2", ["data_parallel_size", "enable_expert_parallel"]),
    ("--seed -1", ["seed"]), ("--hf-token", ["hf_token"]),
])
def test_parse_reads_what_vllm_reads(text: str, dests: list[str]) -> None:
    assert parse(shlex.split(text)).dests == dests


@pytest.mark.parametrize("text,needle", [
    ("-tp4", "unrecognized arguments: -tp4"),
    ("--quant fp8", "ambiguous option: --quant"),
    ("--enforce-eager=true", "ignored explicit argument"),
    ("--max-num-seqs", "expected one argument"),
    ("--tensor_parallel", "expected one argument"),
    ("--hf-overrides.x", "needs a value"),
    ("a b", "unrecognized arguments: b"),
])
def test_parse_refuses_what_vllm_refuses(text: str, needle: str) -> None:
    with pytest.raises(ArgsError, match=re.escape(needle)):
        parse(shlex.split(text))


def test_dotted_keys_merge_into_one_json_argument() -> None:
    args = flexible_preprocess(["--hf-overrides.rope_scaling.factor", "4",
                                "--hf_overrides.rope_scaling.rope_type=yarn",
                                "--hf-overrides.rope_theta", "1e6", "--x.l+", "a,b"])
    assert args == ["--hf-overrides",
                    json.dumps({"rope_scaling": {"factor": 4, "rope_type": "yarn"},
                                "rope_theta": 1000000.0}),
                    "--x", json.dumps({"l": ["a", "b"]})]


@pytest.mark.parametrize("text,value", [("1k", 1000), ("1K", 1024), ("25.6k", 25600),
                                        ("2M", 2 << 20), (" 7 ", 7)])
def test_human_readable_int(text: str, value: int) -> None:
    assert human_readable_int(text) == value


# --------------------------------------------------------------------------- KVP_VLLM_EXTRA_ARGS


@pytest.mark.parametrize("text,needle", [
    ("--kv_cache_dtype=fp8_e5m2 --block_size 16", "owns: --block-size, --kv-cache-dtype"),
    ("--max-model 4096", "owns: --max-model-len"),
    ("--config x.yaml", "owns: --config"),
    ("--kv-offloading-size 4", "owns: --kv-offloading-size"),
    ("--uds /tmp/s", "owns: --uds"),
    ("model", "a positional argument (model_tag)"),
    ("--enforce-eager", "KV-affecting flags: --enforce-eager; they change the KV cache, so "
     "they belong in KVP_ENGINE_ARGS"),
    ("--quantization fp8 --hf-overrides.rope_theta 1e6 --attention-backend FLEX_ATTENTION",
     "KV-affecting flags: --attention-backend, --hf-overrides, --quantization"),
    ("-O3", "KV-affecting flags: --optimization-level"),
    ("--no-enf", "--enforce-eager"),
    ("--bogus", "unrecognized arguments: --bogus"),
])
def test_extra_args_refused(text: str, needle: str) -> None:
    problems = extra_args_problems(shlex.split(text))
    assert problems and needle in " ".join(problems), problems


def test_extra_args_all_problems_at_once() -> None:
    problems = extra_args_problems(shlex.split("--host x --quantization fp8 --max-num-seqs 4"))
    assert len(problems) == 2 and "owns: --host" in problems[0] and "KV" in problems[1]


@pytest.mark.parametrize("text", [
    "", "--gpu-memory-utilization 0.92", "--max-num-seqs 4 --max_num_batched_tokens=8k",
    "--disable-log-stats --api-key k1 k2", "--seed 7", "--enable-prefix-caching",
    "--middleware a --middleware b", "--tool-call-parser hermes --enable-auto-tool-choice",
])
def test_extra_args_accepted(text: str) -> None:
    assert extra_args_problems(shlex.split(text)) == []


def test_deployment_refuses_kv_flags_in_extra_args_naming_engine_key() -> None:
    with pytest.raises(ConfigError) as err:
        dep({"KVP_VLLM_EXTRA_ARGS": "--kv_cache_dtype=fp8_e5m2 --quantization=fp8"})
    (problem,) = err.value.problems
    assert problem.where.endswith("KVP_VLLM_EXTRA_ARGS")
    assert "--kv-cache-dtype" in problem.message and "KVP_ENGINE_ARGS" in problem.message


# --------------------------------------------------------------------------- canonical form


@pytest.mark.parametrize("spellings", [
    ["--quantization fp8", "--quantization=fp8", "-q fp8", "-qfp8", "-q=fp8"],
    ["--enforce-eager", "--enforce_eager", "--enf", "--enforce-e"],
    ["--no-enforce-eager", "--no-enf", "--no_enforce_eager"],
    ["--hf-overrides.rope_theta 1e6 --hf-overrides.rope_scaling.factor 4",
     "--hf-overrides='{\"rope_scaling\":{\"factor\":4},\"rope_theta\":1000000.0}'",
     "--hf_overrides '{\"rope_theta\": 1e6, \"rope_scaling\": {\"factor\": 4}}'"],
    ["-O3", "-O=3", "-O 3", "--optimization-level 3", "--optimization_level=3"],
    ["-cc.mode=3", "--compilation-config '{\"mode\":3}'", "-cc '{ \"mode\" : 3 }'"],
    ["-pp 2", "--pipeline-parallel-size=02", "--pipeline_parallel_size 2", "-pp=+2"],
    ["--enable-lora --max-loras 2", "--max_loras=2 --enable_lora"],
    ["--kv-cache-dtype-skip-layers 0 2", "--kv_cache_dtype_skip_layers 0 2"],
])
def test_spellings_vllm_reads_alike_have_one_canonical_form(spellings: list[str]) -> None:
    forms = {json.dumps(canon(s), sort_keys=True) for s in spellings}
    assert len(forms) == 1, forms


@pytest.mark.parametrize("a,b", [
    ("--quantization fp8", "--quantization awq"), ("--enforce-eager", "--no-enforce-eager"),
    ("--hf-overrides.rope_theta 1e6", "--hf-overrides.rope_theta 1e5"),
    ("--hf-overrides.rope_theta 1", "--hf-overrides.rope_theta 1.0"),  # int vs float: split
    ("-pp 2", "-pp 3"), ("--enable-lora", "--enable-lora --max-loras 2"),
])
def test_different_values_differ(a: str, b: str) -> None:
    assert canon(a) != canon(b)


def test_canonical_form_renders_and_reads_back() -> None:
    text = ("--enforce-eager --no-enable-lora -q fp8 --hf-overrides.rope_scaling.factor 4 "
            "-O3 --kv-cache-dtype-skip-layers 0 sliding_window --max-loras 2")
    form = canon(text)
    argv = engine_argv(form)
    assert argv == ["--no-enable-lora", "--enforce-eager",
                    '--hf-overrides={"rope_scaling":{"factor":4}}',
                    "--kv-cache-dtype-skip-layers", "0", "sliding_window", "--max-loras=2",
                    "--optimization-level=3", "--quantization=fp8"]
    assert canonical_engine_args(argv) == form
    assert engine_args_problem(form) == ""
    assert "not in canonical form" in engine_args_problem({"max_loras": "02"})
    assert "not valid" in engine_args_problem({"max_num_seqs": "2"})


@pytest.mark.parametrize("text,needle", [
    ("--max-num-seqs 4", "KV-neutral flags: --max-num-seqs; put them in KVP_VLLM_EXTRA_ARGS"),
    ("--max-model-len 4096", "owns: --max-model-len"),
    ("--config e.yaml", "owns: --config"),
    ("-q fp8 --quantization awq", "--quantization more than once"),
    ("--hf-overrides '{\"a\":1}' --hf-overrides.b 2", "more than once"),
    ("--max-loras 2k", "--max-loras: '2k' is not an integer"),
    ("--hf-overrides '{bad}'", "--hf-overrides: not valid JSON"),
    ("-cc mode", "--compilation-config: not valid JSON"),
    ("--hf-overrides '{\"a\":\"\\u007f\"}'", "its JSON holds"),
    ("-pp", "expected one argument"),
    ("--kv-cache-dtype-skip-layers ''", "an empty value"),
])
def test_engine_args_refused(text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=re.escape(needle)):
        canon(text)


# --------------------------------------------------------------------------- the namespace


def test_empty_engine_args_keep_the_fourteen_fields_and_every_namespace() -> None:
    for value in (None, "", "  "):
        env = dict(BASE) if value is None else dict(BASE, KVP_ENGINE_ARGS=value)
        ident = identity_from_env(env)
        assert list(ident.as_dict()) == list(IDENTITY_KEYS)
        assert ident.namespace() == GOLDEN == jq_namespace(ident.as_dict())


def test_engine_args_change_the_namespace_spellings_do_not() -> None:
    plain = identity_from_env(BASE).namespace()
    spellings = ["--quantization fp8 --enforce-eager", "-qfp8 --enf",
                 "--enforce_eager --quantization=fp8"]
    namespaces = {identity_from_env(dict(BASE, KVP_ENGINE_ARGS=s)).namespace()
                  for s in spellings}
    assert len(namespaces) == 1 and plain not in namespaces
    other = identity_from_env(dict(BASE, KVP_ENGINE_ARGS="--quantization awq --enf"))
    assert other.namespace() not in namespaces | {plain}


def test_engine_args_in_the_canonical_json_match_jq() -> None:
    env = dict(BASE, KVP_ENGINE_ARGS="--hf-overrides.rope_scaling.rope_type=yarn "
               "--hf-overrides.rope_scaling.factor=4 --hf-overrides.rope_theta=1e6 "
               "--attention-backend FLEX_ATTENTION --quantization fp8")
    ident = identity_from_env(env)
    data = ident.as_dict()
    assert data["engine_args"] == {
        "attention_backend": "FLEX_ATTENTION",
        "hf_overrides": '{"rope_scaling":{"factor":4,"rope_type":"yarn"},"rope_theta":1000000.0}',
        "quantization": "fp8"}
    assert ident.namespace() == jq_namespace(data)
    out = subprocess.run(["jq", "-cjS", "."], input=json.dumps(data, indent=2).encode(),
                         capture_output=True, check=True).stdout
    assert ident.canonical_json().encode() == out
    assert ident.namespace() == "kvp-" + hashlib.sha256(out).hexdigest()[:32]


def test_identity_round_trips_and_diffs_with_engine_args() -> None:
    ident = identity_from_env(dict(BASE, KVP_ENGINE_ARGS="-q fp8"))
    assert identity_from_dict(ident.as_dict()) == ident
    assert diff_identities(identity_from_env(BASE), ident) == [
        ("engine_args", {}, {"quantization": "fp8"})]
    for bad in ({}, {"quantization": "fp8", "max_num_seqs": "4"}, "fp8"):
        with pytest.raises(ConfigError):
            identity_from_dict(dict(ident.as_dict(), engine_args=bad))


def test_engine_args_problems_name_the_key() -> None:
    problems = identity_problems(dict(BASE, KVP_ENGINE_ARGS="--max-num-seqs 4"))
    assert [p.where for p in problems] == ["identity.env: KVP_ENGINE_ARGS"]
    assert problems[0].fix


def test_unpinned_deployment_still_refuses_bad_engine_args() -> None:
    values = {k: v for k, v in BASE.items() if k != "KVP_CHAT_TEMPLATE_SHA256"}
    with pytest.raises(ConfigError) as err:
        dep({"KVP_CHAT_TEMPLATE_SHA256": "", **dict(values, KVP_ENGINE_ARGS="--host x"),
             "KVP_ALLOW_UNPINNED": "true"})
    assert any(p.where.endswith("KVP_ENGINE_ARGS") for p in err.value.problems)


# --------------------------------------------------------------------------- render


def test_render_puts_engine_args_between_owned_flags_and_extra_args() -> None:
    d = dep({"KVP_ENGINE_ARGS": "--enf -qfp8", "KVP_VLLM_EXTRA_ARGS": "--max-num-seqs 4"})
    argv = render(d, TEMPLATES, l1_size_gb=64, l2_capacity_gb=10).vllm_argv
    i = argv.index("--kv-transfer-config")
    assert argv[i + 2:] == ["--shutdown-timeout", "20", "--enforce-eager", "--quantization=fp8",
                            "--max-num-seqs", "4"]
    assert d.identity is not None and d.namespace == d.identity.namespace()
    plain = dep({"KVP_VLLM_EXTRA_ARGS": "--max-num-seqs 4"})
    assert plain.namespace != d.namespace
    assert render(plain, TEMPLATES, l1_size_gb=64, l2_capacity_gb=10).vllm_argv[i + 2:] == [
        "--shutdown-timeout", "20", "--max-num-seqs", "4"]


@pytest.mark.parametrize("name,flags", [("cpu-demo", {"enforce_eager": "true"}),
                                        ("mimo-pro-tp4", {"trust_remote_code": "true"})])
def test_shipped_configs_keep_kv_flags_in_engine_args(name: str, flags: dict[str, str]) -> None:
    from kvpersist.config.envfile import parse_env

    values = parse_env((REPO / "configs" / name / "identity.env").read_text())
    assert canon(values["KVP_ENGINE_ARGS"]) == flags
    assert extra_args_problems(shlex.split(values.get("KVP_VLLM_EXTRA_ARGS", ""))) == []


# --------------------------------------------------------------------------- the recipe hook

PINNED = {
    "namespace": "kvp-" + "b" * 32,
    "model_link": {"dir": "/s/models", "name": "kvp-" + "b" * 32, "target": "/models/x"},
    "manifest": {"deployment": {"served_model_name": "pub"},
                 "identity": {"model_id": "x", "engine_args": {"enforce_eager": "true"}}},
    "kv_transfer_config": {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"},
}


def test_hook_accepts_the_deployments_engine_args_in_any_spelling() -> None:
    for flag in ("--enforce-eager", "--enforce_eager", "--enf"):
        out = hook.persist_argv(["python", "-m", "v", "--model", "/models/x", flag,
                                 "--max-num-seqs", "4"], PINNED)
        assert out[4] == PINNED["namespace"] and flag in out


@pytest.mark.parametrize("argv,needle", [
    (["vllm", "serve", "/models/x"], "differ from the deployment's KVP_ENGINE_ARGS for "
     "--enforce-eager"),
    (["vllm", "serve", "/models/x", "--enforce-eager", "-q", "fp8"], "--quantization"),
    (["vllm", "serve", "/models/x", "--no-enforce-eager"], "--enforce-eager"),
    (["vllm", "serve", "/models/x", "--enforce-eager", "-tp4"], "unrecognized arguments"),
])
def test_hook_refuses_other_kv_flags(argv: list[str], needle: str) -> None:
    with pytest.raises(hook.HookError, match=re.escape(needle)):
        hook.persist_argv(argv, PINNED)


# --------------------------------------------------------------------------- the launch check


def test_launch_check_request_and_verdict() -> None:
    full = ["--model", "kvp-x", "--enforce-eager", "--max-num-seqs", "4"]
    req = vllm_args.build_request(full, ["--max-num-seqs", "4"], "--enf", {"enforce_eager": "true"})
    assert req == {**vllm_seam.parser_request(),
                   "parse": {"full": full, "extra": ["--max-num-seqs", "4"],
                             "base": ["--model", "kvp-x", "--enforce-eager"],
                             "engine": ["--enf"], "engine_rendered": ["--enforce-eager"]},
                   "compare": [["base", "full"], ["engine", "engine_rendered"]]}
    good = {"version": "0.32.0", "differ": {"base full": ["max_num_seqs"],
                                            "engine engine_rendered": []},
            "parsed": {n: {"dests": []} for n in req["parse"]}}
    good["parsed"]["extra"] = {"dests": ["max_num_seqs"]}
    good["parsed"]["engine"] = {"dests": ["enforce_eager"]}
    problems, notes = vllm_args.verdict(good, req, {"enforce_eager": "true"})
    assert problems == [] and "agrees" in notes[0]
    # vLLM reads a KV-affecting dest in the extra arguments, in context, that the table
    # check did not see; another vLLM; the canonical form read differently
    bad = json.loads(json.dumps(good))
    bad["version"] = "0.33.0"
    bad["parsed"]["extra"] = {"dests": ["max_num_seqs", "monokernel"]}
    bad["differ"]["base full"] = ["max_num_seqs", "quantization"]
    bad["differ"]["engine engine_rendered"] = ["enforce_eager"]
    bad["parsed"]["full"] = {"error": "Refused: unrecognized arguments: -x"}
    problems, notes = vllm_args.verdict(bad, req, {"enforce_eager": "true"})
    text = " ".join(str(p) for p in problems)
    assert "KVP_VLLM_EXTRA_ARGS" in text and "--quantization" in text
    assert "renders differently from the text for: enforce_eager" in text
    assert "refuses the rendered vLLM command" in text
    # classified by the table of the release that answered: --monokernel is 0.33's
    assert "KV-affecting flags: --monokernel" in text and "does not classify" not in text
    with pytest.raises(ValueError, match="do not end with"):
        vllm_args.build_request(full, ["--seed", "1"], "", {})


def test_launch_check_is_skipped_without_extra_or_engine_args() -> None:
    check = vllm_args.check_vllm_args(["--model", "x"], [], "", {}, python="/nonexistent",
                                      env={})
    assert check.problems == () and check.notes == ()


def test_launch_check_that_cannot_run() -> None:
    check = vllm_args.check_vllm_args(["--model", "x", "--seed", "1"], ["--seed", "1"], "", {},
                                      python="/nonexistent/python", env={})
    assert check.problems and "cannot run vLLM's own parser" in check.problems[0].message
