"""Deployment settings, generic config and cross-checks: every refusal, all at once."""

from __future__ import annotations

import pytest
import yaml

from kvpersist.config.deployment import build_deployment
from kvpersist.config.generic import GenericConfig, generic_from_dict
from kvpersist.config.loader import load_deployment
from kvpersist.errors import ConfigError

from .test_identity import BASE

DEPLOY = {
    "KVP_CACHE_ROOT": "/var/lib/kvp/test",
    "KVP_SERVED_MODEL_NAME": "llama",
    "KVP_MODEL_PATH": "/models/llama",
}


def build(values: dict[str, str], environ: dict[str, str] | None = None, **kw: object):
    return build_deployment("t", "t.env", values, environ or {}, GenericConfig(), **kw)  # type: ignore[arg-type]


def test_defaults_are_loopback_and_generic() -> None:
    dep = build({**BASE, **DEPLOY})
    s = dep.settings
    assert (s.lmcache_host, s.lmcache_port, s.lmcache_http_host, s.lmcache_http_port) == (
        "127.0.0.1", 5555, "127.0.0.1", 8080)
    assert s.l1_size_gb == 64.0
    # beside the cache root, out of reach of LMCache's clean-up of '.tmp.' names under it
    assert s.state_dir == "/var/lib/kvp/.kvpersist/test"
    assert s.log_dir == "/var/lib/kvp/.kvpersist/test/logs" and s.service_user == ""
    assert dep.pinned and dep.namespace.startswith("kvp-")


def test_environment_overrides_deployment_keys_not_identity_keys() -> None:
    environ = {"KVP_CACHE_ROOT": "/tmp/elsewhere", "KVP_LMCACHE_PORT": "6000",
               "KVP_MODEL_REVISION": "f" * 40, "KVP_BLOCK_SIZE": "32"}
    dep = build({**BASE, **DEPLOY}, environ)
    assert dep.settings.cache_root == "/tmp/elsewhere"
    assert dep.settings.lmcache_port == 6000
    assert dep.identity is not None
    assert dep.identity.model_revision == BASE["KVP_MODEL_REVISION"]
    assert dep.identity.block_size == 16
    assert dep.namespace == build({**BASE, **DEPLOY}).namespace


@pytest.mark.parametrize("key,value", [
    ("KVP_CACHE_ROOT", "/other"), ("KVP_L1_SIZE_GB", "8"), ("KVP_LMCACHE_PORT", "7000"),
    ("KVP_LMCACHE_HTTP_PORT", "7001"), ("KVP_SERVED_MODEL_NAME", "public"),
    ("KVP_MODEL_PATH", "/elsewhere"), ("KVP_CONTAINER_NAME", "c"), ("KVP_IMAGE", "img:1"),
    ("KVP_LMCACHE_HOST", "10.0.0.1"),
])
def test_deployment_keys_never_change_the_namespace(key: str, value: str) -> None:
    extra = {"KVP_ALLOW_REMOTE_LMCACHE": "10.0.0.0/8"} if key == "KVP_LMCACHE_HOST" else {}
    assert build({**BASE, **DEPLOY, key: value, **extra}).namespace == \
        build({**BASE, **DEPLOY}).namespace


def test_unknown_kvp_key_is_an_error_with_suggestion() -> None:
    with pytest.raises(ConfigError) as err:
        build({**BASE, **DEPLOY, "KVP_MODEL_REVISON": "x"})
    (problem,) = err.value.problems
    assert "unknown key" in problem.message
    assert "KVP_MODEL_REVISION" in problem.fix


def test_non_kvp_key_is_an_error() -> None:
    with pytest.raises(ConfigError) as err:
        build({**BASE, **DEPLOY, "PATH": "/bin"})
    assert "unknown key" in err.value.problems[0].message


def test_missing_identity_refused_unless_opt_in() -> None:
    values = {**BASE, **DEPLOY}
    del values["KVP_CHAT_TEMPLATE_SHA256"]
    with pytest.raises(ConfigError) as err:
        build(values)
    assert any("allow-unpinned" in p.fix for p in err.value.problems)
    dep = build(values, allow_unpinned=True, unpinned_token="0123456789abcdef" * 2)
    assert not dep.pinned
    assert dep.namespace == "kvp-unpinned-" + "0123456789abcdef" * 2
    assert dep.unpinned_reasons and "KVP_CHAT_TEMPLATE_SHA256" in dep.unpinned_reasons[0].where
    dep2 = build({**values, "KVP_ALLOW_UNPINNED": "true"}, unpinned_token="f" * 32)
    assert not dep2.pinned


def test_every_problem_reported_together() -> None:
    values = {**BASE, "KVP_CACHE_ROOT": "relative/path", "KVP_LMCACHE_PORT": "99999",
              "KVP_L1_SIZE_GB": "lots", "KVP_BLOCK_SIZE": "0", "KVP_TYPO": "1"}
    with pytest.raises(ConfigError) as err:
        build(values)
    text = str(err.value)
    for needle in ("KVP_CACHE_ROOT", "KVP_LMCACHE_PORT", "KVP_L1_SIZE_GB", "KVP_BLOCK_SIZE",
                   "KVP_TYPO", "KVP_SERVED_MODEL_NAME", "KVP_MODEL_PATH"):
        assert needle in text
    assert len(err.value.problems) >= 7


@pytest.mark.parametrize("extra,needle", [
    ({"KVP_LMCACHE_HTTP_PORT": "5555"}, "port 5555 is also KVP_LMCACHE_PORT"),
    ({"KVP_VLLM_PORT": "8080"}, "port 8080 is also KVP_LMCACHE_HTTP_PORT"),
    ({"KVP_TENSOR_PARALLEL_SIZE": "4", "KVP_GPU_COUNT": "2"}, "TP 4 needs 4 GPUs"),
    ({"KVP_BLOCK_SIZE": "96"}, "does not divide the cache chunk size 256"),
    ({"KVP_CONNECTOR": "OtherConnector"}, "not supported"),
    ({"KVP_MODEL_DTYPE": "float16"}, "differs from KVP_KV_CACHE_DTYPE"),
    ({"KVP_VLLM_EXTRA_ARGS": "--max-model-len 9"}, "sets flags kvpersist owns"),
    ({"KVP_VLLM_EXTRA_ARGS": "--kv-transfer-config={}"}, "sets flags kvpersist owns"),
    ({"KVP_LMCACHE_HOST": "example.com"}, "must be an IP address"),
])
def test_settings_that_cannot_agree(extra: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as err:
        build({**BASE, **DEPLOY, **extra})
    assert any(needle in p.message for p in err.value.problems), err.value.problems


def test_generic_config_shipped_is_valid(repo) -> None:
    data = yaml.safe_load((repo / "configs/generic/lmcache.yaml").read_text())
    g = generic_from_dict(data)
    assert g == GenericConfig()  # the YAML states the documented defaults


def test_generic_config_errors_all_at_once() -> None:
    data = {"server": {"port": "x", "chunk_size": -1, "bogus": 1},
            "l2": {"persist_enabled": False, "serde": "rot13", "budget": "120%"},
            "l3": {}}
    with pytest.raises(ConfigError) as err:
        generic_from_dict(data, "g.yaml")
    wheres = sorted(p.where for p in err.value.problems)
    assert wheres == ["l2.budget", "l2.persist_enabled", "l2.serde", "l3", "server.bogus",
                      "server.chunk_size", "server.port"]


@pytest.mark.parametrize("name", ["mimo-pro-tp4", "llama-3.1-8b-instruct",
                                  "qwen2.5-14b-instruct-fp8kv"])
def test_shipped_production_configs_refuse_until_template_pinned(name: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_deployment(name, environ={})
    assert [p.where.rsplit(": ", 1)[-1] for p in err.value.problems][0] == \
        "KVP_CHAT_TEMPLATE_SHA256"
    dep = load_deployment(name, environ={}, allow_unpinned=True)
    assert dep.identity_values["tensor_parallel_size"] >= 1


def test_shipped_cpu_demo_config_is_pinned() -> None:
    dep = load_deployment("cpu-demo", environ={})
    assert dep.pinned and dep.settings.device == "cpu"
    assert dep.identity is not None and dep.identity.block_size == 128


def test_seed_tp4_deployment_names_its_container() -> None:
    dep = load_deployment("mimo-pro-tp4", environ={}, allow_unpinned=True)
    assert dep.settings.container_name == "mimo-pro-tp4-kvp"
    assert dep.identity_values["tensor_parallel_size"] == 4
