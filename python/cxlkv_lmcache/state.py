"""Small state records and time helpers of the cxlkv LMCache adapter."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import grpc
from lmcache.v1.distributed.api import ObjectKey

from cxlkv_lmcache import client as cl
from cxlkv_lmcache._proto import cxlkv_pb2 as pb


@dataclass
class _Task:
    kind: str
    deadline: float
    n: int
    done: bool = False
    copying: bool = False


@dataclass
class _Held:
    """A key this adapter holds sidecar locks on."""

    count: int
    loc: pb.Location
    expires: float  # monotonic


@dataclass
class _Stored:
    key: ObjectKey
    size: int
    seq: int  # removal-log position at commit: older removals do not apply


@dataclass
class _Conn:
    info: pb.PoolInfoReply | None = None
    pool: cl.PoolMap | None = None
    inline: bool = False
    healthy: bool = False
    last_error: str = ""
    removed_seq: int = 0
    instance: int = 0
    unlock_q: collections.deque = field(default_factory=collections.deque)


def _left(deadline: float) -> float:
    return max(0.001, deadline - time.monotonic())


def _server_deadline(deadline: float) -> int:
    """Unix ms after which the sidecar must refuse the work: 80% of the time
    left, so a reply sent just in time still reaches us before we give up
    (otherwise locks or reservations it took would have no owner)."""
    return int(time.time() * 1000 + max(0.0, deadline - time.monotonic()) * 800)


def _err(e: grpc.RpcError) -> str:
    try:
        return f"{e.code().name}: {e.details()}"
    except Exception:
        return str(e)
