"""Event subscribers as a router or indexer runs them, on ZMQ (vLLM's
schema, by block hash) and on gRPC WatchEvents (by key), each rebuilding the
set of blocks held from the batches in order, strictly: a sequence gap or an
event that contradicts the set is an error. `replay_raw` asks the ROUTER
replay socket directly."""

from __future__ import annotations

import threading

import grpc
import msgspec
import pytest
import zmq

from cxlkv_testkit import wait_for

from cxlkv_lmcache._proto import cxlkv_pb2 as pb

from events_kit import Client, DECODE, DECODE_026, DECODE_LEGACY, END_SEQ



class Broken(AssertionError):
    """What a reconstruction found wrong: a sequence gap, an event that
    contradicts the set (a store of a hash held, a removal of one not held)."""


class Rebuild:
    """The set a subscriber rebuilds from (seq, events) batches applied in
    order: strict — every seq follows the last by one (a jump only where
    `new_epoch_ok` and the batch starts a new source with AllBlocksCleared),
    a stored hash must not be held, a removed one must be."""

    def __init__(self, new_epoch_ok: bool = False):
        self.held: set = set()
        self.last: int | None = None
        self.new_epoch_ok = new_epoch_ok
        self.epochs = 0  # batches that began with AllBlocksCleared
        self.kinds: dict[str, int] = {}
        self.hashes: dict[str, int] = {}  # hashes each kind named

    def apply(self, seq: int, events: list) -> None:
        starts = bool(events) and kind(events[0]) == "AllBlocksCleared"
        if self.last is not None and seq != self.last + 1:
            # A new source numbers from 0 again, "all cleared" first.
            if not (self.new_epoch_ok and starts):
                raise Broken(f"sequence {seq} after {self.last}")
        if self.last is None and not starts:
            raise Broken(f"first batch {seq} does not start the source (AllBlocksCleared)")
        self.last = seq
        for e in events:
            k = kind(e)
            self.kinds[k] = self.kinds.get(k, 0) + 1
            if k == "AllBlocksCleared":
                self.held.clear()
                self.epochs += 1
                continue
            for h in ident(e):
                self.hashes[k] = self.hashes.get(k, 0) + 1
                if k == "BlockStored":
                    if h in self.held:
                        raise Broken(f"batch {seq}: {h!r} stored while held")
                    self.held.add(h)
                else:
                    if h not in self.held:
                        raise Broken(f"batch {seq}: {h!r} removed while not held")
                    self.held.remove(h)


def kind(e) -> str:
    if isinstance(e, pb.Event):
        return {pb.Event.STORED: "BlockStored", pb.Event.REMOVED: "BlockRemoved",
                pb.Event.ALL_CLEARED: "AllBlocksCleared"}[e.kind]
    return type(e).__name__.removeprefix("Array")


def ident(e) -> list:
    return [e.key] if isinstance(e, pb.Event) else list(e.block_hashes)


def rebuild(batches: list[tuple[int, list]], new_epoch_ok: bool = False) -> Rebuild:
    r = Rebuild(new_epoch_ok)
    for seq, events in batches:
        r.apply(seq, events)
    return r


class ZmqSubscriber(threading.Thread):
    """vLLM's subscriber protocol (examples/online_serving/kv_events_subscriber.py):
    SUB (topic, 8-byte seq, msgpack KVEventBatch); on a gap, a replay request
    (8-byte start seq) to the ROUTER through a DEALER, answered by (seq,
    payload) frames up to seq -1. It also asks for everything held from 0 as
    soon as it connects (a subscriber that starts late). Every payload is
    decoded with both vLLM schemas; `batches` is what it applied, in order.
    `skip`: sequences it throws away on receipt (as if lost), to recover
    them by replay. `first_replay`: where its first replay starts."""

    def __init__(self, pub: str, rep: str, name: str = "sub", skip=None, first_replay: int = 0,
                 new_epoch_ok: bool = False, form: str = "map"):
        super().__init__(name=name, daemon=True)
        self.pub, self.rep, self.skip, self.first_replay = pub, rep, skip, first_replay
        self.form = form  # "map": vLLM 0.26's contract (the default); "array": the one before
        self.rebuilt = Rebuild(new_epoch_ok)
        self.batches: list[tuple[int, list]] = []
        self.replayed: list[int] = []  # sequences that came through the ROUTER
        self.replay_answers: list[list[int]] = []  # each replay's sequences, in order
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.halt = threading.Event()
        self.connected = threading.Event()

    def run(self) -> None:
        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)  # never drop on our side
        sub.connect(self.pub)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        replay = ctx.socket(zmq.DEALER)
        replay.setsockopt(zmq.LINGER, 0)
        replay.connect(self.rep)
        try:
            self.connected.set()
            self._replay(replay, self.first_replay, None)
            while not self.halt.is_set():
                if not sub.poll(50):
                    continue
                _, seq_b, payload = sub.recv_multipart()
                seq = int.from_bytes(seq_b, "big")
                if self.skip and self.skip(seq):
                    continue
                last = self.rebuilt.last
                if last is not None and seq < last and self.rebuilt.new_epoch_ok:
                    # The source restarted (numbered from 0 again): everything
                    # from its first message, as llm-d's subscriber does.
                    self.rebuilt.last = None
                    self._replay(replay, 0, None)
                    continue
                if last is not None and seq <= last:
                    continue  # already had it through a replay
                if last is not None and seq > last + 1:
                    self._replay(replay, last + 1, seq)
                    if self.rebuilt.last is not None and seq <= self.rebuilt.last:
                        continue
                self._apply(seq, payload)
        except BaseException as e:
            self.error = e
        finally:
            sub.close()
            replay.close()
            ctx.term()

    def _replay(self, sock, start: int, upto: int | None) -> None:
        """Ask for everything held from `start`; apply what follows the last
        applied (below `upto`, the live message that showed the gap)."""
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        got = []
        while True:
            if not sock.poll(10_000):
                raise AssertionError(f"replay from {start} never ended")
            frames = sock.recv_multipart()
            if self.form == "map":
                # vLLM 0.26: ["", topic, seq, payload]; the end: ["", "", -1, ""].
                assert frames[0] == b"" and len(frames) == 4, frames
                frames = [b"", frames[2], frames[3], frames[1]]
            assert frames[0] == b"" and len(frames) in (3, 4), frames
            seq = int.from_bytes(frames[1], "big", signed=True)
            if seq == END_SEQ:
                assert frames[2:] in ([b""], [b"", b""]), frames
                break
            got.append(seq)
            last = self.rebuilt.last
            if (last is None or seq > last) and (upto is None or seq < upto):
                self.replayed.append(seq)
                self._apply(seq, frames[2])
        self.replay_answers.append(got)

    def _apply(self, seq: int, payload: bytes) -> None:
        if self.form == "map":
            # vLLM 0.26's own classes decode every event; the older array
            # classes must not (the forms are told apart: checked on the
            # first messages, which hold every kind of event).
            batch = DECODE_026.decode(payload)
            if len(self.batches) < 16:
                with pytest.raises(msgspec.ValidationError):
                    DECODE.decode(payload)
        else:
            batch = DECODE.decode(payload)
            legacy = DECODE_LEGACY.decode(payload)
            assert [type(e).__name__ for e in batch.events] == \
                [type(e).__name__.removeprefix("Legacy") for e in legacy.events]
        assert batch.data_parallel_rank == 0
        for e in batch.events:
            if type(e).__name__ == "BlockStored":
                assert (e.parent_block_hash, e.token_ids, e.lora_id, e.lora_name, e.medium) == \
                    (None, [], None, None, "SHARED"), e
        with self.lock:
            self.rebuilt.apply(seq, batch.events)
            self.batches.append((seq, batch.events))

    def held(self) -> set:
        with self.lock:
            return set(self.rebuilt.held)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        self.halt.set()
        self.join(timeout=10)


class GrpcSubscriber(threading.Thread):
    """WatchEvents{epoch, since} on one node; `batches` as received."""

    def __init__(self, sock: str, since: int = 0, epoch: int = 0, new_epoch_ok: bool = False, rebuild: bool = True):
        super().__init__(name=f"watch-{sock}", daemon=True)
        self.client = Client(sock)
        self.req = pb.WatchEventsRequest(epoch=epoch, since=since)
        self.rebuilt = Rebuild(new_epoch_ok) if rebuild else None
        self.batches: list[pb.EventBatch] = []
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self.call = None

    def run(self) -> None:
        try:
            self.call = self.client.stub.WatchEvents(self.req)
            for b in self.call:
                with self.lock:
                    self.batches.append(b)
                    if self.rebuilt is not None:
                        self.rebuilt.apply(b.seq, list(b.events))
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.CANCELLED:
                self.error = e
        except BaseException as e:
            self.error = e

    def held(self) -> set:
        with self.lock:
            return set(self.rebuilt.held)

    def reasons(self) -> dict[str, int]:
        out: dict[str, int] = {}
        with self.lock:
            for b in self.batches:
                for e in b.events:
                    if e.kind == pb.Event.REMOVED:
                        out[e.reason] = out.get(e.reason, 0) + 1
        return out

    def stop(self) -> None:
        if self.call is not None:
            self.call.cancel()
        self.join(timeout=10)
        self.client.close()


def converged(subs, want: set, timeout: float = 30) -> bool:
    """Every subscriber's rebuilt set is `want` (waited for: events arrive
    after the calls that caused them return)."""
    def ok():
        for s in subs:
            if s.error is not None:
                raise s.error
        return all(s.held() == want for s in subs)
    return wait_for(ok, timeout=timeout, every=0.05)


def diff(got: set, want: set) -> str:
    return f"missing {len(want - got)} (e.g. {sorted(want - got, key=repr)[:3]}), " \
           f"extra {len(got - want)} (e.g. {sorted(got - want, key=repr)[:3]})"


def replay_raw(rep: str, start: int, form: str = "map") -> list[tuple[int, bytes]]:
    """One replay request through a DEALER: (seq, payload) of each message
    answered, up to the end marker (checked for the contract's form)."""
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(rep)
    try:
        d.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert d.poll(10_000), "the replay never ended"
            f = d.recv_multipart()
            if form == "map":
                assert len(f) == 4 and f[0] == b"", f  # ["", topic, seq, payload]
                f = [f[0], f[2], f[3], f[1]]
            q = int.from_bytes(f[1], "big", signed=True)
            if q == END_SEQ:
                assert f[2] == b"" and (form != "map" or f[3] == b""), f
                return out
            out.append((q, f[2]))
    finally:
        d.close()
        ctx.term()
