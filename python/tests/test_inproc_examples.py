"""The in-process examples as written: deploy/lmcache/inproc/*.yaml loaded by
LMCache's own config loader (as vLLM's LMCacheConnectorV1 loads
LMCACHE_CONFIG_FILE) run a StorageManager that stores and hits through cxlkv;
the Kubernetes example carries the same configuration; README.md's section
shows the example and the vLLM flags."""

from __future__ import annotations

import json
import re

import yaml

from cxlkv_testkit import ROOT, clear_l1, engine_chunk, engine_key, engine_metadata, same_chunk, wait_for

INPROC = ROOT / "deploy" / "lmcache" / "inproc"


def storage_manager(path, socket: str):
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    cfg = LMCacheEngineConfig.from_file(str(path))
    assert cfg.extra_config["cxlkv.socket"] == "/run/cxlkv/cxlkv.sock"
    cfg.extra_config["cxlkv.socket"] = socket  # this test's sidecar
    cfg.max_local_cpu_size = 0.05
    return StorageManager(cfg, engine_metadata(), EventManager())


def test_backend_example_stores_and_hits(sidecar):
    sm = storage_manager(INPROC / "lmcache-backend.yaml", sidecar.socket)
    try:
        keys = [engine_key(s) for s in (1, 2)]
        sm.batched_put(keys, [engine_chunk(sm, s) for s in (1, 2)])
        be = sm.storage_backends["cxlkv"]
        assert type(be).__name__ == "CxlKvBackend"
        # Copied into the pool before batched_put returned; committed after.
        assert wait_for(lambda: not any(be.exists_in_put_tasks(k) for k in keys))
        clear_l1(sm)
        n, where = sm.batched_contains(keys)
        assert n == 2 and list(where) == ["cxlkv"]
        got = sm.batched_get(keys, location="cxlkv")
        assert same_chunk(got[0], 1) and same_chunk(got[1], 2)
        for o in got:
            o.ref_count_down()
    finally:
        sm.close()


def test_connector_example_stores_and_hits(sidecar):
    sm = storage_manager(INPROC / "lmcache-connector.yaml", sidecar.socket)
    try:
        keys = [engine_key(s) for s in (3, 4)]
        sm.batched_put(keys, [engine_chunk(sm, s) for s in (3, 4)])
        c = sm.storage_backends["RemoteBackend-cxlkv"].connection._connector
        assert wait_for(lambda: c.puts_in_flight() == 0 and c.batched_contains(keys) == 2)
        clear_l1(sm)
        got = sm.batched_get(keys, location="RemoteBackend-cxlkv")
        assert same_chunk(got[0], 3) and same_chunk(got[1], 4)
    finally:
        sm.close()


def test_kubernetes_example_and_readme_carry_the_same_settings():
    example = yaml.safe_load((INPROC / "lmcache-backend.yaml").read_text())
    docs = list(yaml.safe_load_all((ROOT / "deploy" / "lmcache" / "vllm-inproc.yaml").read_text()))
    cm = next(d for d in docs if d["kind"] == "ConfigMap")
    in_k8s = yaml.safe_load(cm["data"]["lmcache.yaml"])
    assert {k: v for k, v in example.items() if k != "extra_config"} == \
        {k: v for k, v in in_k8s.items() if k != "extra_config"}
    assert {k: v for k, v in example["extra_config"].items() if k != "cxlkv.tenant"} == in_k8s["extra_config"]
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    c = ds["spec"]["template"]["spec"]["containers"][0]
    transfer = json.loads(c["args"][c["args"].index("--kv-transfer-config") + 1])
    assert transfer == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    assert {e["name"]: e["value"] for e in c["env"]}["LMCACHE_CONFIG_FILE"] == "/etc/lmcache/lmcache.yaml"
    mounts = {m["mountPath"] for m in c["volumeMounts"]}
    assert {"/run/cxlkv", "/dev/shm", "/etc/lmcache"} <= mounts
    # README.md's section shows the example file and the same vLLM flags.
    readme = (ROOT / "README.md").read_text()
    sec = readme[readme.index("## vLLM with in-process LMCache"):]
    sec = sec[:sec.index("\n## ", 5)]
    block = re.search(r"```yaml\n(.*?)```", sec, re.S).group(1)
    assert yaml.safe_load(block) == example
    assert "--kv-transfer-config '" + json.dumps(transfer, separators=(",", ":")) + "'" in sec
    assert "LMCACHE_CONFIG_FILE=" in sec
