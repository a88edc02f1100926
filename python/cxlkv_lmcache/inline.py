"""The inline-bytes data path, for processes that cannot map the pool: bytes
stream through the sidecar over gRPC (InlinePut / InlineGet)."""

from __future__ import annotations

import ctypes
from typing import Callable

import grpc

from cxlkv_lmcache import client as cl
from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_lmcache.state import Task, time_left


class InlinePath:
    """Stores and loads through the sidecar. Bytes leave or enter LMCache's
    buffers only inside `begin_copy(task)` … `end_copy(task)`, so a task the
    watchdog already failed never touches them (its buffers may be reused)."""

    def __init__(self, stub, begin_copy: Callable[[Task], bool], end_copy: Callable[[Task], None],
                 declined: Callable[[], None] = lambda: None):
        self._stub = stub
        self._begin_copy = begin_copy
        self._end_copy = end_copy
        self._declined = declined

    def store(self, task: Task, tenant: str, items: list, present: set | None = None) -> tuple[bool, int, list]:
        """Items are (token, encoded key, source address, size). Returns (all
        stored, there already or not admitted, bytes written, (token, encoded
        key, size, removal-log seq) per newly stored key)."""
        ok, written, new = True, 0, []
        for k, e, src, size in items:
            if not self._begin_copy(task):
                return False, written, new
            try:  # copy out of the caller's buffer while the task is live; stream afterwards
                data = ctypes.string_at(src, size) if size else b""
            finally:
                self._end_copy(task)
            header = pb.InlinePutHeader(key=e, tenant=tenant, size=size)
            chunks = [pb.InlinePutChunk(header=header)] + [
                pb.InlinePutChunk(data=data[i : i + cl.INLINE_CHUNK]) for i in range(0, size, cl.INLINE_CHUNK)
            ]
            rep = self._stub.InlinePut(iter(chunks), timeout=time_left(task.deadline))
            if rep.status.code == cl.OK:
                written += size
                new.append((k, e, size, rep.removed_seq))
            elif rep.status.code == cl.NOT_ADMITTED:
                self._declined()  # skipped: the sidecar wrote nothing
            elif rep.status.code != cl.ALREADY_EXISTS:
                ok = False
            elif present is not None:
                present.add(e)
        return ok, written, new

    def load(self, task: Task, enc: list[bytes], dsts: list[tuple[int, int]]) -> list[int]:
        """The indices of `dsts` ((address, size) each) filled with their
        key's whole object."""
        loaded = []
        for i, (k, (dst, size)) in enumerate(zip(enc, dsts)):
            stream = self._stub.InlineGet(pb.InlineGetRequest(key=k), timeout=time_left(task.deadline))
            first = next(stream, None)
            if first is None or not first.header.found or first.header.size != size:
                stream.cancel()
                continue
            if not self._begin_copy(task):
                stream.cancel()
                break
            try:
                off = 0
                for msg in stream:
                    n = len(msg.data)
                    if off + n > size:
                        break
                    ctypes.memmove(dst + off, msg.data, n)
                    off += n
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.ABORTED:
                    raise
                off = -1  # the object went away while the sidecar read it: what arrived is void
            finally:
                self._end_copy(task)
            if off == size:
                loaded.append(i)
        return loaded
