"""stack/render.py is pure: values in, argv/objects out; StrictUndefined catches slips."""

from __future__ import annotations

import dataclasses
import json

import pytest

from kvpersist.config.deployment import build_deployment
from kvpersist.config.generic import GenericConfig
from kvpersist.errors import ConfigError
from kvpersist.stack.render import TEMPLATE_NAMES, render

from ..conftest import REPO
from .test_identity import BASE
from .test_settings import DEPLOY

TEMPLATES = {n: (REPO / "templates" / n).read_text() for n in TEMPLATE_NAMES}


def dep(extra: dict[str, str] | None = None, generic: GenericConfig | None = None):
    return build_deployment("t", "t.env", {**BASE, **DEPLOY, **(extra or {})}, {},
                            generic or GenericConfig())


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_server_argv_and_adapter() -> None:
    r = render(dep(), TEMPLATES, l1_size_gb=64, l2_capacity_gb=512.25)
    argv = r.lmcache_server_argv
    assert argv[:2] == ["lmcache", "server"]
    assert flag(argv, "--host") == flag(argv, "--http-host") == "127.0.0.1"
    assert flag(argv, "--l1-size-gb") == "64"
    assert "--no-run-script-api-enabled" in argv and "--run-script-api-enabled" not in argv
    adapter = json.loads(flag(argv, "--l2-adapter"))
    assert adapter == r.l2_adapter
    assert adapter["type"] == "nixl_store_dynamic" and adapter["backend"] == "POSIX"
    assert adapter["persist_enabled"] is True
    assert adapter["backend_params"] == {"file_path": "/var/lib/kvp/test",
                                         "use_direct_io": "true", "max_capacity_gb": "512.250"}
    assert adapter["eviction"] == {"eviction_policy": "LRU", "trigger_watermark": 0.9,
                                   "eviction_ratio": 0.1}
    assert adapter["serde"]["type"] == "aesgcm"
    assert adapter["serde"]["master_key_path"] == (  # the namespace's own key
        f"/var/lib/kvp/.kvpersist/test/keys/{r.namespace}/l2-master.key")


def test_vllm_args_carry_the_namespace() -> None:
    d = dep()
    r = render(d, TEMPLATES, l1_size_gb=64, l2_capacity_gb=10)
    a = r.vllm_argv
    assert flag(a, "--model") == d.namespace == r.lmcache_model_name
    assert flag(a, "--served-model-name") == "llama"
    assert flag(a, "--dtype") == "bfloat16" and flag(a, "--kv-cache-dtype") == "auto"
    assert json.loads(flag(a, "--kv-transfer-config")) == r.kv_transfer_config
    assert r.kv_transfer_config["kv_connector_extra_config"] == {
        "lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 5555,
        "lmcache.mp.mq_timeout": 10.0, "lmcache.mp.heartbeat_interval": 2.0}
    assert r.model_link == {"dir": "/var/lib/kvp/.kvpersist/test/models", "name": d.namespace,
                            "target": "/models/llama"}
    assert r.container_argv == []  # no image: a direct process


def test_fp8_kv_dtype_is_passed_to_vllm() -> None:
    r = render(dep({"KVP_KV_CACHE_DTYPE": "fp8_e5m2", "KVP_MODEL_DTYPE": "float16"}),
               TEMPLATES, l1_size_gb=8, l2_capacity_gb=10)
    assert flag(r.vllm_argv, "--kv-cache-dtype") == "fp8_e5m2"
    assert flag(r.vllm_argv, "--dtype") == "float16"


def test_wildcard_bind_is_reached_through_loopback() -> None:
    r = render(dep({"KVP_LMCACHE_HOST": "0.0.0.0", "KVP_ALLOW_REMOTE_LMCACHE": "10.1.0.0/16"}),
               TEMPLATES, l1_size_gb=8, l2_capacity_gb=1)
    assert r.kv_transfer_config["kv_connector_extra_config"]["lmcache.mp.host"] == \
        "tcp://127.0.0.1"


def test_generic_switches() -> None:
    # both switches away from their defaults (flat layout, O_DIRECT reads)
    g = dataclasses.replace(GenericConfig(), l2_shard_dirs=True, l2_use_direct_io=False)
    r = render(dep({"KVP_L2_SERDE": "none"}, g), TEMPLATES, l1_size_gb=8, l2_capacity_gb=1)
    assert r.l2_adapter["backend_params"]["shard_dirs"] == "true"
    assert r.l2_adapter["backend_params"]["use_direct_io"] == "false"
    assert "serde" not in r.l2_adapter


def test_container_argv() -> None:
    d = dep({"KVP_IMAGE": "vllm/vllm-openai:v0.32.0", "KVP_CONTAINER_NAME": "x-kvp"})
    r = render(d, TEMPLATES, l1_size_gb=8, l2_capacity_gb=1)
    c = r.container_argv
    assert c[:2] == ["docker", "run"] and flag(c, "--name") == "x-kvp"
    assert flag(c, "-w") == "/kvp-models"
    assert f"/models/llama:/kvp-models/{d.namespace}:ro" in c
    assert c[c.index("vllm/vllm-openai:v0.32.0") + 1:] == r.vllm_argv


def test_manifest_holds_canonical_identity() -> None:
    d = dep()
    m = render(d, TEMPLATES, l1_size_gb=8, l2_capacity_gb=1).manifest
    assert m["schema"] == "kvpersist.manifest/1" and m["pinned"] is True
    assert m["namespace"] == d.namespace
    assert d.identity is not None and m["canonical_json"] == d.identity.canonical_json()


def test_no_capacity_is_an_error() -> None:
    with pytest.raises(ConfigError, match="no room"):
        render(dep(), TEMPLATES, l1_size_gb=8, l2_capacity_gb=0)


def test_strict_undefined_and_missing_templates() -> None:
    broken = dict(TEMPLATES, **{"vllm-serve.argv.j2": "--model\n{{ no_such_value }}\n"})
    with pytest.raises(ConfigError, match="render failed"):
        render(dep(), broken, l1_size_gb=8, l2_capacity_gb=1)
    with pytest.raises(ConfigError, match="missing"):
        render(dep(), {}, l1_size_gb=8, l2_capacity_gb=1)


def test_render_is_deterministic() -> None:
    a = render(dep(), TEMPLATES, l1_size_gb=8, l2_capacity_gb=1)
    b = render(dep(), TEMPLATES, l1_size_gb=8, l2_capacity_gb=1)
    assert a == b
