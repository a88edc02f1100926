"""Credentials for the sidecar: a bearer token read from a file (re-read when
the file changes, so a rotation needs no LMCache restart) and TLS with an
optional client certificate (read once, when the channel is made)."""

from __future__ import annotations

import os
import threading
import time

import grpc

# Same rule as the sidecar's tokens file: printable ASCII, at least 16 bytes.
MIN_TOKEN_BYTES = 16
RELOAD_EVERY_S = 1.0


def read_token(path: str) -> str:
    """The token in `path` (surrounding whitespace ignored); ValueError names
    the file, never the token."""
    with open(path, "rb") as f:
        raw = f.read().strip()
    if len(raw) < MIN_TOKEN_BYTES or not all(0x21 <= b <= 0x7E for b in raw):
        raise ValueError(f"{path}: a token is at least {MIN_TOKEN_BYTES} printable ASCII characters, no spaces")
    return raw.decode()


def read_file(what: str, path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"cxlkv adapter_params.{what}: cannot read {path!r}: {e.strerror}") from None


def _stamp(path: str):
    try:
        s = os.stat(path)
    except OSError:
        return None
    return (s.st_mtime_ns, s.st_size, s.st_ino, s.st_dev)


class TokenFile:
    """The current `authorization` header from a token file. A changed file
    that does not hold a valid token is skipped: the previous token stays."""

    def __init__(self, path: str):
        self._path = path
        self._stamp = _stamp(path)
        self._header = ("authorization", "Bearer " + read_token(path))
        self._checked = time.monotonic()
        self._lock = threading.Lock()

    def header(self) -> tuple[str, str]:
        now = time.monotonic()
        if now - self._checked >= RELOAD_EVERY_S:
            with self._lock:
                if now - self._checked >= RELOAD_EVERY_S:
                    self._checked = now
                    stamp = _stamp(self._path)
                    if stamp != self._stamp:
                        self._stamp = stamp
                        try:
                            self._header = ("authorization", "Bearer " + read_token(self._path))
                        except (OSError, ValueError):
                            pass  # keep the previous token until the file is fixed
        return self._header


class _Details(grpc.ClientCallDetails):
    def __init__(self, d, metadata):
        self.method, self.timeout, self.metadata = d.method, d.timeout, metadata
        self.credentials, self.wait_for_ready, self.compression = d.credentials, d.wait_for_ready, d.compression


class _Adds(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
            grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds `header()` to every call's metadata (on plain and TLS channels
    alike, unlike call credentials, which grpc sends only over TLS)."""

    def header(self) -> tuple[str, str]:
        raise NotImplementedError

    def _details(self, d):
        return _Details(d, list(d.metadata or ()) + [self.header()])

    def intercept_unary_unary(self, cont, d, request):
        return cont(self._details(d), request)

    def intercept_unary_stream(self, cont, d, request):
        return cont(self._details(d), request)

    def intercept_stream_unary(self, cont, d, request_iterator):
        return cont(self._details(d), request_iterator)

    def intercept_stream_stream(self, cont, d, request_iterator):
        return cont(self._details(d), request_iterator)


class BearerToken(_Adds):
    """The token of a token file, on every call."""

    def __init__(self, token: TokenFile):
        self._token = token

    def header(self) -> tuple[str, str]:
        return self._token.header()


class Header(_Adds):
    """One fixed header on every call (the durable session's name)."""

    def __init__(self, key: str, value: str):
        self._header = (key, value)

    def header(self) -> tuple[str, str]:
        return self._header
