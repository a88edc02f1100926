"""The README's first code block, run as a first-time user runs it (run by
scripts/test-readme.sh, a stage of scripts/test.sh).

Line 1 (`cargo run --release -- serve ...`) is taken from README.md as it is
written and run with bash in the repository root; the test waits until the
sidecar it starts is ready on the embedded defaults (gRPC on
/tmp/cxlkv/cxlkv.sock, /ready on 127.0.0.1:9464, a 1 GiB pool at
/dev/shm/cxlkv-pool), checks it with `cxlkv status` and with a store and a
load through the LMCache plugin as installed in this venv (adapter_params
left at their defaults), then stops it with SIGTERM and expects a clean exit.
Line 2 (the test command) is what CI runs: `.ci/run` must run exactly it.

Uses the default paths and port, so nothing else may use them meanwhile: the
test refuses to start when the socket answers, the port is taken or the pool
is in use, and removes the pool and the socket directory afterwards when it
created them.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

README = ROOT / "README.md"
SOCKET = "/tmp/cxlkv/cxlkv.sock"
POOL = "/dev/shm/cxlkv-pool"
METRICS = ("127.0.0.1", 9464)
RELEASE_BIN = ROOT / "target" / "release" / "cxlkv"
# A fresh clone compiles the release build first (minutes); CI has built it
# in the bench smoke run already.
READY_TIMEOUT_S = float(os.environ.get("CXLKV_README_READY_TIMEOUT_S", "1200"))


def code_blocks(text: str) -> list[tuple[str, list[str]]]:
    """Every fenced code block of a Markdown text: (info string, lines)."""
    blocks, lang, lines = [], None, []
    for line in text.splitlines():
        if lang is None:
            m = re.match(r"^```(\S*)\s*$", line)
            if m:
                lang, lines = m.group(1), []
        elif line.startswith("```"):
            blocks.append((lang, lines))
            lang = None
        else:
            lines.append(line)
    return blocks


def first_block() -> list[str]:
    lang, lines = code_blocks(README.read_text())[0]
    assert lang == "sh", f"README.md's first code block is {lang!r}, not sh"
    lines = [line for line in lines if line.strip()]
    # This test runs line 1 and checks line 2; a third needs a check of its own here.
    assert len(lines) == 2, f"README.md's first code block has {len(lines)} commands: {lines}"
    return lines


def words(command_line: str) -> list[str]:
    return shlex.split(command_line, comments=True)


def http_status(path: str) -> int | None:
    try:
        with urllib.request.urlopen(f"http://{METRICS[0]}:{METRICS[1]}{path}", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


def port_free() -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(METRICS)
        except OSError:
            return False
    return True


def processes_of(root_pid: int) -> list[int]:
    """root_pid and every process below it."""
    children: dict[int, list[int]] = {}
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(d.name))
    found, todo = [], [root_pid]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def exe(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def cmdline(pid: int) -> list[str]:
    return pathlib.Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def status_json() -> dict:
    out = subprocess.run([str(RELEASE_BIN), "status", "--json"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_readme_serve_line_runs_the_sidecar_on_its_embedded_default(tmp_path):
    from cxlkv_testkit import ready

    serve = first_block()[0]
    # The defaults must be free: this test would otherwise check (or stop)
    # someone else's sidecar.
    assert not ready(SOCKET), f"a sidecar already answers on {SOCKET}; stop it first"
    assert port_free(), f"{METRICS[0]}:{METRICS[1]} is in use; stop what listens there first"
    pool_existed = os.path.exists(POOL)
    sock_dir_existed = os.path.isdir(os.path.dirname(SOCKET))

    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        # As typed at a shell prompt in a clone: bash, the repository root.
        proc = subprocess.Popen(["bash", "-c", serve], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail() -> str:
        return "\n".join(log_path.read_text(errors="replace").splitlines()[-40:])

    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not (ready(SOCKET) and http_status("/ready") == 200):
            assert proc.poll() is None, (
                f"README.md's first line exited with status {proc.returncode} before the sidecar was ready:\n"
                f"$ {serve}\n{log_tail()}")
            assert time.monotonic() < deadline, f"not ready after {READY_TIMEOUT_S:.0f} s:\n$ {serve}\n{log_tail()}"
            time.sleep(0.2)

        # The sidecar is the release binary, started by that line with no
        # arguments but `serve`: what answers runs on the embedded defaults.
        sidecars = [p for p in processes_of(proc.pid) if exe(p) == str(RELEASE_BIN)]
        assert len(sidecars) == 1, f"expected one {RELEASE_BIN} below the README's line, got {sidecars}"
        pid = sidecars[0]
        assert cmdline(pid)[1:] == ["serve"], cmdline(pid)

        # `cxlkv status`, as the README shows it, and its JSON.
        out = subprocess.run([str(RELEASE_BIN), "status"], capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert f"on shm pool {POOL}" in out.stdout, out.stdout
        st = status_json()
        assert (st["backend"], st["path"]) == ("shm", POOL), st
        assert st["regions_total"] * st["region_size"] == 1 << 30, "the README promises a 1 GiB pool"
        keys_before = st["keys"]

        # A store and a load through the plugin installed in this venv, with
        # every adapter_param at its default (the default socket included).
        import torch
        from lmcache.v1.distributed.l2_adapters import create_l2_adapter
        from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig
        from cxlkv_testkit.l2 import bits, key, load, lookup, obj, store

        a = create_l2_adapter(PluginL2AdapterConfig.from_dict(
            {"module_path": "cxlkv_lmcache.adapter", "class_name": "CxlKvL2Adapter", "adapter_params": {}}))
        try:
            assert a.report_status()["is_healthy"] is True, a.report_status()
            assert a.report_status()["mode"] == "mmap", a.report_status()
            sizes = [4096, 1 << 20, 3 * (1 << 20) + 5]
            # Keys of this run only: a pool that outlived an earlier run may hold older ones.
            salt = f"readme-{os.getpid()}-{time.time_ns()}"
            ks = [key(i, salt=salt) for i in range(len(sizes))]
            objs = [obj(n, seed=i) for i, n in enumerate(sizes)]
            r = store(a, ks, objs)
            assert r.is_successful() and r.bytes_transferred() == sum(sizes)
            assert bits(lookup(a, ks), len(ks)) == [True] * len(ks)
            outs = [obj(n, seed=100 + i) for i, n in enumerate(sizes)]
            assert bits(load(a, ks, outs), len(ks)) == [True] * len(ks)
            assert all(torch.equal(o.tensor, w.tensor) for o, w in zip(outs, objs)), "loaded bytes differ"
            a.submit_unlock(ks)
        finally:
            a.close()
        assert status_json()["keys"] == keys_before + len(sizes)

        # SIGTERM: drains, drops readiness, removes its socket, exits 0; and
        # so does the README's line (cargo run ends with its child's status).
        os.kill(pid, signal.SIGTERM)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 30 s after SIGTERM:\n{log_tail()}")
        assert rc == 0, f"exit status {rc} after SIGTERM:\n{log_tail()}"
        assert exe(pid) is None, "the sidecar outlived the README's line"
        assert not os.path.exists(SOCKET), "socket left behind"
        assert http_status("/ready") is None
        assert "stopped" in log_path.read_text(), log_tail()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if not pool_existed and os.path.exists(POOL):
            os.remove(POOL)
        if not sock_dir_existed:
            shutil.rmtree(os.path.dirname(SOCKET), ignore_errors=True)


def test_readme_test_line_is_what_ci_runs():
    test_line = words(first_block()[1])
    ci = [words(line) for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    runs = [w[1:] for w in ci if w and w[0] == "exec"]
    assert runs == [test_line], f".ci/run runs {runs}, README.md's second line is {test_line}"
    # Run as written, so the script must be executable (a clone keeps git's mode).
    assert os.access(ROOT / test_line[0], os.X_OK), f"{test_line[0]} is not executable"


def test_scripts_the_readme_runs_are_executable_and_its_links_resolve():
    text = README.read_text()
    for lang, lines in code_blocks(text):
        if lang != "sh":
            continue
        for line in lines:
            w = words(line.replace("\\", ""))
            while w and re.match(r"^[A-Z_][A-Z0-9_]*=", w[0]):  # VAR=value command
                w = w[1:]
            if w and w[0].startswith(("scripts/", ".venv/", "./")):
                assert os.access(ROOT / w[0], os.X_OK), f"README.md runs {w[0]}, which is not executable: {line}"
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if not re.match(r"^[a-z]+:", target):
            assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"
