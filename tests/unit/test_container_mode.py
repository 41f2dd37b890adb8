"""vLLM in a container (pure parts): the engine and mounts settings, the rendered argv for a
CPU container with podman, the mounts that would show the container a private path, and the
bind sources of a recipe's run options (the ``KV_PERSIST=1`` hook)."""

from __future__ import annotations

import pytest

from kvpersist.config.deployment import build_deployment
from kvpersist.config.generic import GenericConfig
from kvpersist.deploy.hook_container import mount_sources
from kvpersist.errors import ConfigError
from kvpersist.stack.locate import locate, vllm_mode
from kvpersist.stack.render import container_argv, container_python_argv, render

from .test_identity import BASE
from .test_render import TEMPLATES, flag
from .test_settings import DEPLOY

IMAGE = "localhost/kvp-vllm-cpu:abc"


def dep(**extra: str):
    return build_deployment("ctr-demo", "t.env", {**BASE, **DEPLOY, "KVP_IMAGE": IMAGE,
                                                  **extra}, {}, GenericConfig())


def test_cpu_container_with_podman_mounts_read_only_and_no_host_ipc() -> None:
    d = dep(KVP_DEVICE="cpu", KVP_CONTAINER_ENGINE="podman",
            KVP_CONTAINER_MOUNTS="/opt/venv, /root/.pyenv/versions/3.11.7 /opt/venv")
    assert vllm_mode(d) == "container" and locate(d).container_engine == "podman"
    assert locate(d).container_name == "ctr-demo-kvp"
    r = render(d, TEMPLATES, l1_size_gb=8, l2_capacity_gb=1)
    c = r.container_argv
    assert c[:5] == ["podman", "run", "--rm", "--name", "ctr-demo-kvp"]
    assert flag(c, "--network") == "host"
    assert "--ipc" not in c and "--gpus" not in c and "--shm-size=1g" in c
    vols = [c[i + 1] for i, a in enumerate(c) if a == "-v"]
    assert vols == [f"/models/llama:/kvp-models/{d.namespace}:ro", "/opt/venv:/opt/venv:ro",
                    "/root/.pyenv/versions/3.11.7:/root/.pyenv/versions/3.11.7:ro"]
    assert "--env=VLLM_CPU_KVCACHE_SPACE=1" in c
    assert not [a for a in c if "KVP_" in a or "/var/lib/kvp" in a]
    assert c[c.index(IMAGE) + 1:] == r.vllm_argv
    assert container_argv(d, []) == c[:c.index(IMAGE) + 1]
    py = container_python_argv(d)
    assert py[:6] == ["podman", "run", "--rm", "-i", "--network", "none"]
    assert py[-3:] == ["--entrypoint", "python3", IMAGE] and "/opt/venv:/opt/venv:ro" in py


def test_gpu_container_keeps_docker_host_ipc_and_gpus() -> None:
    c = render(dep(), TEMPLATES, l1_size_gb=8, l2_capacity_gb=1).container_argv
    assert c[0] == "docker" and flag(c, "--ipc") == "host" and flag(c, "--gpus") == "all"


@pytest.mark.parametrize(("key", "value", "message"), [
    ("KVP_CONTAINER_ENGINE", "nerdctl", "must be docker or podman"),
    ("KVP_CONTAINER_MOUNTS", "relative/venv", "absolute path"),
    ("KVP_CONTAINER_MOUNTS", "/opt/a:/b", "without ':'"),
    ("KVP_CONTAINER_MOUNTS", "/", "system directory"),
    ("KVP_CONTAINER_MOUNTS", "/etc/ssl", "system directory"),
    ("KVP_CONTAINER_MOUNTS", "/opt/../etc", "'..'"),
    # what the container must never see: the cache root, the state dir (and what they hold)
    ("KVP_CONTAINER_MOUNTS", "/var/lib/kvp/test", "KVP_CACHE_ROOT /var/lib/kvp/test"),
    ("KVP_CONTAINER_MOUNTS", "/var/lib/kvp", "KVP_STATE_DIR /var/lib/kvp/.kvpersist/test"),
    ("KVP_CONTAINER_MOUNTS", "/var/lib/kvp/.kvpersist/test/keys",
     "KVP_SERDE_KEY_FILE /var/lib/kvp/.kvpersist/test/keys/kvp-"),  # the namespace's key
    ("KVP_MODEL_PATH", "/var/lib/kvp/test/weights", "KVP_CACHE_ROOT"),
])
def test_refused_settings(key: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        dep(**{key: value})
    assert message in str(exc.value) and key in str(exc.value)


def test_without_an_image_mounts_are_not_checked_and_vllm_is_a_process() -> None:
    d = build_deployment("t", "t.env", {**BASE, **DEPLOY, "KVP_DEVICE": "cpu",
                                        "KVP_CONTAINER_MOUNTS": "/var/lib/kvp"}, {},
                         GenericConfig())
    assert vllm_mode(d) == "process"
    assert render(d, TEMPLATES, l1_size_gb=8, l2_capacity_gb=1).container_argv == []


def test_mount_sources_of_a_recipes_run_options() -> None:
    opts = ["--rm", "--name", "r", "--network", "host", "-v", "/models/m:/models/m:ro",
            "--volume=/opt/venv:/opt/venv", "-v/srv/x:/x", "--mount",
            "type=bind,source=/srv/cache,target=/c", "--mount=type=bind,src=/k,dst=/k",
            "-v", "named-volume:/data", "--env", "A=-v/no"]
    assert mount_sources(opts) == ["/models/m", "/opt/venv", "/srv/x", "/srv/cache", "/k"]
