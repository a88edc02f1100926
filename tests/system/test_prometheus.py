"""A real Prometheus scrapes a real `cxlkv serve` while LMCache's adapter
drives traffic; the counters are read back through Prometheus's query API."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

from cxlkv_testkit import Sidecar, free_port, make_adapter, wait_for


def query(base: str, q: str):
    url = f"{base}/api/v1/query?" + urllib.parse.urlencode({"query": q})
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            res = json.loads(r.read())["data"]["result"]
    except Exception:
        return None
    return float(res[0]["value"][1]) if res else None


def scrape(addr: str) -> str:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=2) as r:
        return r.read().decode()


@pytest.fixture
def prometheus_bin():
    path = shutil.which("prometheus")
    assert path, "prometheus missing: scripts/test-ops.sh installs Debian's prometheus package"
    return path


def test_prometheus_reads_the_counters_traffic_moved(tmp_path, prometheus_bin):
    from cxlkv_testkit import l2 as t

    maddr = f"127.0.0.1:{free_port()}"
    s = Sidecar(tmp_path, extra=("--metrics-addr", maddr, "--max-tenant-series", "100")).start()
    pport = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n"
        f"scrape_configs:\n  - job_name: cxlkv\n    static_configs:\n      - targets: ['{maddr}']\n")
    prom = subprocess.Popen(
        [prometheus_bin, f"--config.file={tmp_path / 'prometheus.yml'}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{pport}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp_path / "prometheus.log", "wb"))
    base = f"http://127.0.0.1:{pport}"
    # Exact counts below: no pages leased ahead of a next store (its Reserve
    # would count too).
    a = make_adapter(s.socket, lease_ahead_bytes=0)
    try:
        assert wait_for(lambda: query(base, 'up{job="cxlkv"}') == 1.0, timeout=60), \
            (tmp_path / "prometheus.log").read_text()[-2000:]
        keys = [t.key(i, salt="acme") for i in range(10)]
        assert t.store(a, keys, [t.obj(4096, seed=i) for i in range(10)]).is_successful()
        assert t.bits(t.lookup(a, keys + [t.key(100 + i) for i in range(5)]), 15) == [True] * 10 + [False] * 5
        assert t.bits(t.load(a, keys[:4], [t.obj(4096) for _ in range(4)]), 4) == [True] * 4
        a.submit_unlock(keys)
        want = {
            'cxlkv_requests_total{op="reserve",result="ok"}': 1,
            'cxlkv_keys_total{op="reserve",result="ok"}': 10,
            'cxlkv_keys_total{op="lookup_and_lock",result="hit"}': 10,
            'cxlkv_keys_total{op="lookup_and_lock",result="miss"}': 5,
            "cxlkv_committed_bytes_total": 40960,
            'cxlkv_tenant_stored_bytes{tenant="acme"}': 40960,
            "cxlkv_stored_keys": 10,
            'cxlkv_pages{state="used"}': 10,
        }
        ok = wait_for(lambda: all(query(base, q) == v for q, v in want.items()), timeout=30, every=0.5)
        assert ok, {q: query(base, q) for q in want}
        # The histogram is scraped too.
        assert query(base, 'cxlkv_request_duration_seconds_count{op="lookup_and_lock"}') >= 1
    finally:
        a.close()
        prom.terminate()
        prom.wait(timeout=30)
        s.kill()


def test_promtool_finds_nothing_to_lint(tmp_path):
    promtool = shutil.which("promtool")
    assert promtool, "promtool missing: scripts/test-ops.sh installs Debian's prometheus package"
    maddr = f"127.0.0.1:{free_port()}"
    s = Sidecar(tmp_path, extra=("--metrics-addr", maddr)).start()
    try:
        from cxlkv_testkit import l2 as t
        a = make_adapter(s.socket)
        t.store(a, [t.key(1, salt="x")], [t.obj(100)])
        a.close()
        time.sleep(0.5)
        body = scrape(maddr)
        out = subprocess.run([promtool, "check", "metrics"], input=body, capture_output=True, text=True)
        assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr
    finally:
        s.kill()
