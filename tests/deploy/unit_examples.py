"""The rendered unit examples committed under systemd/ (for a host installed by hand).

``python -m tests.deploy.unit_examples`` (from the repository root) rewrites systemd/ from
templates/systemd/*.j2; tests/deploy/test_systemd_render.py fails when they drift apart.
"""

from __future__ import annotations

from pathlib import Path

from kvpersist.deploy.systemd import (
    InstanceSettings,
    UnitSettings,
    render_instance_dropins,
    render_units,
)

REPO = Path(__file__).resolve().parents[2]
SYSTEMD_DIR = REPO / "systemd"

#: Deployments whose drop-ins are shipped as examples: the seed's GPU production deployment
#: (vLLM unit, nvidia devices) and the CPU demo (cache server only).
EXAMPLE_INSTANCES = (
    InstanceSettings(name="mimo-pro-tp4", cache_root="/mnt/nvme0/kvp/mimo-pro-tp4",
                     vllm=True, gpu_devices=True),
    InstanceSettings(name="cpu-demo", cache_root="/var/lib/kvp/cpu-demo"),
)


def example_files(settings: UnitSettings | None = None) -> dict[str, str]:
    """{path relative to systemd/: text} of every example file."""
    files = dict(render_units(settings or UnitSettings(), opt_in=True))
    for instance in EXAMPLE_INSTANCES:
        files.update(render_instance_dropins(instance, opt_in=True))
    return files


def main() -> None:
    for rel, text in example_files().items():
        path = SYSTEMD_DIR / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
