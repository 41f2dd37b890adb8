"""What a launch is told besides its config (pure, light: ``kvp-admin``'s options read their
defaults here when the CLI loads).

:class:`LaunchOptions` holds every default of ``launch`` and ``restart`` once: the click
options show them (``default=DEFAULTS.x``), the use cases take one frozen object, the launch
sequence reads it; ``tests/unit/test_launch_options.py`` fails when a layer states a default
of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

#: the crash-window check after an unclean stop: at most this many MB/s read (None:
#: unbounded), stop after this many seconds (None: no bound; what is left is checked at the
#: next launch)
CRASH_RATE_MB_S = 200.0
CRASH_SECONDS = 60.0
#: ``stop``/``restart``: seconds from SIGTERM to SIGKILL
STOP_TIMEOUT = 30.0


@dataclass(frozen=True)
class LaunchOptions:
    """The options of one launch (or of the launch half of a restart)."""

    #: start vLLM too (``--no-vllm``: only the cache server)
    with_vllm: bool = True
    #: exec the cache server in this process (systemd's ``--foreground``); no vLLM
    foreground: bool = False
    #: seconds for the cache server to answer its health check (``--timeout``)
    server_timeout: float = 60.0
    #: seconds for vLLM to serve the namespace (``--vllm-timeout``)
    vllm_timeout: float = 600.0
    #: the crash-window check's bounds (``--crash-check-rate``: 0 means unbounded, kept as
    #: None here; ``--crash-check-seconds``)
    crash_rate_mb_s: float | None = CRASH_RATE_MB_S
    crash_seconds: float | None = CRASH_SECONDS
    #: prime vLLM and warm up before ready (``--no-warmup``: neither)
    warmup: bool = True
    #: run the known-answer canary after vLLM serves, before the warm-up (``--no-canary``:
    #: not this launch; KVP_CANARY=false: never)
    canary: bool = True
    #: the warm-up's bound in seconds (None: KVP_WARMUP_WAIT)
    warmup_wait: float | None = None
    #: an incomplete identity gets a one-off namespace (``--allow-unpinned``)
    allow_unpinned: bool = False
    #: launch although LMCache's clean stop would delete files that are not its own
    #: (``--allow-lmcache-tmp-cleanup``, KVP_ALLOW_LMCACHE_TMP_CLEANUP)
    allow_tmp_cleanup: bool = False
    #: run a vLLM outside the supported releases (``--allow-unsupported-vllm``,
    #: KVP_ALLOW_UNSUPPORTED_VLLM)
    allow_unsupported_vllm: bool = False


#: the defaults, for the CLI's options
DEFAULTS = LaunchOptions()
