"""What every launcher of the kit needs: the checkout it runs from, free
loopback ports, and waiting on a condition with a deadline."""

from __future__ import annotations

import importlib.util
import itertools
import os
import pathlib
import socket
import time
import types

# The checkout (python/testkit/cxlkv_testkit/ sits three levels down); a
# copy of the kit elsewhere (the GPU bundle's, beside bench_copy.py) is
# given its paths explicitly.
_HERE = pathlib.Path(__file__).resolve()
ROOT = _HERE.parents[3] if len(_HERE.parents) > 3 else _HERE.parent


_picks = itertools.count()


def free_port() -> int:
    """A loopback port for a process to listen on, outside the host's
    ephemeral range. A port found by binding port 0 comes from that range,
    and between the pick and the listener's bind any outgoing connection
    could take it as its source port ("Address already in use"). Each pick
    in this process is a new port, from an offset of the pid; a port
    something still holds is skipped."""
    lo, hi = _listening_ports()
    span = hi - lo
    start = os.getpid() * 7919 % span
    for _ in range(span):
        port = lo + (start + next(_picks)) % span
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free loopback port in {lo}..{hi}")


def _listening_ports() -> tuple[int, int]:
    """Ports no outgoing connection takes: below the ephemeral range
    (`ip_local_port_range`, 32768-60999 by default), else above it."""
    try:
        low, high = map(int, pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    if low >= 2048 + 1024:
        return low // 2, low
    if high < 65535 - 1024:
        return high + 1, 65536
    raise RuntimeError(f"the ephemeral port range {low}-{high} leaves no ports to listen on outside it")


def wait_for(pred, timeout: float = 5.0, every: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(every)
    return pred()


def script(name: str) -> types.ModuleType:
    """The checkout's scripts/NAME.py, imported as a module (the benchmarks'
    helpers are tested as the scripts define them)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
