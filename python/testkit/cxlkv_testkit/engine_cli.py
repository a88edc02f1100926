"""An LMCache engine process for tests in other languages (the Dynamo
decoder test, crates/dynamo-check): `python -m cxlkv_testkit.engine_cli
SOCKET ACTION TOKENS...` with TOKENS comma-separated sequences.

- `store`: each sequence through a real LMCacheEngine (CPU, kv events on,
  the cxlkv backend as its storage plugin); prints `STORED <chunks>`.
- `delete`: deletes each sequence's chunk keys in the sidecar; prints
  `DELETED <n>`.
- `present`: per sequence, how many of its leading chunks the sidecar
  holds; prints `PRESENT <n> ...`.

Run with PYTHONHASHSEED set: the engine hashes tokens with Python's hash.
"""

from __future__ import annotations

import sys


def chunk_keys(engine, tokens: list[int]) -> list:
    import torch

    return [k for _, _, k in engine.token_database.process_tokens(torch.tensor(tokens, dtype=torch.long))]


def main(argv: list[str]) -> None:
    from cxlkv_lmcache import client as cl
    from cxlkv_lmcache._proto import cxlkv_pb2 as pb
    from cxlkv_lmcache.keys import encode_engine_key

    from cxlkv_testkit import engine_store_tokens, engine_with_kv_events

    socket, action, seqs = argv[0], argv[1], [[int(t) for t in s.split(",")] for s in argv[2:]]
    engine = engine_with_kv_events(socket)
    stub = cl.stub(cl.channel(socket))
    if action == "store":
        print("STORED", sum(len(engine_store_tokens(engine, s)) for s in seqs), flush=True)
    elif action == "delete":
        keys = [encode_engine_key(k) for s in seqs for k in chunk_keys(engine, s)]
        r = stub.Delete(pb.DeleteRequest(keys=keys), timeout=10)
        print("DELETED", sum(1 for st in r.statuses if st.code == 0), flush=True)
    elif action == "present":
        out = []
        for s in seqs:
            keys = [encode_engine_key(k) for k in chunk_keys(engine, s)]
            found = stub.Exists(pb.ExistsRequest(keys=keys), timeout=10).exists
            n = 0
            while n < len(found) and found[n]:
                n += 1
            out.append(str(n))
        print("PRESENT", " ".join(out), flush=True)
    else:
        raise SystemExit(f"unknown action {action}")
    engine.storage_manager.close()


if __name__ == "__main__":
    main(sys.argv[1:])
