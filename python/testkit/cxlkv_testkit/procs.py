"""What every launcher of the kit needs: the checkout it runs from, free
loopback ports, and waiting on a condition with a deadline."""

from __future__ import annotations

import importlib.util
import pathlib
import socket
import time
import types

# The checkout (python/testkit/cxlkv_testkit/ sits three levels down); a
# copy of the kit elsewhere (the GPU bundle's, beside bench_copy.py) is
# given its paths explicitly.
_HERE = pathlib.Path(__file__).resolve()
ROOT = _HERE.parents[3] if len(_HERE.parents) > 3 else _HERE.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
