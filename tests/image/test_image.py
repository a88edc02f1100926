"""The container image as built by scripts/build-image.sh: it runs what the
Containerfile says, `cxlkv --version` works in it, and `cxlkv serve` with its
default arguments and the manifests' mounts comes up as the non-root user
(socket on the shared directory, gRPC health SERVING, /ready 200 on the
metrics port) and drains on SIGTERM. scripts/test-image.sh runs it with
CXLKV_ENGINE (docker or podman) and CXLKV_IMAGE set."""

from __future__ import annotations

import json
import os
import pathlib
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib

import grpc
import pytest

from cxlkv_testkit import ROOT, containerfile

ENGINE = os.environ.get("CXLKV_ENGINE", "")
IMAGE = os.environ.get("CXLKV_IMAGE", "")
pytestmark = pytest.mark.skipif(not (ENGINE and IMAGE), reason="run by scripts/test-image.sh")
CFG = tomllib.loads((ROOT / "deploy" / "kubernetes" / "base" / "cxlkv.toml").read_text())
IMG = containerfile.image("runtime")


def engine_cmd() -> list[str]:
    cmd = [ENGINE]
    # crun refuses cgroup v1/hybrid hosts (this CI's VMs); runc runs there.
    if ENGINE == "podman" and not pathlib.Path("/sys/fs/cgroup/cgroup.controllers").exists() and shutil.which("runc"):
        cmd += ["--runtime", "runc"]
    return cmd


def run_flags() -> list[str]:
    # Engines ask for rlimits above what a sandboxed host allows; stay within it.
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 65536)
    return ["--network", "none", "--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", "nproc=4096:4096"]


def engine(*args, check=True, **kw) -> subprocess.CompletedProcess:
    out = subprocess.run(engine_cmd() + list(args), capture_output=True, text=True, **kw)
    if check:
        assert out.returncode == 0, f"{args}: {out.stdout}{out.stderr}"
    return out


def test_the_image_runs_what_the_containerfile_says():
    cfg = json.loads(engine("image", "inspect", IMAGE).stdout)[0]["Config"]
    assert cfg["User"] == f"{IMG.user[0]}:{IMG.user[1]}"
    assert cfg["Entrypoint"] == IMG.entrypoint == ["/usr/local/bin/cxlkv", "serve"]
    assert cfg["Cmd"] == IMG.cmd
    assert {int(p.split("/")[0]) for p in cfg["ExposedPorts"]} == IMG.expose


def test_version():
    version = tomllib.loads((ROOT / "Cargo.toml").read_text())["package"]["version"]
    out = engine("run", "--rm", *run_flags(), "--entrypoint", "/usr/local/bin/cxlkv", IMAGE, "--version")
    assert out.stdout.strip() == f"cxlkv {version}"
    assert IMAGE.endswith(f":{version}")


def health_check(sock: pathlib.Path) -> bytes:
    with grpc.insecure_channel(f"unix:{sock}", options=[("grpc.default_authority", "localhost")]) as ch:
        check = ch.unary_unary("/grpc.health.v1.Health/Check", request_serializer=None, response_deserializer=None)
        return check(b"", timeout=5)  # HealthCheckRequest{service: ""}


def in_netns(pid: int, code: str) -> str:
    return subprocess.run(["nsenter", "-t", str(pid), "-n", sys.executable, "-c", code], capture_output=True,
                          text=True, check=True).stdout


def test_serve_as_deployed():
    sock_dir = pathlib.PurePath(CFG["server"]["socket"]).parent
    pool_dir = pathlib.PurePath(CFG["pool"]["path"]).parent
    metrics_port = int(CFG["server"]["metrics_addr"].rsplit(":", 1)[1])
    # Host directories stand in for the manifests' hostPath volumes: the socket
    # directory handed to the image's user (as the init container does), a
    # world-writable tmpfs for the pool like /dev/shm, and the ConfigMap.
    base = pathlib.Path(tempfile.mkdtemp(prefix="cxlkv-image-", dir="/dev/shm"))
    name = f"cxlkv-smoke-{os.getpid()}"
    try:
        run, shm, conf = base / "run", base / "shm", base / "conf"
        for d in (run, shm, conf):
            d.mkdir()
        os.chown(run, *IMG.user)
        shm.chmod(0o1777)
        shutil.copy(ROOT / "deploy" / "kubernetes" / "base" / "cxlkv.toml", conf / "cxlkv.toml")
        config_dir = pathlib.PurePath(IMG.cmd[IMG.cmd.index("--config") + 1]).parent
        engine("run", "-d", "--name", name, *run_flags(), "-v", f"{run}:{sock_dir}", "-v", f"{shm}:{pool_dir}",
               "-v", f"{conf}:{config_dir}:ro", IMAGE)  # default arguments: the image's CMD
        sock = run / pathlib.PurePath(CFG["server"]["socket"]).name
        deadline = time.monotonic() + 60
        while not sock.exists():
            state = json.loads(engine("inspect", name).stdout)[0]["State"]
            assert state["Running"], engine("logs", name).stdout + engine("logs", name).stderr
            assert time.monotonic() < deadline, "socket did not appear"
            time.sleep(0.2)
        st = sock.stat()
        assert (st.st_uid, st.st_gid) == IMG.user, "runs as the image's non-root user"
        assert st.st_mode & 0o777 == int(CFG["server"]["socket_mode"], 8)
        pool = shm / pathlib.PurePath(CFG["pool"]["path"]).name
        assert (pool.stat().st_uid, pool.stat().st_gid) == IMG.user

        pid = json.loads(engine("inspect", name).stdout)[0]["State"]["Pid"]
        probe = ("import urllib.request, sys\n"
                 "for p in sys.argv[1:]:\n"
                 f"    r = urllib.request.urlopen('http://127.0.0.1:{metrics_port}' + p, timeout=5)\n"
                 "    print(p, r.status, r.read().decode().count('cxlkv_'))\n")
        deadline = time.monotonic() + 30
        while True:
            try:
                assert health_check(sock) == b"\x08\x01"  # SERVING
                out = in_netns(pid, probe.replace("sys.argv[1:]", "['/ready', '/metrics']"))
                break
            except (AssertionError, grpc.RpcError, subprocess.CalledProcessError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        ready, metrics = out.splitlines()
        assert ready.split()[:2] == ["/ready", "200"]
        assert metrics.split()[1] == "200" and int(metrics.split()[2]) > 10
        # `kubectl exec ... cxlkv status --socket ...` works in the image.
        status = json.loads(engine("exec", name, "cxlkv", "status", "--json", "--socket",
                                   CFG["server"]["socket"]).stdout)
        assert status

        # SIGTERM drains and exits cleanly.
        engine("stop", "-t", "30", name)
        assert json.loads(engine("inspect", name).stdout)[0]["State"]["ExitCode"] == 0
    finally:
        engine("rm", "-f", name, check=False)
        shutil.rmtree(base, ignore_errors=True)
