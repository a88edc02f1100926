"""The inline-bytes data path, for processes that cannot map the pool: bytes
stream through the sidecar over gRPC (InlinePut / InlineGet)."""

from __future__ import annotations

import ctypes

import grpc

from cxlkv_lmcache import client as cl
from cxlkv_lmcache import keys as keycodec
from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_lmcache.state import _left, _Task


class InlinePath:
    def _store_inline(self, task, conn, keys, objs):
        ok, written, new = True, 0, []
        for k, o in zip(keys, objs):
            size = o.get_size()
            if not self._begin_copy(task):
                return False, written, new
            try:  # copy out of L1 while the task is live; stream afterwards
                data = bytes(o.byte_array[:size])
            finally:
                self._end_copy(task)
            e = keycodec.encode(k)
            header = pb.InlinePutHeader(key=e, tenant=k.cache_salt, size=size)
            chunks = [pb.InlinePutChunk(header=header)] + [
                pb.InlinePutChunk(data=data[i : i + cl.INLINE_CHUNK]) for i in range(0, size, cl.INLINE_CHUNK)
            ]
            rep = self._stub.InlinePut(iter(chunks), timeout=_left(task.deadline))
            if rep.status.code == cl.OK:
                written += size
                new.append((k, e, size, rep.removed_seq))
            elif rep.status.code != cl.ALREADY_EXISTS:
                ok = False
        return ok, written, new

    def _load_inline(self, task: _Task, enc: list[bytes], objs: list) -> list[int]:
        loaded = []
        for i, (k, o) in enumerate(zip(enc, objs)):
            stream = self._stub.InlineGet(pb.InlineGetRequest(key=k), timeout=_left(task.deadline))
            first = next(stream, None)
            if first is None or not first.header.found or first.header.size != o.get_size():
                stream.cancel()
                continue
            if not self._begin_copy(task):
                stream.cancel()
                break
            try:
                off = 0
                for msg in stream:
                    n = len(msg.data)
                    if off + n > o.get_size():
                        break
                    ctypes.memmove(o.data_ptr + off, msg.data, n)
                    off += n
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.ABORTED:
                    raise
                off = -1  # the object went away while the sidecar read it: what arrived is void
            finally:
                self._end_copy(task)
            if off == o.get_size():
                loaded.append(i)
        return loaded
