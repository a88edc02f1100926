"""The one launcher of `cxlkv serve` for the tests, the benchmarks and the
fault scripts: any pool (size, geometry, place), config overrides, extra
flags and environment; ready once its gRPC health check says SERVING."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import time

from .procs import ROOT

BIN = os.environ.get("CXLKV_BIN", str(ROOT / "target" / "debug" / "cxlkv"))


class Sidecar:
    """One `cxlkv serve` process, its socket and log under `dir`.

    By default its pool is `dir/pool` in the kit's small geometry (2 MiB
    regions of 4 KiB pages) with metrics off; `region_size` or `page_size`
    None leaves the sidecar's own default. `pool` puts the pool file
    elsewhere (a benchmark's on /dev/shm), `config` is TOML written to
    `dir/NAME.toml` and passed with --config, `format` reformats an existing
    pool, `env` is added to this process's environment, `binary` replaces
    BIN; `extra` flags come last and win over the ones before."""

    def __init__(self, dir: pathlib.Path, name: str = "cxlkv", pool_size: str = "64MiB", extra: tuple = (), *,
                 region_size: str | None = "2MiB", page_size: str | None = "4KiB", pool: str | None = None,
                 config: str | None = None, metrics_addr: str = "", format: bool = False,
                 env: dict | None = None, binary: str | None = None, start_timeout: float = 30):
        dir = pathlib.Path(dir)
        self.dir = dir
        self.name = name
        self.socket = str(dir / f"{name}.sock")
        self.pool = pool or str(dir / "pool")
        self.log = dir / f"{name}.log"
        self.pool_size = pool_size
        self.region_size, self.page_size = region_size, page_size
        self.metrics_addr = metrics_addr
        self.format = format
        self.config = None
        if config is not None:
            self.config = dir / f"{name}.toml"
            self.config.write_text(config)
        self.extra = list(extra)
        self.env = env
        self.binary = binary or BIN
        self.start_timeout = start_timeout
        self.proc: subprocess.Popen | None = None

    def args(self) -> list[str]:
        a = [self.binary, "serve", "--pool-path", self.pool, "--pool-size", self.pool_size]
        if self.region_size:
            a += ["--region-size", self.region_size]
        if self.page_size:
            a += ["--page-size", self.page_size]
        a += ["--socket", self.socket, "--metrics-addr", self.metrics_addr]
        if self.format:
            a.append("--format")
        if self.config is not None:
            a += ["--config", str(self.config)]
        return a + self.extra

    def start(self) -> "Sidecar":
        env = None if self.env is None else {**os.environ, **self.env}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args(), stdout=subprocess.DEVNULL, stderr=log, env=env)
        deadline = time.monotonic() + self.start_timeout
        while not ready(self.socket):  # readiness: every listener bound
            if self.proc.poll() is not None:
                raise RuntimeError(f"cxlkv exited: {self.log.read_text()}")
            if time.monotonic() > deadline:
                self.kill()  # never left behind: `with Sidecar(...).start()` never reaches __exit__
                raise RuntimeError(f"cxlkv did not start: {self.log.read_text()}")
            time.sleep(0.02)
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_seconds(self) -> float:
        """CPU time the process has used, user and system (/proc)."""
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)
        if sig == signal.SIGSTOP:  # delivery is asynchronous: wait until it has stopped
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                with open(f"/proc/{self.proc.pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "T":
                        return
                time.sleep(0.001)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=15)

    def halt(self) -> None:
        """Stop it if it runs: SIGTERM, SIGKILL if it has not exited 20 s
        later (a benchmark's cleanup, which must not raise)."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()

    def discard(self) -> None:
        """`halt` it and remove its pool file and socket: a benchmark's pool
        is gone after the run."""
        self.halt()
        for path in (self.pool, self.socket):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    # `with Sidecar(...).start() as s:` kills it however the block ends.
    def __enter__(self) -> "Sidecar":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()

    @contextlib.contextmanager
    def sigcont_on_exit(self):
        """For a test that stops the sidecar (SIGSTOP): however it ends, the
        sidecar runs again before anything after the block needs it (an
        adapter's close, the fixture's kill)."""
        try:
            yield self
        finally:
            self.signal(signal.SIGCONT)


def ready(sock: str) -> bool:
    """The sidecar's gRPC health check says SERVING."""
    import grpc

    from cxlkv_lmcache.client import channel
    from cxlkv_lmcache.watch import SERVING, serving_status

    if not os.path.exists(sock):
        return False
    ch = channel(sock)
    try:
        msg = ch.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=1)
        return serving_status(msg) == SERVING
    except grpc.RpcError:
        return False
    finally:
        ch.close()


def stopped(pid: int) -> bool:
    """Every thread of `pid` has stopped: kill() only queues SIGSTOP, and until
    each thread takes it the others keep serving (tests/common's sigstop)."""
    tasks = pathlib.Path(f"/proc/{pid}/task")
    states = []
    for t in tasks.iterdir():
        try:
            states.append((t / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except (FileNotFoundError, IndexError):
            continue  # a thread that just exited
    return bool(states) and all(s in ("T", "t") for s in states)


def sidecar_stats(socket: str):
    from cxlkv_lmcache import client as cl
    from cxlkv_lmcache._proto import cxlkv_pb2 as pb

    ch = cl.channel(socket)
    try:
        return cl.stub(ch).Stats(pb.StatsRequest(), timeout=5)
    finally:
        ch.close()
