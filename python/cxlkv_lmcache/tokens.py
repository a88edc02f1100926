"""Token ids for the sidecar's event plane (docs/EVENTS.md "Tokens").

KV-aware routers (Dynamo, llm-d) index the chunks a pool holds by the token
ids they cover. The sidecar learns them when a client hands them with a
store (``ReserveItem.token_ids`` and ``parent_key``, the key of the chunk
before it in its sequence). This module learns them where LMCache 0.5.6
makes them available, without reading anyone's frame:

- the multiprocess L2 adapter: LMCache's observability bus publishes
  ``EventType.MP_TOKENS`` at each store's submission (chunk hashes, their
  tokens and parent hashes; ``lmcache_driven`` transfer mode, worker 0,
  and only while someone subscribes). ``MpTokens`` subscribes and keeps
  the bindings, bounded, by chunk hash.
- the in-process storage backend: with ``enable_kv_events`` the engine
  appends a ``CacheStoreEvent`` (``block_hashes=[chunk_hash]``,
  ``token_ids``, ``parent_block_hash``) for each chunk before it hands the
  chunks to the storage manager. ``EngineTokens`` reads the engine's
  pending events (``engine.kv_events``, left for the connector) when the
  backend is handed the chunks; the engine is the one LMCache's builder
  made with the backend's own config object.

Where neither holds the tokens of a chunk (another transfer mode,
``enable_kv_events`` off, the connector drained the events first), the
chunk is stored without them: routers that index by tokens then credit
nothing for it, and the sidecar still announces its hash.

Bindings are bounded in count (``MAX_BINDINGS``, the oldest dropped first);
a binding is one chunk's tokens (a few hundred ints).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

MAX_BINDINGS = 4096


class Bindings:
    """chunk hash -> (token ids, parent chunk hash), the newest kept."""

    def __init__(self, limit: int = MAX_BINDINGS):
        self._lock = threading.Lock()
        self._map: OrderedDict = OrderedDict()
        self._limit = limit

    def put(self, chunk_hash, tokens, parent) -> None:
        with self._lock:
            self._map[chunk_hash] = (list(tokens), parent)
            self._map.move_to_end(chunk_hash)
            while len(self._map) > self._limit:
                self._map.popitem(last=False)

    def get(self, chunk_hash):
        with self._lock:
            return self._map.get(chunk_hash)

    def __len__(self) -> int:
        return len(self._map)


def reserve_fields(binding, parent_key: bytes | None) -> dict:
    """The ReserveItem fields for a chunk's binding (none without one)."""
    if binding is None or not binding[0]:
        return {}
    fields = {"token_ids": binding[0]}
    if parent_key:
        fields["parent_key"] = parent_key
    return fields


class MpTokens:
    """The multiprocess server's token bindings (``EventType.MP_TOKENS``)."""

    def __init__(self, bus=None, limit: int = MAX_BINDINGS):
        self.bindings = Bindings(limit)
        try:
            from lmcache.v1.mp_observability.event import EventType
            from lmcache.v1.mp_observability.event_bus import get_event_bus
        except ImportError:  # an LMCache without the observability bus
            return
        bus = bus if bus is not None else get_event_bus()
        bus.subscribe(EventType.MP_TOKENS, self._on_tokens)

    def _on_tokens(self, event) -> None:
        md = event.metadata
        for chunk_hash, tokens, parent in zip(md["chunk_hashes"], md["token_chunks"], md["parent_hashes"]):
            self.bindings.put(bytes(chunk_hash), tokens, None if parent is None else bytes(parent))

    def fields(self, keys, encode) -> list[dict]:
        """Per ObjectKey, its ReserveItem token fields (``encode`` makes the
        parent's sidecar key: the same key with the parent's chunk hash)."""
        out = []
        for k in keys:
            b = self.bindings.get(bytes(k.chunk_hash))
            parent = None
            if b is not None and b[1] is not None:
                parent = encode(_with_hash(k, b[1]))
            out.append(reserve_fields(b, parent))
        return out


class EngineTokens:
    """The in-process engine's store events, read where the engine keeps
    them until its connector takes them."""

    def __init__(self, config):
        self.config = config
        self._engine = None

    def engine(self):
        """The engine built with this backend's config (found once)."""
        if self._engine is None and self.config is not None:
            try:
                from lmcache.v1.cache_engine import LMCacheEngineBuilder
            except ImportError:
                return None
            engines = getattr(LMCacheEngineBuilder, "_instances", {})
            self._engine = next((e for e in list(engines.values()) if getattr(e, "config", None) is self.config), None)
        return self._engine

    def _events(self) -> list:
        engine = self.engine()
        if engine is None or not getattr(engine, "kv_events_enabled", False):
            return []
        return list(getattr(engine, "kv_events", None) or ())

    def hand(self, core, keys, encs, encode) -> None:
        """Give ``core`` the token fields of these keys for their store."""
        if self.engine() is not None:
            core.add_token_fields(encs, self.fields(keys, encode))

    def fields(self, keys, encode) -> list[dict]:
        """Per CacheEngineKey, its ReserveItem token fields."""
        by_hash = {}
        for ev in self._events():
            hashes = getattr(ev, "block_hashes", None) or ()
            if len(hashes) == 1 and getattr(ev, "token_ids", None):
                by_hash[hashes[0]] = (list(ev.token_ids), ev.parent_block_hash)
        out = []
        for k in keys:
            b = by_hash.get(k.chunk_hash)
            parent = None
            if b is not None and b[1] is not None:
                parent = encode(_with_hash(k, b[1]))
            out.append(reserve_fields(b, parent))
        return out


def _with_hash(key, chunk_hash):
    """``key`` with another chunk hash (its parent's key)."""
    import dataclasses

    try:
        return dataclasses.replace(key, chunk_hash=chunk_hash)
    except TypeError:
        import copy

        k = copy.copy(key)
        k.chunk_hash = chunk_hash
        return k
