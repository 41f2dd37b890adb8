"""How each supported vLLM release's serve parser differs from 0.32.0's (pure data; the
0.32.0 table is :mod:`kvpersist.config.engine_flag_table`, the code that reads both is
:mod:`kvpersist.config.engine_flags`).

Per release: the dests it adds (rows as in the table, classified with the reason read in that
release's code), the dests whose value shape changed (``dest -> value spec``), and the dests it
removed. How a release spells the negation of an on/off flag (``--no-X``, or also
``--disable-X``/``--enable-X``) is the release's ``bool_style`` in
:mod:`kvpersist.system.vllm_seam`. ``tests/integration/test_engine_flags_vllm.py`` and
``tests/versions/`` walk each release's own parser and fail when a dest or a spelling is not
described here.

Read in vLLM 0.33.0 and 0.34.0 (``vllm/engine/arg_utils.py`` and ``vllm/config/*.py``):

* 0.33 turns every on/off flag into ``EnableDisableAction``: ``--enable-X`` also reads
  ``--disable-X`` (and ``--disable-X`` reads ``--enable-X``), ``--no-X`` stays accepted (hidden
  from help). 50 flags gain a spelling; 16 of them are KV-affecting.
* 0.34's ``--enable-extensible-kv-cache`` reserves the KV cache with device virtual memory;
  kvpersist renders ``--disable-extensible-kv-cache`` (see docs/vllm-versions.md).
"""

from __future__ import annotations

from kvpersist.config.engine_flag_table import LOADIO, LOG, PLACE, RENDER, SCHED

Row = tuple[str, str, str, str, str]

SLEEP = 'frees and restores memory; the same weights are restored'

#: release -> (added rows, changed value specs, removed dests), each relative to the release
#: before it in :data:`kvpersist.system.vllm_seam.RELEASES`
CHANGES: dict[str, tuple[tuple[Row, ...], dict[str, str], tuple[str, ...]]] = {
    "0.33.0": (
        (
            ('monokernel', '--monokernel', 'bool', 'kv-affecting',
             "runs a decoder layer's decode steps on one persistent fused kernel "
             '(KernelConfig.monokernel): other kernels, other rounding'),
            ('reasoning_effort_map', '--reasoning-effort-map', 'json', 'kv-neutral', RENDER),
            ('sleep_mode_backend', '--sleep-mode-backend', 'str', 'kv-neutral', SLEEP),
            ('watchdog_config', '--watchdog-config', 'dataclass', 'kv-neutral',
             'a stack-dump watchdog thread: ' + LOG),
        ),
        {'tool_strict_level': 'str|none'},
        (),
    ),
    "0.34.0": (
        (
            ('cache_aware_admission_threshold', '--cache-aware-admission-threshold', 'float',
             'kv-neutral', SCHED),
            ('cache_aware_admission_window', '--cache-aware-admission-window', 'int',
             'kv-neutral', SCHED),
            ('max_num_inflight_kv_loads', '--max-num-inflight-kv-loads', 'int|none',
             'kv-neutral', SCHED + ' (how many connector loads run at once)'),
            ('checkpoint_prepare_on_startup', '--checkpoint-prepare-on-startup', 'bool',
             'kv-neutral', 'prepares a process checkpoint (sleep mode): ' + SLEEP),
            ('enable_extensible_kv_cache', '--enable-extensible-kv-cache', 'bool', 'owned',
             'kvpersist renders --disable-extensible-kv-cache: LMCache 0.5.6 shares the KV '
             'cache through legacy CUDA IPC, which cannot export driver-mapped memory'),
            ('shuffle_safetensors_files', '--shuffle-safetensors-files', 'bool', 'kv-neutral',
             LOADIO),
            ('headless_client_handshake_address', '--headless-client-handshake-address', 'str',
             'kv-neutral', PLACE + ' (headless engines)'),
        ),
        {'gpu_memory_utilization': 'float|none'},
        (),
    ),
}
