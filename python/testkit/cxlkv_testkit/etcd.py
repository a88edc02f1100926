"""A one-member etcd for the tests of elected nodes."""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess

from .procs import free_port, wait_for

ETCD = "/usr/bin/etcd"


class Etcd:
    """A one-member etcd (Debian's etcd-server) on free loopback ports, its
    data and log under `dir`; `endpoint` is what a node's config names."""

    def __init__(self, dir: pathlib.Path):
        if not os.path.exists(ETCD):
            raise RuntimeError(f"{ETCD} is missing: install Debian's etcd-server (see the README's setup)")
        self.dir = dir
        self.port, self.peer_port = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.log = dir / "etcd.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "Etcd":
        url = lambda p: f"http://127.0.0.1:{p}"  # noqa: E731
        args = [ETCD, "--name", "t", "--data-dir", str(self.dir / "etcd"),
                "--listen-client-urls", url(self.port), "--advertise-client-urls", url(self.port),
                "--listen-peer-urls", url(self.peer_port), "--initial-advertise-peer-urls", url(self.peer_port),
                "--initial-cluster", f"t={url(self.peer_port)}", "--log-level", "warn"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=log)

        def up() -> bool:
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        if not wait_for(lambda: self.proc.poll() is not None or up(), timeout=20) or self.proc.poll() is not None:
            self.kill()
            raise RuntimeError(f"etcd did not come up: {self.log.read_text(errors='replace')[-2000:]}")
        return self

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "Etcd":
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
