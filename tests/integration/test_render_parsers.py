"""The rendered argv is accepted by LMCache's and vLLM's own parsers (installed here).

These import lmcache and vLLM (CPU build); kvp-admin itself never does for render.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import pytest

from kvpersist.config.chat_template import template_sha256

from ..cli import kvp_json
from ..conftest import REPO, clean_env

pytestmark = pytest.mark.integration


def render_json(config: str, env: dict[str, str], *extra: str) -> dict[str, Any]:
    return dict(kvp_json("render", config, "--json", *extra, env=env))


def pinned_copy(tmp_path: Path, name: str) -> Path:
    """A production config with its chat-template digest filled in, as an operator would."""
    text = (REPO / "configs" / name / "identity.env").read_text()
    digest = template_sha256("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    text = text.replace("KVP_CHAT_TEMPLATE_SHA256=\n", f"KVP_CHAT_TEMPLATE_SHA256={digest}\n")
    path = tmp_path / name / "identity.env"
    path.parent.mkdir()
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("render")
    # Render as on a host where these deployments fit: the budget plan refuses an L1 that
    # does not fit in this machine's RAM (each config asks for 32-64 GB).
    env = dict(clean_env(), KVP_CACHE_ROOT=str(tmp / "cache"), KVP_L1_SIZE_GB="2")
    out = {"cpu-demo": render_json("cpu-demo", env)}
    for name in ("mimo-pro-tp4", "llama-3.1-8b-instruct", "qwen2.5-14b-instruct-fp8kv"):
        out[name] = render_json(str(pinned_copy(tmp, name)), env)
    return out


@pytest.fixture(scope="module")
def lmcache_parser() -> argparse.ArgumentParser:
    os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")
    from lmcache.cli.commands.server import ServerCommand

    parser = argparse.ArgumentParser(prog="lmcache server", exit_on_error=False)
    ServerCommand().add_arguments(parser)
    return parser


CONFIGS = ["cpu-demo", "mimo-pro-tp4", "llama-3.1-8b-instruct", "qwen2.5-14b-instruct-fp8kv"]


@pytest.mark.parametrize("name", CONFIGS)
def test_lmcache_parser_and_config_builders_accept_rendered_argv(
        rendered: dict[str, dict[str, Any]], lmcache_parser: argparse.ArgumentParser,
        name: str) -> None:
    from lmcache.v1.distributed.config import parse_args_to_config
    from lmcache.v1.multiprocess.config import (
        parse_args_to_http_frontend_config,
        parse_args_to_mp_server_config,
    )

    r = rendered[name]
    argv = r["lmcache_server_argv"]
    assert argv[:2] == ["lmcache", "server"]
    assert "--run-script-api-enabled" not in argv
    args = lmcache_parser.parse_args(argv[2:])
    mp = parse_args_to_mp_server_config(args)
    http = parse_args_to_http_frontend_config(args)
    storage = parse_args_to_config(args)
    assert mp.host == "127.0.0.1" and http.http_host == "127.0.0.1"
    assert mp.run_script_api_enabled is False
    assert mp.supported_transfer_mode == "auto"
    assert mp.chunk_size == 256
    assert mp.port == r["kv_transfer_config"]["kv_connector_extra_config"]["lmcache.mp.port"]
    assert storage.eviction_config.eviction_policy == "LRU"
    assert storage.eviction_config.trigger_watermark == 0.9
    assert storage.eviction_config.eviction_ratio == 0.1
    (adapter,) = storage.l2_adapter_config.adapters
    assert type(adapter).__name__ == "DynamicNixlStoreL2AdapterConfig"
    assert adapter.backend == "POSIX"
    assert adapter.backend_params["file_path"] == r["manifest"]["deployment"]["cache_root"]
    assert float(adapter.backend_params["max_capacity_gb"]) > 0
    assert adapter.persist_config.persist_enabled is True
    assert adapter.eviction_config.eviction_policy == "LRU"
    assert adapter.eviction_config.trigger_watermark == 0.9
    assert adapter.eviction_config.eviction_ratio == 0.1
    assert adapter.serde_config.type == "aesgcm"


@pytest.fixture(scope="module")
def vllm_parser() -> Any:
    from ._vllm_parser import vllm_parser

    return vllm_parser()


@pytest.mark.parametrize("name", CONFIGS)
def test_vllm_parser_accepts_rendered_args(rendered: dict[str, dict[str, Any]],
                                           vllm_parser: Any, name: str) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs

    r = rendered[name]
    args = vllm_parser.parse_args(r["vllm_argv"])
    engine = AsyncEngineArgs.from_cli_args(args)
    ident = r["manifest"]["identity"]
    assert engine.model == r["namespace"] == r["lmcache_model_name"]
    assert engine.served_model_name in (r["manifest"]["deployment"]["served_model_name"],
                                        [r["manifest"]["deployment"]["served_model_name"]])
    assert engine.tensor_parallel_size == ident["tensor_parallel_size"]
    assert engine.max_model_len == ident["max_model_len"]
    assert engine.block_size == ident["block_size"]
    if ident["kv_cache_dtype"].startswith("fp8"):
        assert engine.kv_cache_dtype == ident["kv_cache_dtype"]
    else:  # stored in the model dtype, which is pinned
        assert engine.kv_cache_dtype == "auto" and engine.dtype == ident["kv_cache_dtype"]
    ktc = engine.kv_transfer_config
    assert ktc is not None
    assert ktc.kv_connector == "LMCacheMPConnector"
    assert ktc.kv_connector_module_path == "lmcache.integration.vllm.lmcache_mp_connector"
    assert ktc.kv_role == "kv_both"
    # a failed load is a recompute, never an error to the user (vLLM's default is "fail")
    assert ktc.kv_load_failure_policy == "recompute"
    assert engine.shutdown_timeout == 20  # vLLM drains the requests in flight at a stop


@pytest.mark.parametrize("name", CONFIGS)
def test_vllm_kvtransferconfig_accepts_rendered_object(rendered: dict[str, dict[str, Any]],
                                                       name: str) -> None:
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(**rendered[name]["kv_transfer_config"])
    extra = ktc.kv_connector_extra_config
    assert extra["lmcache.mp.host"] == "tcp://127.0.0.1"
    assert ktc.is_kv_transfer_instance and ktc.is_kv_producer and ktc.is_kv_consumer


def test_tp4_container_argv_names_the_seed_container(rendered: dict[str, dict[str, Any]]) -> None:
    argv = rendered["mimo-pro-tp4"]["container_argv"]
    assert argv[:2] == ["docker", "run"]
    assert argv[argv.index("--name") + 1] == "mimo-pro-tp4-kvp"
    ns = rendered["mimo-pro-tp4"]["namespace"]
    assert f"/models/MiMo-V2-Flash:/kvp-models/{ns}:ro" in argv


@pytest.mark.parametrize(("url", "kind"), [
    # auto: resp only for a store on the loopback (it has no timeouts), valkey elsewhere
    ("valkey://127.0.0.1:6379?workers=4", "RESPL2AdapterConfig"),
    ("valkey://10.0.5.11:6379?workers=4", "ValkeyL2AdapterConfig"),
    ("valkey://10.0.5.11:6379,10.0.5.12:6379?cluster=1&tls=1", "ValkeyL2AdapterConfig"),
])
def test_lmcache_parser_accepts_the_shared_tier(tmp_path: Path,
                                                lmcache_parser: argparse.ArgumentParser,
                                                url: str, kind: str) -> None:
    from lmcache.v1.distributed.config import parse_args_to_config

    env = dict(clean_env(), KVP_CACHE_ROOT=str(tmp_path / "cache"), KVP_SHARED_TIER=url,
               KVP_SHARED_TIER_SECRET_FILE=str(tmp_path / "shared.secret"))
    r = render_json("cpu-demo", env)
    args = lmcache_parser.parse_args(r["lmcache_server_argv"][2:])
    assert args.l2_store_policy == "default" and args.l2_prefetch_policy == "retain"
    storage = parse_args_to_config(args)
    nvme, shared = storage.l2_adapter_config.adapters
    assert type(nvme).__name__ == "DynamicNixlStoreL2AdapterConfig"
    assert type(shared).__name__ == kind
    assert shared.serde_config.type == "aesgcm"
    assert shared.serde_config.kwargs == nvme.serde_config.kwargs
    assert getattr(shared, "password", "") == "" and getattr(shared, "username", "") == ""
    assert r["shared_tier"]["adapter"] in kind.lower()
