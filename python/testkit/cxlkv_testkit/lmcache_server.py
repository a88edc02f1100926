"""`lmcache server` (LMCache's multiprocess server) with the plugin as its
L2 adapter, and an inference worker driving it through LMCache's own
engine-driven transfer context."""

from __future__ import annotations

import json
import pathlib
import signal
import subprocess
import sys
import urllib.request

from .adapters import plugin_json
from .procs import free_port, wait_for

# Small geometry for the KV caches a test worker registers: chunks of 64
# tokens in blocks of 16; 2 layers of (K/V, blocks, 16, 2 heads, 64) bf16,
# so one LMCache chunk is 64 KiB (16 of the kit's 4 KiB pages).
LMCACHE_CHUNK_TOKENS, BLOCK_TOKENS, KV_BLOCKS, KV_LAYERS, KV_HEADS, HEAD_SIZE = 64, 16, 64, 2, 2, 64
LMCACHE_CHUNK_BYTES = KV_LAYERS * 2 * LMCACHE_CHUNK_TOKENS * KV_HEADS * HEAD_SIZE * 2


def _http(url: str, body: dict | None = None):
    """GET (or POST `body` as JSON) and decode the answer; None when the
    server does not answer or answers with an error."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return json.loads(r.read())
    except Exception:
        return None


class LMCacheServer:
    """One `lmcache server` process (LMCache's multiprocess server) with the
    plugin as its only L2 adapter, on the sidecar socket given. Engine-driven
    transfer over pickled messages: the mode that needs no accelerator and
    no shared-memory segment of LMCache's own."""

    def __init__(self, dir: pathlib.Path, socket: str, name: str = "lmcache", **params):
        self.exe = str(pathlib.Path(sys.executable).parent / "lmcache")
        self.port, self.http_port = free_port(), free_port()
        self.rpc_url = f"tcp://127.0.0.1:{self.port}"
        self.base = f"http://127.0.0.1:{self.http_port}"
        self.log = dir / f"{name}.log"
        self.args = [self.exe, "server", "--host", "127.0.0.1", "--port", str(self.port), "--http-host", "127.0.0.1",
                     "--http-port", str(self.http_port), "--chunk-size", str(LMCACHE_CHUNK_TOKENS),
                     "--l1-size-gb", "0.0625", "--eviction-policy", "LRU", "--disable-observability",
                     "--supported-transfer-mode", "engine_driven",
                     "--l2-adapter", plugin_json(socket, poll_interval_ms=100, **params)]
        self.proc: subprocess.Popen | None = None

    def start(self) -> "LMCacheServer":
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT)
        # Importing torch and LMCache takes a few seconds on a loaded VM.
        if not wait_for(lambda: self.proc.poll() is not None or (self.get("/healthcheck") or {}).get("status") ==
                        "healthy", timeout=90) or self.proc.poll() is not None:
            self.stop()  # `with LMCacheServer(...).start()` never reaches __exit__ when start() raises
            raise RuntimeError(f"lmcache server did not start: {self.tail()}")
        return self

    def errors(self) -> list[str]:
        """Lines of its log where LMCache reports an error: a failed store or
        load in the plugin is logged there and not always seen by a client."""
        return [line for line in self.log.read_text(errors="replace").splitlines()
                if "ERROR" in line or "Traceback" in line]

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def get(self, path: str):
        return _http(self.base + path)

    def post(self, path: str, body: dict):
        return _http(self.base + path, body)

    def status(self) -> dict:
        return self.get("/status") or {}

    def l2_status(self) -> dict:
        """The plugin's report_status(), as the server shows it."""
        return (self.status().get("storage_manager", {}).get("l2_adapters") or [{}])[0]

    def l2_healthy(self) -> bool | None:
        return self.l2_status().get("is_healthy")

    def l1_objects(self) -> int:
        return self.status()["storage_manager"]["l1_manager"]["total_object_count"]

    def l2_entries(self) -> list[dict]:
        """Objects the L2 adapter lists (LMCache asks the plugin)."""
        return (self.get("/cache/objects?tier=l2") or {}).get("entries", [])

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "LMCacheServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class KVWorker:
    """An inference worker as `lmcache server` sees one: paged KV caches on
    the CPU, registered through LMCache's own engine-driven transfer context,
    and the server's LOOKUP / STORE / RETRIEVE requests sent through LMCache's
    own request client (the path `lmcache bench server --mode cpu` takes)."""

    MODEL = "cxlkv-test-model"

    def __init__(self, rpc_url: str, instance_id: int = 1000):
        import torch
        import zmq
        from lmcache.utils import EngineType
        from lmcache.v1.multiprocess.group_view import EngineGroupInfo
        from lmcache.v1.multiprocess.transfer_context import EngineDrivenTransferContext
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self.zmq = zmq.Context()
        self.zmq.setsockopt(zmq.LINGER, 0)
        self.client = RequestClientFactory.create(rpc_url, context=self.zmq)
        self.ctx = None
        try:
            assert self.client.get_chunk_size().result(timeout=10) == LMCACHE_CHUNK_TOKENS
            shape = (2, KV_BLOCKS, BLOCK_TOKENS, KV_HEADS, HEAD_SIZE)
            self.kv = {f"layer.{i}": torch.zeros(shape, dtype=torch.bfloat16) for i in range(KV_LAYERS)}
            self.ctx = EngineDrivenTransferContext(instance_id, self.client)
            group = EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(KV_LAYERS)),
                                    tokens_per_block=BLOCK_TOKENS)
            self.ctx.register(self.kv, self.MODEL, 1, self.blocks_per_chunk, 10.0, layout_hints={"kv_layout": "NHD"},
                              engine_group_infos=[group], engine_type=EngineType.VLLM)
        except BaseException:
            self.close()
            raise
        self._session = 0

    blocks_per_chunk = LMCACHE_CHUNK_TOKENS // BLOCK_TOKENS

    @staticmethod
    def tokens(seq: int, chunks: int) -> tuple[int, ...]:
        """A token sequence of whole chunks, distinct per `seq` from its first token."""
        return tuple(seq * 100_000 + i for i in range(chunks * LMCACHE_CHUNK_TOKENS))

    def _key(self, tokens, request_id: str, worker_id: int | None):
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        return IPCCacheServerKey(model_name=self.MODEL, world_size=1, num_kv_readers=1, worker_id=worker_id,
                                 token_ids=tuple(tokens), start=0, end=len(tokens), request_id=request_id)

    def _request_id(self) -> str:
        self._session += 1
        return f"req-{id(self)}-{self._session}"

    def _blocks(self, first_block: int, tokens) -> list[int]:
        return list(range(first_block, first_block + len(tokens) // BLOCK_TOKENS))

    def fill(self, first_block: int, tokens, seed: int) -> None:
        """Writes known bytes (see `expected`) into the blocks holding `tokens`."""
        for layer, want in zip(self.kv.values(), expected(seed, len(tokens))):
            layer[:, first_block:first_block + want.shape[1]].copy_(want)

    def read(self, first_block: int, tokens) -> list:
        n = len(tokens) // BLOCK_TOKENS
        return [layer[:, first_block:first_block + n].clone() for layer in self.kv.values()]

    def store(self, tokens, first_block: int) -> bool:
        rid = self._request_id()
        try:
            fut = self.ctx.submit_store(rid, self._key(tokens, rid, 0), self.kv, [self._blocks(first_block, tokens)],
                                        None, self.blocks_per_chunk)
            return bool(fut.result(timeout=10))
        finally:
            self.client.end_session(rid).result(timeout=10)

    def lookup_and_retrieve(self, tokens, first_block: int) -> int:
        """LOOKUP (the server finds the prefix in L1 or L2 and prefetches it
        into L1), then RETRIEVE the hit chunks into the blocks from
        `first_block`. Returns the number of hit chunks."""
        rid = self._request_id()
        try:
            self.client.lookup(self._key(tokens, rid, None), 1).result(timeout=10)
            hits = None

            def done() -> bool:
                nonlocal hits
                hits = self.client.query_prefetch_status(rid).result(timeout=10)
                return hits is not None

            assert wait_for(done, timeout=20, every=0.05), "the server never finished the lookup"
            if hits:
                got = tokens[:hits * LMCACHE_CHUNK_TOKENS]
                fut = self.ctx.submit_retrieve(rid, self._key(got, rid, 0), self.kv, [self._blocks(first_block, got)],
                                               None, self.blocks_per_chunk)
                assert fut.result(timeout=10), "RETRIEVE of looked-up chunks failed"
            return hits
        finally:
            self.client.end_session(rid).result(timeout=10)

    def close(self) -> None:
        try:
            if self.ctx is not None:
                try:
                    fut = self.ctx.unregister()
                    if fut is not None:
                        fut.result(timeout=10)
                finally:
                    self.ctx.close()
                    self.ctx = None
        finally:
            # The context's sockets close first, or term() waits for them.
            self.client.close()
            self.zmq.term()

    def __enter__(self) -> "KVWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def expected(seed: int, n_tokens: int) -> list:
    """Per layer, the (K/V, blocks, block tokens, heads, head size) bytes a
    worker fills for `seed`: random, so a chunk from the wrong place or a
    half-copied one cannot match."""
    import torch

    g = torch.Generator().manual_seed(seed)
    shape = (2, n_tokens // BLOCK_TOKENS, BLOCK_TOKENS, KV_HEADS, HEAD_SIZE)
    return [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(KV_LAYERS)]


def same_bytes(got: list, want: list) -> bool:
    import torch

    return len(got) == len(want) and all(
        a.shape == b.shape and torch.equal(a.contiguous().view(torch.int16), b.contiguous().view(torch.int16))
        for a, b in zip(got, want))
