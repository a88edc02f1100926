"""Parameters of the cxlkv LMCache adapter (the `adapter_params` object)."""

from __future__ import annotations

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from cxlkv_lmcache import auth, copies

# name: (type, default, help)
_PARAMS: dict[str, tuple[type, object, str]] = {
    "socket": (str, "/tmp/cxlkv/cxlkv.sock", "Unix socket of the cxlkv sidecar"),
    "tcp_address": (str, "", "host:port of the sidecar's TCP listener; used instead of socket when set"),
    "mode": (str, "auto", "data path: 'mmap' (map the pool), 'inline' (bytes over gRPC), 'auto' (mmap if possible)"),
    "deadline_ms": (int, 5000, "every store/lookup/load task completes (or fails) within this time"),
    "lock_ttl_ms": (int, 120000, "TTL of the sidecar lock taken by lookup-and-lock"),
    "workers": (int, 4, "threads running store/lookup/load tasks (copies release the GIL)"),
    "copy_threads": (int, copies.default_threads(), "threads that copy one store or load batch (a batch of "
                                                    "2 MiB or more is cut into slices of >= 1 MiB, so one large "
                                                    "object uses several); 1..64, default three quarters of the "
                                                    "CPUs this process may use (a quarter, at least one, left to "
                                                    "the engine), at most 16"),
    "commit_ride_ms": (int, 2, "how long a finished store batch waits for another running store's Reserve to "
                               "carry its Commit (one round trip fewer); only while such a store is about to "
                               "reserve, else it commits at once; 0 = always an explicit Commit"),
    "lease_ahead_bytes": (int, 64 << 20, "pages reserved ahead of the next store, after each store (as many chunks "
                                         "of its size as it stored), so that store copies at once and binds each "
                                         "chunk's key at commit: one round trip fewer on its path. Bounded also "
                                         "by a quarter of the pin budget and an eighth of the sidecar's capacity; "
                                         "0 = off. Only where the sidecar binds keys at commit (a single node)"),
    "unlock_retry_s": (float, 60.0, "how long a failed unlock is retried before the lock TTL is left to expire"),
    "max_capacity_gb": (float, 0.0, "capacity reported to LMCache; 0 = what the sidecar may own"),
    "poll_interval_ms": (int, 200, "how often sidecar-side removals (evictions) and health are polled"),
    "connect_timeout_ms": (int, 2000, "how long start-up waits for the sidecar before starting unhealthy"),
    "verify_payload": (bool, False, "send a crc32 of each stored object with its commit, and check loaded bytes "
                                    "against the stored crc32 (a mismatch is a miss); always on when the sidecar "
                                    "requires checksums"),
    "token_file": (str, "", "file holding a bearer token sent with every call (re-read within a second of a "
                            "change); needed when the sidecar has auth.tokens_file"),
    "tls_ca": (str, "", "CA bundle (PEM) of the sidecar's certificate; set = TLS to tcp_address"),
    "tls_cert": (str, "", "client certificate (PEM) for mutual TLS; needs tls_key and tls_ca"),
    "tls_key": (str, "", "key (PEM) of tls_cert"),
    "tls_server_name": (str, "", "name the sidecar's certificate must carry (default: the host of tcp_address)"),
}
_MODES = ("auto", "mmap", "inline")


class CxlKvL2AdapterConfig(L2AdapterConfigBase):
    """Parameters of ``CxlKvL2Adapter`` (the ``adapter_params`` object)."""

    def __init__(self, **kw):
        for name, (_, default, _) in _PARAMS.items():
            setattr(self, name, kw.get(name, default))

    @classmethod
    def from_dict(cls, d: dict) -> "CxlKvL2AdapterConfig":
        if not isinstance(d, dict):
            raise ValueError(f"cxlkv adapter_params must be an object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_PARAMS))
        if unknown:
            raise ValueError(f"unknown cxlkv adapter_params {unknown}; known: {sorted(_PARAMS)}")
        out = {}
        for name, value in d.items():
            typ = _PARAMS[name][0]
            ok = isinstance(value, typ) and (typ is bool or not isinstance(value, bool))
            if typ is float and isinstance(value, int) and not isinstance(value, bool):
                value, ok = float(value), True
            if not ok:
                raise ValueError(f"cxlkv adapter_params.{name} must be {typ.__name__}, got {value!r}")
            if typ in (int, float) and value < 0:
                raise ValueError(f"cxlkv adapter_params.{name} must be >= 0, got {value!r}")
            out[name] = value
        cfg = cls(**out)
        if cfg.mode not in _MODES:
            raise ValueError(f"cxlkv adapter_params.mode must be one of {_MODES}, got {cfg.mode!r}")
        if cfg.deadline_ms == 0 or cfg.workers == 0 or cfg.lock_ttl_ms == 0 or cfg.poll_interval_ms == 0:
            raise ValueError("cxlkv deadline_ms, lock_ttl_ms, workers and poll_interval_ms must be > 0")
        if not 1 <= cfg.copy_threads <= copies.MAX_THREADS:
            raise ValueError(f"cxlkv adapter_params.copy_threads must be 1..{copies.MAX_THREADS}, "
                             f"got {cfg.copy_threads!r}")
        if not cfg.tcp_address and not cfg.socket:
            raise ValueError("cxlkv adapter_params needs socket or tcp_address")
        cfg._check_credentials()
        return cfg

    def _check_credentials(self) -> None:
        """Credentials must be usable now: a typo fails LMCache's start-up,
        not every call later."""
        tls = [n for n in ("tls_ca", "tls_cert", "tls_key", "tls_server_name") if getattr(self, n)]
        if tls and not self.tcp_address:
            raise ValueError(f"cxlkv adapter_params {tls} need tcp_address (TLS is for the TCP listener)")
        if tls and not self.tls_ca:
            raise ValueError("cxlkv adapter_params.tls_ca is required with tls_cert, tls_key or tls_server_name")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("cxlkv adapter_params.tls_cert and tls_key go together")
        for name in ("tls_ca", "tls_cert", "tls_key"):
            if getattr(self, name):
                auth.read_file(name, getattr(self, name))
        if self.token_file:
            try:
                auth.read_token(self.token_file)
            except OSError as e:
                raise ValueError(f"cxlkv adapter_params.token_file: cannot read {self.token_file!r}: "
                                 f"{e.strerror}") from None
            except ValueError as e:
                raise ValueError(f"cxlkv adapter_params.token_file: {e}") from None

    @classmethod
    def help(cls) -> str:
        lines = ["cxlkv L2 adapter config fields (adapter_params):"]
        lines += [f"- {n} ({t.__name__}, default {d!r}): {h}" for n, (t, d, h) in _PARAMS.items()]
        return "\n".join(lines)


# ------------------------------------------------ in-process engine settings
#
# LMCache's in-process engine hands a storage plugin or remote connector its
# whole LMCacheEngineConfig; the cxlkv settings live in its `extra_config`,
# each the name of an adapter parameter above under the prefix "cxlkv."
# ("cxlkv.socket", "cxlkv.deadline_ms", ...), plus the ones below.
INPROC_PREFIX = "cxlkv."
_INPROC_PARAMS: dict[str, tuple[type, object, str]] = {
    "tenant": (str, "", "tenant namespace of this engine's keys: a key's tenant is its cache_salt tag under it "
                        "('<tenant>/<salt>'; either alone when the other is empty)"),
    "max_view_bytes": (int, 0, "backend: bytes of zero-copy hits (views of pool pages) this engine keeps locked at "
                               "most; past it the least recently read leave LMCache's L1; 0 = an eighth of the "
                               "node's capacity, at most half of what the sidecar lets one client pin"),
    "view_idle_ms": (int, 60000, "backend: a view LMCache has not read for this long leaves its L1 (its lock goes)"),
}
# The backend's views hold their lock for as long as LMCache keeps them, and a
# restarted sidecar removes nothing until view locks granted before it could
# have lapsed: a shorter TTL (renewed a few times per TTL) bounds that wait.
BACKEND_DEFAULTS = {"lock_ttl_ms": 10000}


def inproc_settings(extra: dict | None, defaults: dict | None = None) -> tuple[CxlKvL2AdapterConfig, dict]:
    """(the client's parameters, the in-process-only ones) from an
    LMCacheEngineConfig's extra_config, with `defaults` for parameters it
    does not set; ValueError names a bad one."""
    params = {k[len(INPROC_PREFIX):]: v for k, v in (extra or {}).items()
              if isinstance(k, str) and k.startswith(INPROC_PREFIX)}
    params = {**(defaults or {}), **params}
    own = {}
    for name, (typ, default, _) in _INPROC_PARAMS.items():
        value = params.pop(name, default)
        if not isinstance(value, typ) or (typ is int and (isinstance(value, bool) or value < 0)):
            raise ValueError(f"extra_config {INPROC_PREFIX}{name} must be {typ.__name__}"
                             f"{' >= 0' if typ is int else ''}, got {value!r}")
        own[name] = value
    try:
        cfg = CxlKvL2AdapterConfig.from_dict(params)
    except ValueError as e:
        raise ValueError(str(e).replace("adapter_params.", f"extra_config {INPROC_PREFIX}")
                         .replace("adapter_params", "extra_config")) from None
    return cfg, own


def inproc_help() -> str:
    lines = [f"cxlkv in-process settings (LMCache extra_config, prefix {INPROC_PREFIX!r}):"]
    params = {**_PARAMS, **_INPROC_PARAMS}
    lines += [f"- {INPROC_PREFIX}{n} ({t.__name__}, default {d!r}): {h}" for n, (t, d, h) in params.items()]
    return "\n".join(lines)
