"""llm-d's rules for a KV-event publisher, ported from its source and run
against a real sidecar. Ported from llm-d/llm-d-router at commit
ebab687927f5331c1b39defcb579a07951bce56c:

- pkg/kvevents/zmq_subscriber.go: `parseEventFrame` (a message is exactly
  three frames, the sequence at least 8 bytes, big-endian), the live loop
  (a sequence lower than the last live one is a reset: the source is
  cleared and replayed from 0; joining with no sequence yet: replay from
  0; a gap: replay from the last + 1) and `requestReplay` (a DEALER sends
  `["", seq]`; a leading empty frame is stripped; three frames with an
  empty payload end it; every message must be the next sequence expected,
  else the replay is broken and the source invalidated, with a 30 s
  cooldown; an empty replay from a sequence above 0 is broken too).
- pkg/kvevents/engineadapter/vllm_adapter.go: the topic `kv@<pod>@<model>`
  (pod and model are its second and third `@` fields) and the events, maps
  read in vLLM's field order (`blockStoredFieldOrder`,
  `blockRemovedFieldOrder`) or arrays.
- pkg/kvcache/kvblock/ (pseudo-pods): `pool:<name>` names a shared tier
  (`IsPoolPseudoPod`), credited to every endpoint.
- pkg/kvevents/pool.go: `normalizeDeviceTier` (the medium lowercased, ""
  is "gpu"); `AllBlocksCleared` clears the topic's pod.
- pkg/kvcache/kvblock_scorer.go: a medium's weight is its backend
  config's (`kvCacheBackendConfigs`), by the normalised tier's name.
"""

from __future__ import annotations

import itertools
import time

import msgspec
import zmq

from cxlkv_testkit import wait_for

from events_kit import Client, sidecar

BLOCK_STORED_FIELDS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                       "lora_name", "extra_keys", "group_idx"]
BLOCK_REMOVED_FIELDS = ["type", "block_hashes", "medium", "group_idx"]
# What an operator configures for cxlkv's medium (docs/EVENTS.md).
BACKEND_CONFIGS = [{"name": "gpu", "weight": 1.0}, {"name": "shared", "weight": 0.8}]


class ReplayBroken(Exception):
    pass


def parse_event_frame(frames: list[bytes]):
    """zmq_subscriber.go parseEventFrame."""
    if len(frames) != 3 or len(frames[1]) < 8:
        return None
    return frames[0].decode(), int.from_bytes(frames[1][:8], "big"), frames[2]


def parse_topic(topic: str) -> tuple[str, str]:
    """vllm_adapter.go: "kv@<pod-id>@<model-name>"."""
    parts = topic.split("@")
    assert len(parts) >= 3 and parts[0] == "kv", topic
    return parts[1], parts[2]


def decode_events(payload: bytes) -> list[list]:
    """vllm_adapter.go decodeVLLMEvent: each event a positional list."""
    ts, events, rank = msgspec.msgpack.decode(payload)
    out = []
    for ev in events:
        if isinstance(ev, dict):
            order = BLOCK_STORED_FIELDS if ev["type"] == "BlockStored" else BLOCK_REMOVED_FIELDS
            fields = [ev.get(f) for f in order] if ev["type"] != "AllBlocksCleared" else ["AllBlocksCleared"]
            fields[0] = ev["type"]
        else:
            fields = ev
        assert fields[0] in ("BlockStored", "BlockRemoved", "AllBlocksCleared"), fields
        out.append(fields)
    return out


def normalize_device_tier(tier: str | None) -> str:
    """pool.go normalizeDeviceTier."""
    return (tier or "gpu").lower()


def is_pool_pseudo_pod(pod: str) -> bool:
    """kvblock pseudo-pods: IsPoolPseudoPod."""
    return pod.startswith("pool:")


class Llmd:
    """llm-d's subscriber state for one source, and its index: pod → block
    hash → tier."""

    def __init__(self, pub: str, rep: str):
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.connect(pub)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")  # llm-d's default filter
        self.rep = rep
        self.last_seq = self.last_live = None
        self.index: dict[str, dict[int, str]] = {}
        self.resets = 0

    def request_replay(self, start: int) -> bool:
        d = self.ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(self.rep)
        try:
            d.send_multipart([b"", start.to_bytes(8, "big")])
            expected, replayed = start, 0
            while True:
                if not d.poll(2000):  # replayAttemptIdleTimeout
                    raise ReplayBroken("replay went idle")
                frames = d.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) == 3 and frames[2] == b"":
                    break
                parsed = parse_event_frame(frames)
                if parsed is None:
                    raise ReplayBroken(f"malformed replay frame with {len(frames)} frames")
                topic, seq, payload = parsed
                if seq != expected:
                    raise ReplayBroken(f"incomplete replay: expected sequence {expected}, got {seq}")
                self.apply(topic, payload)
                self.last_seq, expected, replayed = seq, expected + 1, replayed + 1
            if replayed == 0 and start > 0:
                raise ReplayBroken(f"incomplete replay: sequence {start} was not available")
            return True
        finally:
            d.close()

    def reset(self, topic: str) -> None:
        self.index.pop(parse_topic(topic)[0], None)
        self.last_seq, self.resets = None, self.resets + 1

    def step(self, wait_ms: int = 200) -> bool:
        """One live message through llm-d's live loop (False: none came)."""
        if not self.sub.poll(wait_ms):
            return False
        parsed = parse_event_frame(self.sub.recv_multipart())
        assert parsed is not None, "llm-d drops a malformed frame"
        topic, seq, payload = parsed
        if self.last_live is not None and seq < self.last_live:
            self.reset(topic)  # "Detected event sequence reset, rebuilding index"
            self.request_replay(0)
        if self.last_live is not None and seq == self.last_live:
            return True
        self.last_live = seq
        if self.last_seq is not None and seq <= self.last_seq:
            return True
        if self.last_seq is not None and seq > self.last_seq + 1:
            self.request_replay(self.last_seq + 1)
        if self.last_seq is None and seq > 0:
            self.request_replay(0)  # "Joining mid-stream, requesting full replay"
        if self.last_seq is not None and seq != self.last_seq + 1:
            return True
        self.apply(topic, payload)
        self.last_seq = seq
        return True

    def apply(self, topic: str, payload: bytes) -> None:
        pod, model = parse_topic(topic)
        held = self.index.setdefault(pod, {})
        for fields in decode_events(payload):
            if fields[0] == "AllBlocksCleared":
                held.clear()  # pod-wide: every tier of the topic's pod
            elif fields[0] == "BlockStored":
                for h in fields[1]:
                    held[h] = normalize_device_tier(fields[6])
            else:
                for h in fields[1]:
                    held.pop(h, None)

    def weight(self, tier: str) -> float:
        """kvblock_scorer.go: the backend config's weight for a tier."""
        return {c["name"]: c["weight"] for c in BACKEND_CONFIGS}.get(tier, 1.0)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def engine_key(i: int) -> bytes:
    from lmcache.utils import CacheEngineKey
    import torch

    from cxlkv_lmcache.keys import encode_engine_key

    return encode_engine_key(CacheEngineKey("llmd-model", 1, 0, 0x8000_0000_0000_0000 + i, torch.bfloat16, None))


def test_llmd_indexes_cxlkv_as_a_shared_pool_and_follows_its_restart(tmp_path):
    s = sidecar(tmp_path, "n", "64MiB").start()
    c = Client(s.socket)
    llmd = Llmd(s.pub, s.rep)
    try:
        time.sleep(0.3)  # the subscription reaches the PUB
        keys = [engine_key(i) for i in range(40)]
        for k in keys:  # one message each: 40 sequences before the restart below
            assert len(c.store([k])) == 1

        def indexed(n: int) -> bool:
            while llmd.step(50):
                pass
            return len(llmd.index.get("pool:cxlkv", {})) == n

        assert wait_for(lambda: indexed(40), timeout=20), llmd.index.keys()
        # Joined after message 0: the replay from 0 was complete and
        # contiguous (requestReplay raised nothing), "all cleared" first.
        assert list(llmd.index) == ["pool:cxlkv"] and is_pool_pseudo_pod("pool:cxlkv")
        hashes = llmd.index["pool:cxlkv"]
        # A 9-byte int hash announced as that int (issue #44 (f)).
        assert set(hashes) == {0x8000_0000_0000_0000 + i for i in range(40)}
        assert set(hashes.values()) == {"shared"} and llmd.weight("shared") == 0.8
        assert c.delete(keys[:10]) == 10
        assert wait_for(lambda: indexed(30), timeout=20)

        # A gap: a replay of a held range fills it (three frames each).
        last = llmd.last_seq
        llmd.last_seq = last - 2
        llmd.request_replay(last - 1)
        assert llmd.last_seq == last

        # A cxlkv restart: sequences start again at 0; llm-d, whose last
        # live sequence is past 40, sees a lower one, resets the pool's pod
        # (never a real pod's) and replays from 0.
        s.kill()
        s.start()
        c.close()
        c = Client(s.socket)
        more = itertools.count(100)

        def followed() -> bool:
            # Stores go on (the SUB reconnects on its own, after a while).
            c.store([engine_key(next(more))])
            while llmd.step(50):
                pass
            want = {0x8000_0000_0000_0000 + i for i in range(10, 40)}
            held = set(llmd.index.get("pool:cxlkv", {}))
            return llmd.resets >= 1 and want <= held and len(held) == len(c.keys())

        assert wait_for(followed, timeout=30), (llmd.resets, len(llmd.index.get("pool:cxlkv", {})))
        assert list(llmd.index) == ["pool:cxlkv"]
    finally:
        llmd.close()
        c.close()
        s.kill()
