"""The adapter's connection to its sidecar: the gRPC channel and stub, the
last PoolInfo, the pool mapping, and health as calls see it. The adapter's
parts (data paths, removal feed, health watch) share one `Link` instead of
reaching into each other."""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Callable

import grpc

from cxlkv_lmcache import client as cl
from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_lmcache.config import CxlKvL2AdapterConfig
from cxlkv_lmcache.state import Conn, rpc_error, time_left

log = logging.getLogger("cxlkv_lmcache")


class Link:
    """`conn` is replaced on every (re)connect; its fields change in place
    (health, the removal-log position). `on_info` sees each new PoolInfo,
    under the connect lock, before `conn` names it."""

    def __init__(self, cfg: CxlKvL2AdapterConfig, on_info: Callable[[pb.PoolInfoReply], None],
                 on_map: Callable[[cl.PoolMap | None, cl.PoolMap], None] | None = None, session: str = ""):
        self._mode = cfg.mode
        self._on_info = on_info
        self._on_map = on_map  # (old mapping or None, new mapping): e.g. register the new one with CUDA
        self.session = session  # a durable session's name (its locks outlive connections), or ""
        self.channel = cl.channel(cfg.socket, cfg.tcp_address, token_file=cfg.token_file, tls_ca=cfg.tls_ca,
                                  tls_cert=cfg.tls_cert, tls_key=cfg.tls_key, tls_server_name=cfg.tls_server_name,
                                  session=session)
        self.stub = cl.stub(self.channel)
        self.conn = Conn()
        self._lock = threading.Lock()
        self._retired: list[cl.PoolMap] = []
        # Failures seen so far: an answer marks the link healthy only if none
        # came in while it was on its way (`health_mark`, `mark_healthy`).
        self._failures = 0
        self._health = threading.Lock()

    def connect(self, deadline: float, wait: bool = False) -> Conn:
        """Fetch pool info and map the pool (once, or again after a restart)."""
        with self._lock:
            c = self.conn
            if c.info is not None:
                return c
            mark = self.health_mark()
            info = self.stub.PoolInfo(pb.PoolInfoRequest(), timeout=time_left(deadline), wait_for_ready=wait)
            pool, inline = None, self._mode == "inline"
            old = c.pool
            same = old is not None and (old.uuid, old.size, old.coherence) == (
                info.pool_uuid, info.pool_size, info.coherence or "hardware")
            if not inline and same:
                pool = old  # same pool after a sidecar restart: keep the mapping
                pool.follow_node(info.node_id)
            elif not inline:
                try:
                    pool = cl.PoolMap(info)
                except OSError as e:
                    if self._mode == "mmap":
                        raise RuntimeError(
                            f"cxlkv mode 'mmap': cannot map pool {info.path}: {e}; "
                            "mount it into this process or use mode 'inline'"
                        ) from e
                    log.warning("cannot map cxlkv pool %s (%s); using the inline path", info.path, e)
                    inline = True
            self._on_info(info)
            if pool is not None and pool is not old and self._on_map is not None:
                try:
                    self._on_map(old, pool)
                except Exception:
                    log.exception("cxlkv: the new pool mapping's hook failed")
            self.conn = Conn(info=info, pool=pool, inline=inline, instance=info.instance_id,
                             removed_seq=c.removed_seq if c.instance == info.instance_id else 0,
                             unlock_q=c.unlock_q)
            self.mark_healthy(mark)
            if old is not None and old is not pool:
                self._retired.append(old)  # a copy may still use it; unmapped at close()
            log.info("cxlkv connected: pool %s (%s), %s path", info.path, info.pool_uuid,
                     "inline" if inline else "mmap")
            return self.conn

    def forget(self) -> None:
        """The sidecar lost its registry: the next call connects afresh. The
        Conn is replaced, not changed: a task still running on the old one
        keeps the PoolInfo it began with (a reservation of the old instance
        then fails at its commit, and a location of it at its page check)."""
        with self._lock:
            self.conn = dataclasses.replace(self.conn, info=None)

    def rpc_failed(self, e: grpc.RpcError) -> None:
        code = e.code() if hasattr(e, "code") else None
        self.conn.last_error = rpc_error(e)
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            self.mark_unhealthy()

    def health_mark(self) -> int:
        """Taken before a call whose answer will mark the link healthy."""
        with self._health:
            return self._failures

    def mark_healthy(self, mark: int) -> None:
        """An answer came: healthy, unless a failure was seen since `mark`.
        A poll answered just before the sidecar died can arrive after the
        health watch saw its stream break; it must not undo that, or the
        adapter reports a dead sidecar healthy until the next poll."""
        with self._health:
            if self._failures == mark:
                self.conn.healthy = True

    def mark_unhealthy(self) -> None:
        with self._health:
            self._failures += 1
            self.conn.healthy = False

    def close(self, unmap: bool = True) -> None:
        """Close the channel, then unmap every pool mapping (no copy runs any
        more; `unmap` False: views of it may still be read, so it stays)."""
        self.channel.close()
        if not unmap:
            for pool in [self.conn.pool, *self._retired]:
                if pool is not None:
                    pool.stop_ahead()
            return
        for pool in [self.conn.pool, *self._retired]:
            if pool is not None:
                pool.close()
        self.conn.pool = None
        self._retired.clear()
