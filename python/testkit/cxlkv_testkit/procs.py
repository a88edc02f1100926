"""What every launcher of the kit needs: the checkout it runs from, free
loopback ports, and waiting on a condition with a deadline."""

from __future__ import annotations

import pathlib
import socket
import time

ROOT = pathlib.Path(__file__).resolve().parents[3]


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
