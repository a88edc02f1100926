"""LMCache's own command line with the plugin: `lmcache server` and
`lmcache bench l2`."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import urllib.request

from cxlkv_testkit import free_port, plugin_json, wait_for

LMCACHE = str(pathlib.Path(sys.executable).parent / "lmcache")


def _get(url: str):
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return json.loads(r.read())
    except Exception:
        return None


def test_lmcache_server_lists_the_plugin_and_tracks_sidecar_health(sidecar, tmp_path):
    port, http = free_port(), free_port()
    log = open(tmp_path / "lmcache.log", "wb")
    proc = subprocess.Popen(
        [LMCACHE, "server", "--host", "127.0.0.1", "--port", str(port), "--http-host", "127.0.0.1",
         "--http-port", str(http), "--l1-size-gb", "0.25", "--eviction-policy", "LRU", "--disable-observability",
         "--l2-adapter", plugin_json(sidecar.socket, poll_interval_ms=100)],
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{http}"
    try:
        assert wait_for(lambda: (_get(f"{base}/healthcheck") or {}).get("status") == "healthy", timeout=90), \
            (tmp_path / "lmcache.log").read_text()[-3000:]
        adapters = _get(f"{base}/config/adapters")["adapters"]
        assert [(a["type_name"], a["tier"]) for a in adapters] == [("plugin", "l2")]

        def l2():
            return _get(f"{base}/status")["storage_manager"]["l2_adapters"][0]

        assert l2()["is_healthy"] and l2()["type"] == "cxlkv" and l2()["mode"] == "mmap"
        sidecar.kill()
        assert wait_for(lambda: l2()["is_healthy"] is False, timeout=10)
        sidecar.start()
        assert wait_for(lambda: l2()["is_healthy"] is True, timeout=10)
    finally:
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=60)
    text = (tmp_path / "lmcache.log").read_text()
    # lmcache server shuts down in order, then ends with SIGTERM's own status.
    assert rc in (0, -signal.SIGTERM), text[-3000:]
    assert "Traceback" not in text and "Application shutdown complete" in text, text[-3000:]


def test_lmcache_bench_l2_verifies_every_byte(sidecar):
    out = subprocess.run(
        [LMCACHE, "bench", "l2", "--l2-adapter", plugin_json(sidecar.socket), "--num-keys", "32",
         "--data-size-kb", "256", "--rounds", "3", "--no-skip-verify"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-3000:]
    assert "All 32 keys data verified OK" in text, text[-3000:]
    assert "Rounds timed out:                                              0" in text
