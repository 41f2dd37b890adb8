"""Model directories for tests, in the real download layouts, without any weights.

* :func:`hub_snapshot`: the Hugging Face hub client's cache layout
  (``models--ORG--NAME/{blobs,refs/main,snapshots/<commit>/<file> -> ../../blobs/<id>}``);
* :func:`local_dir`: a ``--local-dir`` download, its records written by huggingface_hub's
  own ``write_download_metadata`` (``.cache/huggingface/download/<file>.metadata``);
* :func:`plain_dir`: files only, no record of where they came from.

By default the files are those of the tiny demo model that identity derive and check read
(config.json, tokenizer_config.json, chat_template.jinja), so they agree with
configs/cpu-demo/identity.env.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from kvpersist.demo.model import CHAT_TEMPLATE, CPU_DEMO_REPO, CPU_DEMO_REVISION

#: config.json of the tiny demo model, as transformers 5 writes it (no weights needed)
DEMO_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16",
    "hidden_size": 256, "intermediate_size": 688, "num_attention_heads": 4,
    "num_hidden_layers": 4, "num_key_value_heads": 2, "head_dim": 64,
    "max_position_embeddings": 4096, "vocab_size": 8192,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
}
DEMO_TOKENIZER_CONFIG: dict[str, Any] = {
    "bos_token": "<s>", "eos_token": "</s>", "model_max_length": 4096,
    "tokenizer_class": "TokenizersBackend",
}


def demo_files(**config_changes: Any) -> dict[str, str | bytes]:
    """The demo model's metadata files; ``config_changes`` update config.json (None removes
    a key)."""
    config = dict(DEMO_CONFIG)
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return {"config.json": json.dumps(config, indent=2),
            "tokenizer_config.json": json.dumps(DEMO_TOKENIZER_CONFIG, indent=2),
            "chat_template.jinja": CHAT_TEMPLATE}


def _data(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else value


def plain_dir(path: Path, files: dict[str, str | bytes] | None = None) -> Path:
    """Write ``files`` (default: the demo's) into ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    for name, value in (files if files is not None else demo_files()).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(_data(value))
    return path


def hub_snapshot(hub: Path, files: dict[str, str | bytes] | None = None,
                 repo_id: str = CPU_DEMO_REPO, revision: str = CPU_DEMO_REVISION) -> Path:
    """Lay ``files`` out as the hub client caches ``repo_id`` at ``revision`` under the hub
    cache ``hub``; return the snapshot directory."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision)
    snap.mkdir(parents=True, exist_ok=True)
    for name, value in (files if files is not None else demo_files()).items():
        data = _data(value)
        blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        (snap / name).parent.mkdir(parents=True, exist_ok=True)
        depth = "../" * (name.count("/") + 2)
        if (snap / name).is_symlink():
            (snap / name).unlink()
        os.symlink(f"{depth}blobs/{blob}", snap / name)
    return snap


def local_dir(path: Path, files: dict[str, str | bytes] | None = None,
              revision: str = CPU_DEMO_REVISION) -> Path:
    """Write ``files`` into ``path`` as ``hf download --local-dir`` does, each with its
    download record naming ``revision``."""
    from huggingface_hub._local_folder import write_download_metadata

    files = files if files is not None else demo_files()
    plain_dir(path, files)
    for name, value in files.items():
        data = _data(value)
        write_download_metadata(path, name, revision, hashlib.sha1(data).hexdigest())
    return path


def cpu_demo_config(tmp: Path, **changes: str) -> Path:
    """A copy of configs/cpu-demo/identity.env with identity keys changed; its directory."""
    from .conftest import REPO

    lines = []
    for line in (REPO / "configs" / "cpu-demo" / "identity.env").read_text().splitlines():
        key = line.split("=", 1)[0]
        lines.append(f"{key}={changes.pop(key)}" if key in changes else line)
    lines += [f"{k}={v}" for k, v in changes.items()]
    d = tmp / "config"
    d.mkdir(parents=True, exist_ok=True)
    (d / "identity.env").write_text("\n".join(lines) + "\n")
    return d
