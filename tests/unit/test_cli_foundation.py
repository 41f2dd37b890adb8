"""kvp-admin identity/render: output, exit codes, no tracebacks, no heavy imports."""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ..cli import kvp
from ..conftest import REPO, clean_env


def test_identity_show_json_and_namespace() -> None:
    shown = kvp("identity", "show", "cpu-demo", "--json")
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    assert set(data) == {"config", "source", "identity", "canonical_json", "namespace",
                         "lmcache_model_name"}
    ns = kvp("identity", "namespace", "cpu-demo")
    assert ns.stdout.strip() == data["namespace"] == data["lmcache_model_name"]
    text = kvp("identity", "show", "cpu-demo")
    assert data["namespace"] in text.stdout and "KVP_MODEL_REVISION" in text.stdout


def test_identity_diff(tmp_path: Path) -> None:
    src = (REPO / "configs/cpu-demo/identity.env").read_text()
    other = tmp_path / "other" / "identity.env"
    other.parent.mkdir()
    other.write_text(src.replace("KVP_MAX_MODEL_LEN=4096", "KVP_MAX_MODEL_LEN=2048")
                        .replace("KVP_L1_SIZE_GB=1", "KVP_L1_SIZE_GB=2"))
    res = kvp("identity", "diff", "cpu-demo", str(other), "--json")
    assert res.returncode == 1
    data = json.loads(res.stdout)
    assert data["same_namespace"] is False
    assert data["differences"] == [{"field": "max_model_len", "a": 4096, "b": 2048}]
    same = tmp_path / "same" / "identity.env"
    same.parent.mkdir()
    same.write_text(src.replace("KVP_L1_SIZE_GB=1", "KVP_L1_SIZE_GB=2"))
    res = kvp("identity", "diff", "cpu-demo", str(same))
    assert res.returncode == 0 and "same namespace" in res.stdout


def test_template_sha_of_file_and_tokenizer_config(tmp_path: Path) -> None:
    tpl = (REPO / "configs/cpu-demo/chat_template.jinja").read_text()
    cfg = tmp_path / "tokenizer_config.json"
    cfg.write_text(json.dumps({"chat_template": tpl, "bos_token": "<s>"}))
    a = kvp("identity", "template-sha", str(REPO / "configs/cpu-demo/chat_template.jinja"))
    b = kvp("identity", "template-sha", str(cfg))
    assert a.returncode == b.returncode == 0
    assert a.stdout == b.stdout
    expected = [line for line in (REPO / "configs/cpu-demo/identity.env").read_text().splitlines()
                if line.startswith("KVP_CHAT_TEMPLATE_SHA256=")][0].split("=")[1]
    assert a.stdout.strip() == expected


def test_config_error_exit_2_lists_everything_without_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.env"
    bad.write_text("KVP_MODEL_ID=x\nKVP_BLOCK_SIZE=zero\nKVP_TYPO=1\nnot a line\n")
    res = kvp("render", str(bad))
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
    assert "bad.env:4" in res.stderr  # parse errors first, all lines
    bad.write_text("KVP_MODEL_ID=x\nKVP_BLOCK_SIZE=zero\nKVP_TYPO=1\n")
    res = kvp("render", str(bad))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    for key in ("KVP_BLOCK_SIZE", "KVP_TYPO", "KVP_MODEL_REVISION", "KVP_CACHE_ROOT"):
        assert key in res.stderr


def test_unknown_config_name_lists_available() -> None:
    res = kvp("render", "no-such-model")
    assert res.returncode == 2
    assert "cpu-demo" in res.stderr and "Traceback" not in res.stderr


def test_production_config_refused_until_pinned_and_unpinned_opt_in() -> None:
    res = kvp("render", "mimo-pro-tp4")
    assert res.returncode == 2 and "KVP_CHAT_TEMPLATE_SHA256" in res.stderr
    env = dict(clean_env(), KVP_L1_SIZE_GB="2")  # fits this host's RAM (budget plan)
    res = kvp("render", "mimo-pro-tp4", "--allow-unpinned", "--json", env=env)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["namespace"].startswith("kvp-unpinned-") and data["pinned"] is False
    again = json.loads(kvp("render", "mimo-pro-tp4", "--allow-unpinned", "--json",
                           env=env).stdout)
    assert again["namespace"] != data["namespace"]  # one-off: never matches earlier data


def test_render_refuses_an_l1_that_does_not_fit_in_ram(tmp_path: Path) -> None:
    env = dict(clean_env(), KVP_CACHE_ROOT=str(tmp_path), KVP_L1_SIZE_GB="100000")
    res = kvp("render", "cpu-demo", env=env)
    assert res.returncode == 2 and "KVP_L1_SIZE_GB" in res.stderr
    assert "Traceback" not in res.stderr


def test_render_json_schema_and_out_dir(tmp_path: Path) -> None:
    env = dict(clean_env(), KVP_CACHE_ROOT=str(tmp_path / "cache"))
    res = kvp("render", "cpu-demo", "--json", "--out", str(tmp_path / "out"), env=env)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    for key in ("namespace", "lmcache_model_name", "lmcache_server_argv", "vllm_argv",
                "kv_transfer_config", "manifest"):
        assert key in data
    assert isinstance(data["lmcache_server_argv"], list) and isinstance(data["vllm_argv"], list)
    written = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert written == ["kv-transfer-config.json", "l2-adapter.json", "lmcache-server.argv",
                       "manifest.json", "render.json", "vllm.argv"]
    for p in (tmp_path / "out").iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
    manifest = json.loads((tmp_path / "out/manifest.json").read_text())
    assert manifest == data["manifest"]
    assert manifest["namespace"] == data["namespace"]
    assert json.loads(manifest["canonical_json"]) == manifest["identity"]


@pytest.mark.parametrize("args", [["--help"], ["identity", "show", "cpu-demo"],
                                  ["render", "cpu-demo", "--json"]])
def test_plain_commands_never_import_lmcache_or_torch(args: list[str]) -> None:
    code = ("import sys\nfrom kvpersist.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "heavy = [m for m in ('lmcache', 'torch', 'vllm', 'transformers')"
            " if m in sys.modules]\n"
            "print('HEAVY=' + ','.join(heavy), file=sys.stderr)\n")
    env = dict(clean_env(), KVP_CACHE_ROOT="/tmp/kvp-import-check")
    res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                         env=env, cwd=REPO)
    assert "HEAVY=\n" in res.stderr or res.stderr.rstrip().endswith("HEAVY="), res.stderr


def test_console_script_and_module_agree() -> None:
    exe = Path(sys.executable).parent / "kvp-admin"
    a = subprocess.run([str(exe), "identity", "namespace", "cpu-demo"], capture_output=True,
                       text=True, env=clean_env())
    b = kvp("identity", "namespace", "cpu-demo")
    assert a.returncode == 0 and a.stdout == b.stdout


def test_launch_check_is_preflight_only(tmp_path: Path) -> None:
    env = dict(clean_env(), KVP_CACHE_ROOT=str(tmp_path / "cache"),
               KVP_MODEL_PATH=str(tmp_path / "no-weights"))
    res = kvp("launch", "cpu-demo", "--check", "--json", env=env)
    assert res.returncode == 2 and "KVP_MODEL_PATH" in res.stderr
    assert json.loads(res.stdout)["ok"] is False
    res = kvp("launch", "cpu-demo", "--check", "--no-vllm", env=env)
    assert res.returncode == 0, res.stderr
    assert "preflight ok" in res.stdout
    assert not (tmp_path / "cache" / "lmcache-server.pid").exists()  # nothing started
