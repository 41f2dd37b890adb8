"""Hostile model directories: every file kvpersist reads from a model directory (config.json,
the tokenizer and processor configs, the chat templates, a --local-dir download's records),
a chat template given to ``template-sha``, and the weights digest cache and manifest in the
state dir are untrusted.

Each input runs through the real CLI under tests/hostile.py's bounds (RLIMIT_AS 512 MiB, an
alarm, 1 MB of output) with ``identity derive DIR`` (text and ``--json``), ``identity check``
(KVP_MODEL_PATH at the directory), ``identity template-sha FILE`` and ``weights``. Every run is
bounded (no traceback, no hang, no MemoryError) and ends in the verdict its input deserves:
exit 2 naming the file and why, or the field unknown (REQUIRED in derive, a mismatch in
check) naming the key and why; never the fallback value (64 for a head_dim of the wrong type)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpersist.config.identity import IDENTITY_KEYS
from kvpersist.config.modeldir import walk_files
from kvpersist.demo.model import CPU_DEMO_REVISION
from kvpersist.errors import ConfigError
from kvpersist.stack.weights import MAX_CACHE_BYTES
from kvpersist.system.untrusted import (
    MAX_MODEL_JSON_BYTES,
    MAX_RECORD_BYTES,
    MAX_STATE_BYTES,
    MAX_TEMPLATE_BYTES,
)

from ..conftest import clean_env, free_port
from ..hostile import HostileRunner, Outcome, assert_all_bounded
from ..model_dirs import DEMO_CONFIG, demo_files, local_dir, plain_dir

#: a check of one outcome: what is wrong with it (nothing: the verdict is right)
Check = Callable[[Outcome], list[str]]


@dataclass(frozen=True)
class Case:
    """One hostile input run by one command, and the verdict it must get."""

    family: str
    label: str
    argv: tuple[str, ...]
    check: Check
    env: dict[str, str] | None = None


@pytest.fixture(scope="module")
def runner() -> Iterator[HostileRunner]:
    with HostileRunner() as r:
        yield r


def run_cases(runner: HostileRunner, cases: list[Case]) -> list[tuple[Case, Outcome]]:
    """Run every case; fail with every rule broken and every wrong verdict."""
    return judge([(c, runner.run(*c.argv, env=c.env)) for c in cases])


def run_apart(cases: list[Case]) -> list[tuple[Case, Outcome]]:
    """Run cases that last until a time bound stops them each in a runner of its own, all
    at once (their waits overlap); judged as :func:`run_cases` does."""
    def one(case: Case) -> tuple[Case, Outcome]:
        with HostileRunner() as r:
            return case, r.run(*case.argv, env=case.env)

    with ThreadPoolExecutor(len(cases)) as pool:
        return judge(list(pool.map(one, cases)))


def judge(done: list[tuple[Case, Outcome]]) -> list[tuple[Case, Outcome]]:
    """Fail with every rule broken and every wrong verdict of ``done``."""
    assert_all_bounded([o for _, o in done])
    wrong = [f"{c.label}: kvp-admin {' '.join(c.argv)}: {p}" for c, o in done for p in c.check(o)]
    assert not wrong, f"{len(wrong)} of {len(done)} verdicts are wrong:\n" + "\n".join(wrong[:30])
    return done


# --------------------------------------------------------------------------- verdicts


def _doc(o: Outcome) -> dict[str, Any]:
    try:
        doc = json.loads(o.stdout)
    except ValueError:
        return {}
    return doc if isinstance(doc, dict) else {}


def refused(*words: str) -> Check:
    """Exit 2 with every word on stderr (the file and why); with --json the error
    document."""
    def check(o: Outcome) -> list[str]:
        bad = [f"exit {o.code}, expected 2"] if o.code != 2 else []
        missing = [w for w in words if w not in o.stderr]
        if missing:
            bad.append(f"stderr lacks {missing}: {o.stderr[-800:]}")
        if "--json" in o.argv and _doc(o).get("schema") != "kvpersist.error/1":
            bad.append(f"no error document: {o.stdout[:300]}")
        return bad
    return check


def unknown(name: str, *words: str) -> Check:
    """derive: exit 1, ``name`` unknown (empty under REQUIRED; null in --json) with every
    word in why."""
    key = IDENTITY_KEYS[name]

    def check(o: Outcome) -> list[str]:
        if o.code != 1:
            return [f"exit {o.code}, expected 1 (REQUIRED): {o.stderr[-500:]}"]
        if "--json" in o.argv:
            got = _doc(o).get("fields", {}).get(name, {})
            if got.get("value") is not None:
                return [f"{name} is {got.get('value')!r}, expected unknown"]
            why = str(got.get("note", ""))
        else:
            lines = [ln for ln in o.stderr.splitlines() if ln.startswith(f"REQUIRED: {key}: ")]
            if not lines or f"\n{key}=\n" not in o.stdout:
                return [f"{key} is not left empty under REQUIRED: {o.stdout[-800:]}"]
            why = lines[0]
        missing = [w for w in words if w not in why]
        return [f"{name}'s reason lacks {missing}: {why}"] if missing else []
    return check


def malformed(name: str, *words: str) -> Check:
    """identity check --json: ``name`` a mismatch (exit 1: the model states a value vLLM
    could not use as it is) with every word in why."""
    def check(o: Outcome) -> list[str]:
        got = _doc(o).get("fields", {}).get(name, {})
        if o.code != 1 or got.get("status") != "mismatch" or got.get("found") is not None:
            return [f"exit {o.code}, {name} is {got.get('status')!r}, expected a mismatch "
                    f"with nothing found: {o.stderr[-300:]}"]
        missing = [w for w in words if w not in str(got.get("detail", ""))]
        return [f"{name}'s reason lacks {missing}: {got.get('detail')}"] if missing else []
    return check


def unchecked(name: str, *words: str) -> Check:
    """identity check --json: ``name`` unchecked (never ok) with every word in why."""
    def check(o: Outcome) -> list[str]:
        got = _doc(o).get("fields", {}).get(name, {})
        if o.code not in (0, 1) or got.get("status") != "unchecked":
            return [f"exit {o.code}, {name} is {got.get('status')!r}, expected unchecked: "
                    f"{o.stderr[-300:]}"]
        missing = [w for w in words if w not in str(got.get("detail", ""))]
        return [f"{name}'s reason lacks {missing}: {got.get('detail')}"] if missing else []
    return check


def derived_as(name: str, value: object) -> Check:
    """derive --json: ``name`` derived as ``value``."""
    def check(o: Outcome) -> list[str]:
        got = _doc(o).get("fields", {}).get(name, {}).get("value")
        return [] if got == value else [f"{name} is {got!r}, expected {value!r}"]
    return check


def all_of(*checks: Check) -> Check:
    """Every one of ``checks``."""
    return lambda o: [p for c in checks for p in c(o)]


def exits(code: int, *words: str) -> Check:
    """Exit ``code`` with every word in stdout or stderr."""
    def check(o: Outcome) -> list[str]:
        bad = [f"exit {o.code}, expected {code}: {o.stderr[-500:]}"] if o.code != code else []
        missing = [w for w in words if w not in o.stdout + o.stderr]
        return bad + ([f"output lacks {missing}"] if missing else [])
    return check


def deployment_env(tmp: Path, model: Path) -> dict[str, str]:
    """cpu-demo relocated (its own cache root, free ports) with KVP_MODEL_PATH at ``model``."""
    return dict(clean_env(), KVP_CACHE_ROOT=str(tmp / "cache"), KVP_MODEL_PATH=str(model),
                KVP_LMCACHE_PORT=str(free_port()), KVP_LMCACHE_HTTP_PORT=str(free_port()),
                KVP_VLLM_PORT=str(free_port()))


# --------------------------------------------------------------------------- hostile files

JSON_FILES = ("config.json", "tokenizer_config.json", "chat_template.json",
              "processor_config.json", "hf_quant_config.json")
TEMPLATE_FILES = ("chat_template.jinja", "additional_chat_templates/default.jinja")
#: kind -> the words its refusal names
FILE_KINDS = {"fifo": "a FIFO", "dev-zero": "a character device",
              "directory": "a directory", "oversize": "larger than",
              "non-utf8": "not UTF-8"}
JSON_KINDS = {"deep-100000": "nested deeper", "deep-65": "nested 65 levels deep",
              "nan": "NaN", "infinity": "-Infinity", "1e309": "out of range",
              "not-an-object": "not a JSON object"}


def plant(path: Path, kind: str, cap: int) -> None:
    """Make ``path`` the hostile ``kind`` of file (a sparse file just past ``cap`` for
    ``oversize``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.is_symlink() or path.is_file():
        path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    elif kind == "directory":
        path.mkdir()
    elif kind == "oversize":
        with open(path, "wb") as f:
            f.truncate(cap + 1)
    else:
        data = {"non-utf8": b'{"a": "\xff\xfe"}',
                "deep-100000": b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
                "deep-65": b'{"a":' * 65 + b"1" + b"}" * 65, "nan": b'{"a": NaN}',
                "infinity": b'{"a": -Infinity}', "1e309": b'{"a": 1e309}',
                "not-an-object": b"[1]"}[kind]
        if path.name == "config.json" and kind in ("nan", "infinity", "1e309"):
            value = {"nan": "NaN", "infinity": "-Infinity", "1e309": "1e309"}[kind]
            data = json.dumps(DEMO_CONFIG).replace('"head_dim": 64',
                                                   f'"head_dim": {value}').encode()
        path.write_bytes(data)


def file_cases(tmp: Path) -> list[Case]:
    out: list[Case] = []
    for name in JSON_FILES + TEMPLATE_FILES:
        is_json = name.endswith(".json")
        kinds = {**FILE_KINDS, **(JSON_KINDS if is_json else {})}
        for kind, why in kinds.items():
            d = plain_dir(tmp / f"{name.replace('/', '-')}-{kind}")
            plant(d / name, kind, MAX_MODEL_JSON_BYTES if is_json else MAX_TEMPLATE_BYTES)
            label = f"{name} {kind}"
            shown = str(d / name)
            env = deployment_env(tmp / f"dep-{name.replace('/', '-')}-{kind}", d)
            out += [Case("model file", label, ("identity", "derive", str(d)), refused(shown, why)),
                    Case("model file", label, ("identity", "derive", str(d), "--json"),
                         refused(shown, why))]
            # check reads the directory as derive does: every kind of file once, every kind
            # of JSON in config.json
            if kind in FILE_KINDS or name == "config.json":
                out.append(Case("model file", label, ("identity", "check", "cpu-demo"),
                                refused(shown, why), env))
            # weights hashes the bytes of the top-level files, whatever they say: what it
            # cannot read is refused, a directory is not a file of the model
            if "/" not in name and kind in ("fifo", "dev-zero", "directory"):
                out.append(Case("model file", label, ("weights", "cpu-demo"),
                                refused(shown, "not a regular file") if kind != "directory"
                                else exits(0), env))
    return out


def test_hostile_model_files_are_refused_naming_the_file(runner: HostileRunner,
                                                         tmp_path: Path) -> None:
    run_cases(runner, file_cases(tmp_path))


def test_every_problem_of_a_directory_is_listed_at_once(runner: HostileRunner,
                                                        tmp_path: Path) -> None:
    d = plain_dir(tmp_path / "m")
    plant(d / "config.json", "fifo", 0)
    plant(d / "tokenizer_config.json", "deep-100000", 0)
    plant(d / "chat_template.jinja", "dev-zero", 0)
    words = [str(d / "config.json"), "a FIFO", str(d / "tokenizer_config.json"),
             "nested deeper", str(d / "chat_template.jinja"), "a character device",
             "3 configuration problem(s)"]
    run_cases(runner, [Case("model file", "three at once", ("identity", "derive", str(d)),
                            refused(*words))])


# --------------------------------------------------------------------------- template-sha


def template_file_cases(tmp: Path) -> list[Case]:
    out: list[Case] = []
    for kind, why in {**FILE_KINDS, **JSON_KINDS}.items():
        if kind in ("directory", "not-an-object"):
            continue  # below: the argument must be a file; "[1]" is a template
        f = tmp / "ts" / f"{kind}-tokenizer_config.json"
        plant(f, kind, MAX_MODEL_JSON_BYTES)
        out.append(Case("template-sha file", kind, ("identity", "template-sha", str(f)),
                        refused(str(f), why)))
    (tmp / "ts" / "a-directory").mkdir()
    empty = tmp / "ts" / "no-template.json"
    empty.write_text('{"bos_token": "<s>"}')
    out += [Case("template-sha file", "directory",
                 ("identity", "template-sha", str(tmp / "ts" / "a-directory")),
                 refused("is a directory")),
            Case("template-sha file", "missing",
                 ("identity", "template-sha", str(tmp / "ts" / "none.jinja")),
                 refused("does not exist")),
            Case("template-sha file", "no chat_template", ("identity", "template-sha",
                                                           str(empty)),
                 refused(str(empty), "has no chat_template"))]
    return out


def test_hostile_template_files_are_refused_naming_the_file(runner: HostileRunner,
                                                            tmp_path: Path) -> None:
    run_cases(runner, template_file_cases(tmp_path))


# --------------------------------------------------------------------------- templates

#: name -> (template, what the reason says); these end in well under a second
FAST_TEMPLATES = {
    "zero-division": ("{{ 1 / 0 }}", "ZeroDivisionError"),
    "big-multiply": ("{{ 'x' * 10**10 }}", "MiB of memory"),
    "center": ("{{ 'x'|center(10**10) }}", "MiB of memory"),
    "macro-recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                        "RecursionError"),
    "undefined-attribute": ("{{ messages.nope.deeper }}", "UndefinedError"),
    "raise-exception": ("{{ raise_exception('refused by the template') }}",
                        "refused by the template"),
    "huge-output": ("{% for a in range(2000) %}{{ 'x' * 1000 }}{% endfor %}",
                    "more than 1,048,576 bytes"),
    "syntax": ("{% for %}", "TemplateSyntaxError"),
    "unknown-filter": ("{{ 1|nofilter }}", "TemplateAssertionError"),
    "sandbox-escape": ("{{ ''.__class__.__mro__ }}", "SecurityError"),
    "range-too-big": ("{% for a in range(10**9) %}{% endfor %}", "OverflowError"),
}
#: these run until the wall-clock bound (5 s) stops them: tried with fewer commands
SLOW_TEMPLATES = {
    "huge-loops": ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}"
                   "{% endfor %}", "still running after 5 s"),
    "big-pow": ("{{ 10 ** (10 ** 8) }}", "still running after 5 s"),
}


def template_cases(tmp: Path, templates: dict[str, tuple[str, str]]) -> list[Case]:
    out: list[Case] = []
    for name, (text, why) in templates.items():
        fast = name in FAST_TEMPLATES
        f = tmp / "tpl" / f"{name}.jinja"
        f.parent.mkdir(exist_ok=True)
        f.write_text(text)
        d = plain_dir(tmp / f"tpl-{name}", demo_files())
        (d / "chat_template.jinja").write_text(text)
        src = str(d / "chat_template.jinja")
        out += [Case("template", name, ("identity", "template-sha", str(f)),
                     refused(str(f), "does not render", why)),
                Case("template", name, ("identity", "derive", str(d)),
                     unknown("chat_template_sha256", src, why))]
        if fast:
            env = deployment_env(tmp / f"dep-tpl-{name}", d)
            out += [Case("template", name, ("identity", "derive", str(d), "--json"),
                         unknown("chat_template_sha256", src, why)),
                    Case("template", name, ("identity", "check", "cpu-demo", "--json"),
                         unchecked("chat_template_sha256", why), env)]
    if templates is SLOW_TEMPLATES:
        return out
    # in tokenizer_config.json (no chat_template.jinja): a JSON string may hold a lone
    # surrogate, which no UTF-8 output can
    for name, text, why in (("lone-surrogate", "\ud800", "UnicodeEncodeError"),
                            ("zero-division", "{{ 1 / 0 }}", "ZeroDivisionError")):
        tok = json.dumps({"chat_template": text})
        f = tmp / "tpl" / f"{name}-tokenizer_config.json"
        f.write_text(tok)
        d = plain_dir(tmp / f"tok-{name}", {**demo_files(), "tokenizer_config.json": tok})
        (d / "chat_template.jinja").unlink()
        out += [Case("template", f"tokenizer_config {name}",
                     ("identity", "template-sha", str(f)), refused(str(f), why)),
                Case("template", f"tokenizer_config {name}",
                     ("identity", "derive", str(d), "--json"),
                     unknown("chat_template_sha256", "tokenizer_config.json", why))]
    return out


def test_hostile_templates_are_stopped_and_named(runner: HostileRunner,
                                                 tmp_path: Path) -> None:
    run_cases(runner, template_cases(tmp_path, FAST_TEMPLATES))


def test_endless_templates_are_stopped_by_the_clock(tmp_path: Path) -> None:
    """A Python loop and a C-level power (which no alarm interrupts) both end at the
    wall-clock bound of the render, whoever asks for the digest."""
    for case, o in run_apart(template_cases(tmp_path, SLOW_TEMPLATES)):
        assert o.seconds < 8, (case.label, case.argv, o.seconds)


# --------------------------------------------------------------------------- typed values

VALUES: list[object] = ["2", 2.5, True, [2], {"v": 2}, 0, -1, 10**400, 2**31 + 1]
FACTORS: list[object] = ["2", True, [2], {"v": 2}, 0, -1.5, 10**400, 2**31 + 1]
DTYPES: list[object] = [16, True, ["bfloat16"], {"v": "bfloat16"}]
TEXT_CONFIGS: list[object] = ["x", 5, [1], True]
NOT_INT = "not a positive integer"


def value_layouts() -> list[tuple[str, dict[str, Any], list[object], list[str], str]]:
    """(label, config changes with VALUE standing for the hostile value, values, fields it
    makes unknown, the words of why)."""
    out: list[tuple[str, dict[str, Any], list[object], list[str], str]] = [
        ("head_dim", {"head_dim": "VALUE"}, VALUES, ["head_dim"], NOT_INT),
        ("hidden_size_per_head", {"head_dim": None, "hidden_size_per_head": "VALUE"}, VALUES,
         ["head_dim"], NOT_INT),
        ("hidden_size", {"head_dim": None, "hidden_size": "VALUE"}, VALUES, ["head_dim"],
         NOT_INT),
        ("num_attention_heads", {"head_dim": None, "num_key_value_heads": None,
                                 "num_attention_heads": "VALUE"}, VALUES,
         ["num_kv_heads", "head_dim"], NOT_INT),
        ("kv_lora_rank", {"model_type": "deepseek_v3", "kv_lora_rank": "VALUE",
                          "qk_rope_head_dim": 64}, VALUES, ["num_kv_heads", "head_dim"],
         NOT_INT),
        ("qk_rope_head_dim", {"model_type": "deepseek_v3", "kv_lora_rank": 512,
                              "qk_rope_head_dim": "VALUE"}, VALUES,
         ["num_kv_heads", "head_dim"], NOT_INT),
    ]
    for key in ("n_head_kv", "num_kv_heads", "num_key_value_heads", "multi_query_group_num",
                "num_attention_groups"):
        out.append((key, {"num_key_value_heads": None, key: "VALUE"}, VALUES,
                    ["num_kv_heads"], NOT_INT))
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length",
                "model_max_length", "max_target_positions", "max_sequence_length",
                "max_seq_length", "seq_len"):
        out.append((key, {key: "VALUE"}, VALUES, ["max_model_len"], NOT_INT))
    out += [("rope_parameters.factor", {"rope_parameters": {"rope_type": "dynamic",
                                                           "factor": "VALUE"}},
             FACTORS, ["max_model_len"], "not a positive number"),
            ("rope_scaling.factor", {"rope_parameters": None, "rope_scaling": {
                "type": "linear", "factor": "VALUE"}}, FACTORS, ["max_model_len"],
             "not a positive number"),
            ("dtype", {"dtype": "VALUE"}, DTYPES, ["kv_cache_dtype"], "not a dtype name"),
            ("torch_dtype", {"torch_dtype": "VALUE"}, DTYPES, ["kv_cache_dtype"],
             "not a dtype name"),
            ("text_config", {"text_config": "VALUE"}, TEXT_CONFIGS,
             ["num_kv_heads", "head_dim", "max_model_len", "kv_cache_dtype"], "not an object")]
    return out


def _with(changes: dict[str, Any], value: object) -> dict[str, Any]:
    def put(v: Any) -> Any:
        if v == "VALUE":
            return value
        return {k: put(x) for k, x in v.items()} if isinstance(v, dict) else v
    return {k: put(v) for k, v in changes.items()}


def value_cases(tmp: Path) -> list[Case]:
    out: list[Case] = []
    for key, changes, values, fields, why in value_layouts():
        for i, value in enumerate(values):
            files = demo_files(**_with(changes, value))
            del files["chat_template.jinja"]  # not what is tried here: no render per run
            d = plain_dir(tmp / f"v-{key}-{i}", files)
            text = f"{key} = {json.dumps(value)[:20]}"
            out.append(Case("config value", text, ("identity", "derive", str(d), "--json"),
                            all_of(*(unknown(name, f"{key} is", why) for name in fields))))
            if i == 0 or key == "head_dim":  # text and check: every head_dim, one of others
                out.append(Case("config value", text, ("identity", "derive", str(d)),
                                unknown(fields[0], f"{key} is", why)))
                checked = [f for f in fields if f != "kv_cache_dtype"]  # rendered, not compared
                if checked:
                    env = deployment_env(tmp / f"dep-v-{key}-{i}", d)
                    out.append(Case("config value", text, ("identity", "check", "cpu-demo",
                                                           "--json"),
                                    malformed(checked[0], f"{key} is", why), env))
    return out


def test_a_value_of_the_wrong_type_is_unknown_never_a_fallback(runner: HostileRunner,
                                                               tmp_path: Path) -> None:
    run_cases(runner, value_cases(tmp_path))


def test_a_head_dim_of_the_wrong_type_is_never_written_as_64(runner: HostileRunner,
                                                             tmp_path: Path) -> None:
    """The finding as reported: a head_dim of "2" wrote KVP_HEAD_DIM=64 (hidden / heads)."""
    cases = []
    for i, value in enumerate(VALUES):
        d = plain_dir(tmp_path / f"m{i}", demo_files(head_dim=value))
        cases.append(Case("config value", f"head_dim={value!r:.20}",
                          ("identity", "derive", str(d)), exits(1)))
    for case, o in run_cases(runner, cases):
        assert "KVP_HEAD_DIM=\n" in o.stdout and "KVP_HEAD_DIM=64" not in o.stdout, case.label


# --------------------------------------------------------------------------- download trees


def deep(base: Path, levels: int) -> Path:
    """A chain of ``levels`` directories ``d/d/...`` from ``base`` (``base`` included), made
    one by one (Path.mkdir(parents=True) and os.makedirs recurse); the deepest."""
    base.parent.mkdir(parents=True, exist_ok=True)
    p = base
    p.mkdir()
    for _ in range(levels - 1):
        p = p / "d"
        p.mkdir()
    return p


def remove_tree(top: Path) -> None:
    """Remove ``top`` and everything under it without recursion (shutil.rmtree, which
    pytest's clean-up uses, recurses once per level), never following a link."""
    dirs: list[str] = []
    stack = [str(top)]
    while stack:
        here = stack.pop()
        dirs.append(here)
        with os.scandir(here) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                else:
                    os.unlink(e.path)
    for here in reversed(dirs):
        os.rmdir(here)


RECORDS = Path(".cache/huggingface/download")


def tree_cases(tmp: Path) -> list[Case]:
    out: list[Case] = []
    for where in ("model files", "download records"):
        d = local_dir(tmp / f"deep-{where.replace(' ', '-')}")
        leaf = deep(d / (RECORDS if where == "download records" else Path()) / "d", 1100)
        (leaf / ("x.safetensors.metadata" if where == "download records" else "x.txt")
         ).write_text("x")
        env = deployment_env(tmp / f"dep-deep-{where.replace(' ', '-')}", d)
        label = f"1,100-deep {where}"
        for argv, check in ((("identity", "derive", str(d)), refused("nested more than 256")),
                            (("identity", "derive", str(d), "--json"),
                             refused("nested more than 256")),
                            (("identity", "check", "cpu-demo"), refused("nested more than 256")),
                            (("weights", "cpu-demo"), exits(0))):  # the top level only
            out.append(Case("download tree", label, argv, check,
                            env if argv[0] != "identity" or argv[1] == "check" else None))
    d = local_dir(tmp / "loops")
    (d / "loop").symlink_to(".")
    (d / RECORDS / "loop").symlink_to("..")
    out.append(Case("download tree", "directory link loops",
                    ("identity", "derive", str(d), "--json"),
                    derived_as("model_revision", CPU_DEMO_REVISION)))
    return out


def test_download_trees_are_walked_without_recursion_and_bounded(runner: HostileRunner,
                                                                 tmp_path: Path) -> None:
    try:
        run_cases(runner, tree_cases(tmp_path))
    finally:
        for top in tmp_path.glob("deep-*"):
            remove_tree(top)


def test_the_walk_is_bounded_in_entries_and_depth(tmp_path: Path) -> None:
    """The bounds themselves, on real trees small enough to build here (the CLI cases above
    meet the default depth bound; 100,001 files would cost seconds to make)."""
    top = tmp_path / "top"
    (top / ".hidden").mkdir(parents=True)
    (top / ".hidden" / "x").write_text("x")
    for i in range(10):
        (top / f"{i}.txt").write_text("x")
    (top / "sub").mkdir()
    (top / "sub" / "y.json").write_text("y")
    (top / "sub" / "up").symlink_to("..")
    os.mkfifo(top / "fifo")
    names = [f"{i}.txt" for i in range(10)] + ["sub/y.json"]
    assert walk_files(top, skip_hidden=True) == sorted(names)
    assert walk_files(top) == sorted([*names, ".hidden/x"])
    assert walk_files(top, skip_hidden=True, max_entries=15) == sorted(names)
    with pytest.raises(ConfigError, match="more than 14 entries"):
        walk_files(top, skip_hidden=True, max_entries=14)
    deep(top / "d", 5)
    assert walk_files(top, skip_hidden=True, max_depth=5) == sorted(names)
    with pytest.raises(ConfigError, match="nested more than 4 deep") as err:
        walk_files(top, skip_hidden=True, max_depth=4)
    assert err.value.problems[0].where == str(top)


def record_cases(tmp: Path) -> list[Case]:
    """config.json's download record made hostile: the revision is unknown, never read from
    the other records alone."""
    kinds: dict[str, tuple[Callable[[Path], None], str]] = {
        # not a regular file: no record at all
        "fifo": (lambda p: plant(p, "fifo", 0), "no download record"),
        "dev-zero": (lambda p: plant(p, "dev-zero", 0), "no download record"),
        "oversize": (lambda p: plant(p, "oversize", MAX_RECORD_BYTES), "bad record"),
        "non-utf8": (lambda p: plant(p, "non-utf8", 0), "bad record"),
        "directory": (lambda p: plant(p, "directory", 0), "no download record"),
        "infinite-timestamp": (lambda p: p.write_text(f"{CPU_DEMO_REVISION}\netag\ninf\n"),
                               "bad record"),
        "nan-timestamp": (lambda p: p.write_text(f"{CPU_DEMO_REVISION}\netag\nnan\n"),
                          "bad record"),
        "long-commit": (lambda p: p.write_text("c" * 60_000 + "\netag\n1\n"), "bad record"),
        "one-line": (lambda p: p.write_text(CPU_DEMO_REVISION), "bad record"),
    }
    out: list[Case] = []
    for kind, (make, why) in kinds.items():
        d = local_dir(tmp / f"rec-{kind}")
        make(d / RECORDS / "config.json.metadata")
        env = deployment_env(tmp / f"dep-rec-{kind}", d)
        out += [Case("download record", kind, ("identity", "derive", str(d)),
                     unknown("model_revision", why, "config.json")),
                Case("download record", kind, ("identity", "derive", str(d), "--json"),
                     unknown("model_revision", why, "config.json")),
                Case("download record", kind, ("identity", "check", "cpu-demo", "--json"),
                     unchecked("model_revision", why), env),
                Case("download record", kind, ("weights", "cpu-demo"), exits(0), env)]
    return out


def test_hostile_download_records_are_bad_records(runner: HostileRunner,
                                                  tmp_path: Path) -> None:
    run_cases(runner, record_cases(tmp_path))


# --------------------------------------------------------------------------- state dir

STATE_KINDS = ["fifo", "dev-zero", "directory", "oversize", "deep-100000", "deep-65", "nan",
               "not-an-object"]


def _first_weights(runner: HostileRunner, tmp: Path, label: str) -> tuple[dict[str, str],
                                                                         dict[str, Any]]:
    env = deployment_env(tmp / label, plain_dir(tmp / label / "model"))
    first = runner.run("weights", "cpu-demo", "--json", env=env)
    assert first.code == 0, first.stderr
    return env, json.loads(first.stdout)


def test_an_unusable_digest_cache_is_ignored_and_every_file_read(runner: HostileRunner,
                                                                 tmp_path: Path) -> None:
    cases = []
    for kind in [*STATE_KINDS, "symlink", "wrong-schema", "bad-entries"]:
        env, doc = _first_weights(runner, tmp_path, f"cache-{kind}")
        cache = Path(doc["digest_cache"])
        if kind == "symlink":
            (cache.parent / "elsewhere.json").write_bytes(cache.read_bytes())
            cache.unlink()
            cache.symlink_to("elsewhere.json")
        elif kind in ("wrong-schema", "bad-entries"):
            entries = {"1:2": {"key": "x", "sha256": "0" * 64, "source": "read"}}
            cache.write_text(json.dumps({"schema": "kvpersist.weights-digests/1" if kind ==
                                         "bad-entries" else "other/1", "files": entries}))
        else:
            plant(cache, kind, MAX_CACHE_BYTES)

        def recomputed(o: Outcome, kind: str = kind) -> list[str]:
            doc = _doc(o)
            sources = doc.get("current", {}).get("sources")
            bad = [] if o.code == 0 and doc.get("status") == "first" and sources == {
                "read": 3} else [f"exit {o.code}, {doc.get('status')}, {sources}, expected "
                                 "every file read"]
            said = " ".join(doc.get("notes", []))
            if kind != "bad-entries" and "weights digest cache" not in said:
                bad.append(f"no note says the cache was not used: {said}")
            return bad
        cases.append(Case("digest cache", kind, ("weights", "cpu-demo", "--json"), recomputed,
                          env))
    run_cases(runner, cases)


def test_an_unreadable_manifest_is_a_problem_naming_it(runner: HostileRunner,
                                                       tmp_path: Path) -> None:
    cases = []
    for kind in [*STATE_KINDS, "symlink"]:
        env, doc = _first_weights(runner, tmp_path, f"manifest-{kind}")
        manifest = Path(doc["manifest"])
        if kind == "symlink":
            manifest.parent.mkdir(parents=True, exist_ok=True)
            (manifest.parent / "real.json").write_text("{}")
            manifest.symlink_to("real.json")
        else:
            plant(manifest, kind, MAX_STATE_BYTES)
        cases.append(Case("manifest", kind, ("weights", "cpu-demo"),
                          refused(str(manifest), "cannot read the namespace manifest"), env))
    run_cases(runner, cases)
