"""Hostile deployment settings: every one must be refused with a configuration problem that
names its key (exit 2, never a traceback). Shared by the unit tests (``build_deployment``,
from the file and from the environment) and the CLI tests (``render``, ``launch --check``,
``identity show``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpersist.config.identity import IDENTITY_KEYS

IDENTITY_ENV_KEYS = frozenset(IDENTITY_KEYS.values())

LONG = "a" * 300


@dataclass(frozen=True)
class Hostile:
    """``key`` set to ``value`` (plus ``extra`` settings) must be refused naming ``blame``
    (default: ``key``). ``env_ok``: the value can travel in an environment variable (no
    NUL)."""

    key: str
    value: str
    extra: dict[str, str] = field(default_factory=dict)
    blame: str = ""

    @property
    def env_ok(self) -> bool:
        """Can travel in the environment: no NUL, and not an identity key (the environment
        never overrides those)."""
        return ("\0" not in self.value and all("\0" not in v for v in self.extra.values())
                and self.key not in IDENTITY_ENV_KEYS)

    @property
    def names(self) -> str:
        return self.blame or self.key

    def __str__(self) -> str:
        return f"{self.key}={self.value[:40]!r}" + (f"+{sorted(self.extra)}" if self.extra
                                                    else "")


NUMBERS = ["²", "١٢", "１２", "1_0", "0x10", "-1", "+1", "1e3", "9" * 5000, "", "nan", "٣"]
PORT_ONLY = ["99999", "0", "65536", "123456"]
FLOATS = ["nan", "inf", "-inf", "-1", "0", "1e3", "1_0", "١", "９", "9" * 400, "0x1", "+inf"]
SIZES = ["1\u212a", "9" * 400, "nan%", "inf%", "١٠%", "1e2%", "-5%", "0%", "101%", "1 TB B",
         "5\u017f", "1e400", "nan", "%"]
DIRS = ["/", "/proc", "/proc/self", "/sys", "/dev", "/dev/shm/kvp", "/etc", "/etc/kvp",
        "/usr", "/usr/local/kvp", "/tmp", "/tmp/", "//", "/./", "/var", "/var/lib",
        "/var/tmp", "/var/log", "/home", "/root", "/run", "/run/kvp", "/boot/x", "/lib64/x",
        "/bin", "/sbin/x", "/var/run/kvp", "/mnt", "/opt", "/srv",
        "/var/lib/kvp/..", "/a/../b", f"/a/{LONG}", f"/a/{LONG}/b", "/" + "ab/" * 800,
        "relative", "-x", "/a\0b", "/a\nb", "/a\u2028b", "/a\x85b", "/a\x1bb", "/a$(id)",
        "/a`id`", "/a${HOME}", "/a\u202eb", "/a\ufeffb", "/a\u00a0b"]
HOSTS = ["example.com", "fe80::1%eth0", "127.0.0.1%lo", "127.1", "0", "1.2.3.4.5",
         "::ffff:127.0.0.1", "0:0:0:0:0:0:0:1", "127.000.000.001", "localhost.", " ",
         "0.0.0.0", "::", "10.0.0.1", "192.168.1.5", "2001:db8::1"]
EXTRA_ARGS = ["--hos 0.0.0.0", "--host=0.0.0.0", "--kv_transfer_config {}",
              "--kv-transfer-config.kv_connector X", "--kv-transfer-c {}", "-tp4", "-tp=2",
              "-t 2", "--config x.yaml", "--served_model_name y", "--mod x", "--tensor-parallel 2",
              "--port=1", "--max_model_len 9", "--chat-template x", "--revision main",
              "'unbalanced", "--x \"y", "--x\u2028--host 0.0.0.0", "--x\x0b--host"]
PEERS = ["bogus", "10.0.0.0/33", "any 10.0.0.0/8", "fe80::/10%x", "10.0.0.0/8;id", "*",
         "localhost", "0.0.0.0/0/0"]
CONTROL = ["\0", "\x01", "\t", "\n", "\v", "\f", "\r", "\x1b", "\x7f", "\x85", "\u2028",
           "\u2029", "\u200b", "\u202e", "\ufeff", "\u00a0", "$(id)", "`id`", "${HOME}", "$X"]


def _cases() -> list[Hostile]:
    out: list[Hostile] = []
    for key in ("KVP_LMCACHE_PORT", "KVP_LMCACHE_HTTP_PORT", "KVP_VLLM_PORT"):
        out += [Hostile(key, v) for v in NUMBERS + PORT_ONLY]
    out += [Hostile("KVP_GPU_COUNT", v) for v in NUMBERS + ["99999"]]
    out += [Hostile("KVP_L1_SIZE_GB", v) for v in FLOATS]
    for key in ("KVP_L2_BUDGET", "KVP_L2_RESERVE", "KVP_L2_QUOTA"):
        out += [Hostile(key, v) for v in SIZES]
    out += [Hostile("KVP_CACHE_ROOT", v) for v in DIRS]
    for key in ("KVP_STATE_DIR", "KVP_LOG_DIR", "KVP_MODEL_LINK_DIR"):
        out += [Hostile(key, v) for v in ("/", "/etc", "/proc/self", "/tmp", f"/x/{LONG}",
                                          "/x/\0", "rel")]
    out += [Hostile("KVP_SERDE_KEY_FILE", v) for v in (f"/k/{LONG}", "rel/key", "/k\0",
                                                       "/k/../../etc/shadow")]
    out += [Hostile("KVP_MODEL_PATH", v) for v in (f"/m/{LONG}", "-m", "/m\0", "/m\x1b")]
    for key in ("KVP_LMCACHE_HOST", "KVP_LMCACHE_HTTP_HOST", "KVP_VLLM_HOST"):
        out += [Hostile(key, v) for v in HOSTS]
    out += [Hostile("KVP_VLLM_EXTRA_ARGS", v) for v in EXTRA_ARGS]
    for key, host in (("KVP_ALLOW_REMOTE_LMCACHE", "KVP_LMCACHE_HOST"),
                      ("KVP_ALLOW_REMOTE_LMCACHE_HTTP", "KVP_LMCACHE_HTTP_HOST"),
                      ("KVP_ALLOW_REMOTE_VLLM", "KVP_VLLM_HOST")):
        out += [Hostile(key, v, {host: "0.0.0.0"}) for v in PEERS]
        # an opt-in for a loopback bind allows nothing: an error, not a silent no-op
        out.append(Hostile(key, "10.0.0.0/8"))
    # half-loopback: one port opted in does not open the other
    out.append(Hostile("KVP_LMCACHE_HTTP_HOST", "0.0.0.0",
                       {"KVP_LMCACHE_HOST": "0.0.0.0", "KVP_ALLOW_REMOTE_LMCACHE": "any"}))
    out.append(Hostile("KVP_LMCACHE_HOST", "0.0.0.0",
                       {"KVP_LMCACHE_HTTP_HOST": "0.0.0.0",
                        "KVP_ALLOW_REMOTE_LMCACHE_HTTP": "10.0.0.0/8"}))
    out += [Hostile("KVP_CONTAINER_NAME", v) for v in ("-rm", "a b", "a/b", "a:b", "ü")]
    out += [Hostile("KVP_IMAGE", v) for v in ("--privileged", "a b", "img;rm", "-v/:/h")]
    out += [Hostile("KVP_SERVED_MODEL_NAME", v) for v in ("-x", "a b", "--host")]
    out += [Hostile("KVP_GENERIC_CONFIG", v) for v in ("../generic", "/etc", "a/b", ".")]
    out += [Hostile("KVP_DEVICE", v) for v in ("CUDA", "", "gpu")]
    out += [Hostile("KVP_ALLOW_UNPINNED", v) for v in ("maybe", "2")]
    out += [Hostile("KVP_PREREAD_RAM_SHARE", v)
            for v in ("1.5", "-0.1", "nan", "inf", "1e-1", "25%", "²")]
    # control characters, expansions and invisible characters in every kind of key
    for key in ("KVP_SERVED_MODEL_NAME", "KVP_IMAGE", "KVP_CONTAINER_NAME", "KVP_L2_BUDGET",
                "KVP_VLLM_EXTRA_ARGS", "KVP_LMCACHE_PORT", "KVP_DEVICE", "KVP_MODEL_PATH",
                "KVP_L2_SERDE"):
        out += [Hostile(key, f"x{c}y") for c in CONTROL]
    # identity keys (from the file only)
    for key in ("KVP_BLOCK_SIZE", "KVP_MAX_MODEL_LEN", "KVP_NUM_KV_HEADS"):
        out += [Hostile(key, v) for v in ("²", "１６", "9" * 5000, "1_6", "0x10", "")]
    out += [Hostile("KVP_MODEL_ID", v) for v in ("$(id)", "`id`", "${HOME}", "a\u202eb",
                                                  "a\x85b", "a\u2028b", "a\0b")]
    return out


HOSTILE_SETTINGS = _cases()
