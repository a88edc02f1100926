"""gRPC client for the cxlkv sidecar and the client's own mapping of the pool."""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import struct
import time
import zlib

import grpc

from cxlkv_lmcache import auth
from cxlkv_lmcache.populate import Populator
from cxlkv_lmcache._proto import cxlkv_pb2 as pb
from cxlkv_lmcache._proto import cxlkv_pb2_grpc as pb_grpc

MAX_MESSAGE = 64 << 20
INLINE_CHUNK = 1 << 20
# Pool layouts this plugin understands (PoolInfoReply.layout_version). A
# version fixes the formats of a region-table entry and a page-table slot
# (the word positions below, proto/cxlkv.proto); where the tables are and how
# big each entry is come from PoolInfo.
log = logging.getLogger("cxlkv_lmcache")

LAYOUT_VERSIONS = (3,)
ENTRY_GENERATION = 8  # region-table entry: [owner u64][generation u64]...
SLOT_HAS_CRC = 1  # page-table slot: [version u32][flags u32][crc32 u32]...; flags bit 0: crc32 given
OK = 0
NOT_FOUND = grpc.StatusCode.NOT_FOUND.value[0]
ALREADY_EXISTS = grpc.StatusCode.ALREADY_EXISTS.value[0]
PERMISSION_DENIED = grpc.StatusCode.PERMISSION_DENIED.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
# A Reserve item's or an InlinePut's status when the sidecar's admission
# declined the store: not an error, the store is skipped (nothing reserved or
# written). No other per-item status is ABORTED.
NOT_ADMITTED = grpc.StatusCode.ABORTED.value[0]

LINE = 64  # cache-line size: flushes and invalidations cover whole lines
# The metadata key that names a durable session (the sidecar's sessions.rs):
# its locks outlive the connection and end by unlock or TTL.
SESSION_HEADER = "x-cxlkv-session"
# A byte of the pool file every client holds a shared lock on while it maps
# the pool: the sidecar refuses to reformat or resize a pool a client maps
# (that would pull pages from under this process: SIGBUS, or pages of the new
# layout read through locations of the old). An open-file-description lock:
# closing another descriptor of the file does not drop it.
CLIENT_LOCK = (1 << 48) - 1
F_OFD_SETLK = getattr(fcntl, "F_OFD_SETLK", 37)


def _hold_client_lock(fd: int) -> None:
    # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
    try:
        fcntl.fcntl(fd, F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_RDLCK, os.SEEK_SET, CLIENT_LOCK, 1, 0))
    except OSError as e:  # a device that takes no locks: the guard is the operator's then
        log.debug("cannot hold the cxlkv pool's client lock: %s", e)

try:  # streaming-store copies (see _copy.c); the extension is optional
    from cxlkv_lmcache import _copy as _ext
    from cxlkv_lmcache._copy import KIND as COPY
    from cxlkv_lmcache._copy import copy
except ImportError:  # built without a C compiler
    _ext = None
    COPY = "memmove"

    def copy(dst: int, src: int, n: int) -> None:
        if n < 0 or (n and not (dst and src)):
            raise ValueError(f"copy: bad arguments (dst={dst:#x}, src={src:#x}, n={n})")
        ctypes.memmove(dst, src, n)


# The cache-line write-back instruction the extension uses (clwb, clflushopt,
# clflush), or None: then pools that are not cache-coherent are not mapped.
FLUSH = getattr(_ext, "FLUSH", None)


def _serial(jobs, fn, until) -> set[int]:
    late = set()
    for i, (d, s, n) in enumerate(jobs):
        if until is not None and time.time() > until:
            late.add(i)
        else:
            fn(d, s, n)
    return late


def channel(socket: str, tcp_address: str = "", *, token_file: str = "", tls_ca: str = "", tls_cert: str = "",
            tls_key: str = "", tls_server_name: str = "", session: str = "") -> grpc.Channel:
    """A channel to the sidecar: TLS when `tls_ca` is set (TCP only), with a
    client certificate when `tls_cert`/`tls_key` are; every call carries the
    bearer token of `token_file` when it is set. With `session` (32 hex
    digits) every call names that durable session, on a connection of its
    own (grpc shares a connection between channels of equal options)."""
    options = [
        # The sidecar is local and restarts in about a second: retry the
        # connection every 100 ms to 1 s, not grpc's default of up to 2
        # minutes, so a restart costs LMCache seconds of misses, not minutes.
        # (Not grpc.min_reconnect_backoff_ms: it is also each attempt's
        # connect timeout, and a short one fails attempts on a busy host.)
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        ("grpc.max_receive_message_length", MAX_MESSAGE),
        ("grpc.max_send_message_length", MAX_MESSAGE),
    ]
    if session:
        # A subchannel pool of its own: a connection no other channel shares.
        options += [("grpc.use_local_subchannel_pool", 1), ("cxlkv.session", session)]
    if tls_ca:
        creds = grpc.ssl_channel_credentials(
            root_certificates=auth.read_file("tls_ca", tls_ca),
            private_key=auth.read_file("tls_key", tls_key) if tls_key else None,
            certificate_chain=auth.read_file("tls_cert", tls_cert) if tls_cert else None,
        )
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        ch = grpc.secure_channel(tcp_address, creds, options=options)
    else:
        target = tcp_address if tcp_address else f"unix:{socket}"
        # tonic/h2 reject the percent-encoded socket path grpc-core sends
        # as :authority over a Unix socket. (Not over TLS: there the
        # authority is also the name the server's certificate is checked
        # against.)
        ch = grpc.insecure_channel(target, options=[("grpc.default_authority", "localhost"), *options])
    if token_file:
        ch = grpc.intercept_channel(ch, auth.BearerToken(auth.TokenFile(token_file)))
    if session:
        ch = grpc.intercept_channel(ch, auth.Header(SESSION_HEADER, session))
    return ch


def crc32_at(addr: int, n: int) -> int:
    """crc32 (IEEE, as the sidecar's) of n bytes at addr, without a copy."""
    return zlib.crc32((ctypes.c_char * n).from_address(addr)) if n else 0


def stub(ch: grpc.Channel) -> pb_grpc.CxlkvStub:
    return pb_grpc.CxlkvStub(ch)


def reserve_fields(items: list) -> dict:
    """A ReserveRequest's items as its fields: `(key, size)` pairs packed
    (the keys in one buffer, their lengths, the sizes: three fields to
    encode instead of a message per item; for sidecars whose PoolInfo says
    `packed_reserve`), pb.ReserveItems (token ids, older sidecars) as they are."""
    if not items or isinstance(items[0], pb.ReserveItem):
        return {"items": items}
    keys = [k for k, _ in items]
    sizes = [n for _, n in items]
    one = all(n == sizes[0] for n in sizes)
    return {"packed_keys": b"".join(keys), "key_lengths": [len(k) for k in keys],
            "sizes": sizes[:1] if one else sizes}


def reserve_keys(req: pb.ReserveRequest) -> list[bytes]:
    """The keys a ReserveRequest names, in order, in either form."""
    if not req.key_lengths:
        return [i.key for i in req.items]
    out, at = [], 0
    for n in req.key_lengths:
        out.append(req.packed_keys[at:at + n])
        at += n
    return out


def per_item(rep: pb.ReserveReply) -> list:
    """One Reservation per requested item, from a reply to a Reserve that
    asked for runs (`ReserveRequest.runs`): an entry with `repeat` stands
    for itself and that many items after it, refused alike."""
    out = []
    for r in rep.reservations:
        out.append(r)
        if r.repeat:
            out.extend([r] * r.repeat)
    return out


class PoolMap:
    """Read-write mapping of the whole pool; `put` and `get` move objects.
    Every offset and size comes from the sidecar's PoolInfo.

    With software coherence (PoolInfo.coherence, a pool shared by hosts that
    are not cache-coherent) `put` writes back every line it wrote, `publish`
    fences once per batch before Commit, and `get` and `still_there`
    invalidate what they read first. On the sidecar's "noncoherent-test"
    backend this mapping is private (copy-on-write, filled from the file
    when mapped), so it stands for this process's cache: lines reach the
    file by pwrite and come back from it by pread."""

    def __init__(self, info: pb.PoolInfoReply):
        if info.layout_version not in LAYOUT_VERSIONS:
            raise RuntimeError(f"cxlkv pool layout version {info.layout_version} is not supported by this plugin "
                               f"(it reads {LAYOUT_VERSIONS}); upgrade cxlkv-lmcache")
        if not info.region_entry_bytes or not info.page_slot_bytes:
            raise RuntimeError("cxlkv sidecar does not say where the pool's region and page tables are "
                               "(PoolInfo.region_entry_bytes, page_slot_bytes); upgrade cxlkv")
        self.coherence = info.coherence or "hardware"  # sidecars before the field were all single-host
        self.software = self.coherence == "software"
        self._private = info.backend == "noncoherent-test"
        self.size = info.pool_size
        if self.software and not self._private and FLUSH is None:
            raise OSError(f"cxlkv pool {info.path} is not cache-coherent across hosts (coherence 'software') and "
                          "this plugin has no cache-flush routine (built without its C extension, or not x86-64)")
        fd = os.open(info.path, os.O_RDWR)
        try:
            _hold_client_lock(fd)  # before mapping: a format that checked earlier finishes first
            flags = mmap.MAP_PRIVATE if self._private else mmap.MAP_SHARED
            self._mm = mmap.mmap(fd, info.pool_size, flags, mmap.PROT_READ | mmap.PROT_WRITE)
            self._fd, fd = fd, -1  # kept open while mapped: it holds the client lock
            if self._private:
                self._pread(0, info.pool_size)  # own every page: later file writes show only when invalidated
        finally:
            if fd >= 0:
                os.close(fd)
        self._anchor = ctypes.c_char.from_buffer(self._mm)
        self.base = ctypes.addressof(self._anchor)
        self.uuid = info.pool_uuid
        self._data = info.data_offset
        self._region = info.region_size
        self._regions = info.region_count
        self._page = info.page_size
        self._slots = info.page_table_offset
        self._slot_bytes = info.page_slot_bytes
        self._table = info.region_table_offset
        self._entry_bytes = info.region_entry_bytes
        self._pages_per_region = info.region_size // info.page_size
        self._unfenced: list[tuple[int, int]] = []  # the test backend's lines awaiting `publish`
        # A private mapping (the test backend) owns its pages already: no
        # thread maps regions ahead there.
        self._populator = Populator(info.node_id, self._region, self._region_addr, self._owner_words,
                                    ahead=not self._private)

    def _region_addr(self, region: int) -> int:
        return self.base + self._data + region * self._region

    def _owner_words(self) -> list[int]:
        """The region table's owner words, one per region, as last written."""
        n = self._regions * self._entry_bytes
        self._invalidate(self._table, n)
        with memoryview(self._mm) as whole, whole[self._table:self._table + n] as table, \
                table.cast("Q") as words, words[::self._entry_bytes // 8] as owners:
            return owners.tolist()

    def addr(self, loc: pb.Location) -> int:
        if loc.region >= self._regions or loc.offset + loc.length > self._region:
            raise ValueError(f"location outside the pool: {loc}")
        # Mapped into this process at most once (page faults per 4 KiB
        # otherwise), most often ahead of need by the populating thread.
        self._populator.ensure(loc.region)
        return self._region_addr(loc.region) + loc.offset

    def put(self, loc: pb.Location, src: int, n: int) -> None:
        """Copy n bytes from src into the object at `loc`; with software
        coherence, written back to memory (fenced by `publish`)."""
        dst = self.addr(loc)
        if not self.software:
            copy(dst, src, n)
        elif self._private:
            # Every process is a host here: read the partly written last line
            # in first (its rest may hold the record's long name the sidecar
            # wrote), so writing it back does not put stale bytes over it.
            self.put_at(dst, src, n)
        else:
            _ext.store(dst, src, n)

    def put_many(self, copier, items: list[tuple[pb.Location, int, int]], until: float | None = None) -> set[int]:
        """`put` of a batch of (loc, src, n), spread over the copier's threads
        (write-backs per slice, one fence per copying thread after its last
        slice); the indices left partly copied because `until` passed."""
        if self.software and self._private:  # the test backend's pread/pwrite of shared lines: one thread
            return _serial([(self.addr(loc), src, n) for loc, src, n in items],
                           self.put_at, until)
        self._populator.wake()  # the sidecar may have claimed a region for what comes next
        jobs = [(self.addr(loc), src, n) for loc, src, n in items]
        if self.software:
            return copier.run(jobs, _ext.store, _ext.fence, until)
        return copier.run(jobs, copy, None, until)

    def put_at(self, dst: int, src: int, n: int) -> None:
        self._pread(dst - self.base, n)
        plan = getattr(_ext, "plan", None)
        if plan is None:
            copy(dst, src, n)
            self._pwrite(dst - self.base, n)
            return
        # The steps `_ext.store` takes, replayed on this "cache": stored bytes
        # stay in it; streamed and written-back lines reach the file at the
        # next fence (`publish`), so a step left out there loses bytes.
        for step, at, k in plan(dst, n, True):
            if step in ("store", "stream"):
                copy(dst + at, src + at, k)
            if step in ("stream", "write_back"):
                self._unfenced.append((dst - self.base + at, k))
            if step == "fence":
                self._drain()

    def _drain(self) -> None:
        # Swapped out, not cleared after: a put on another thread may append.
        pending, self._unfenced = self._unfenced, []
        for off, k in pending:
            self._pwrite(off, k)

    def get_many(self, copier, items: list[tuple[int, pb.Location, int]]) -> None:
        """`get` of a batch of (dst, loc, n), spread over the copier's threads."""
        jobs = [(dst, self.addr(loc), n) for dst, loc, n in items]
        if self.software:
            copier.run(jobs, self._get_slice)
        else:
            copier.run(jobs, copy)

    def _get_slice(self, dst: int, src: int, n: int) -> None:
        self._invalidate(src - self.base, n)
        copy(dst, src, n)

    def fresh(self, addr: int, n: int) -> None:
        """Before the bytes at `addr` are read in place (a view handed out):
        with software coherence, drop this host's cached copy of them."""
        self._invalidate(addr - self.base, n)

    def contains(self, addr: int) -> bool:
        return self.base <= addr < self.base + self.size

    def publish(self) -> None:
        """Before Commit, once per batch of `put`s: their write-backs are
        ordered before anything this thread sends or stores next."""
        if self.software and self._private:
            self._drain()
        elif self.software:
            _ext.fence()

    def get(self, dst: int, loc: pb.Location, n: int) -> None:
        """Copy n bytes of the object at `loc` into dst, read from memory."""
        src = self.addr(loc)
        self._invalidate(src - self.base, n)
        copy(dst, src, n)

    def _invalidate(self, off: int, n: int) -> None:
        if not self.software:
            return
        if self._private:
            self._pread(off, n)
        else:
            _ext.invalidate(self.base + off, n)

    def _lines(self, off: int, n: int) -> tuple[int, int]:
        return off - off % LINE, min(-(-(off + n) // LINE) * LINE, self.size)

    def _pread(self, off: int, n: int) -> None:
        lo, hi = self._lines(off, n)
        view = memoryview(self._mm)
        try:
            while lo < hi:
                got = os.preadv(self._fd, [view[lo:hi]], lo)
                if got <= 0:
                    raise OSError(f"pool file ends at {lo}")
                lo += got
        finally:
            view.release()

    def _pwrite(self, off: int, n: int) -> None:
        lo, hi = self._lines(off, n)
        view = memoryview(self._mm)
        try:
            while lo < hi:
                lo += os.pwrite(self._fd, view[lo:hi], lo)
        finally:
            view.release()

    def _entry(self, region: int) -> int:
        return self._table + region * self._entry_bytes

    def generation(self, region: int) -> int:
        """The region's generation word in the pool's region table; it changes
        whenever the region gets a new owner or its owner restarts, which
        makes older locations stale."""
        return struct.unpack_from("<Q", self._mm, self._entry(region) + ENTRY_GENERATION)[0]

    def _slot(self, loc: pb.Location) -> int:
        page = loc.region * self._pages_per_region + loc.offset // self._page
        return self._slots + page * self._slot_bytes

    def version(self, loc: pb.Location) -> int:
        """The version word of the object's first page: it changes as soon as
        the object's pages are freed (evicted, deleted, reclaimed)."""
        return struct.unpack_from("<I", self._mm, self._slot(loc))[0]

    def crc(self, loc: pb.Location) -> int | None:
        """The payload crc32 its writer gave at commit, if any."""
        flags, crc = struct.unpack_from("<II", self._mm, self._slot(loc) + 4)
        return crc if flags & SLOT_HAS_CRC else None

    def still_there(self, loc: pb.Location) -> bool:
        """Whether `loc` still names the object it named when handed out: a
        copy taken before this returns True held that object's bytes. Reads
        the words (and, for `crc`, the slot) as their writer last flushed them."""
        self._invalidate(self._entry(loc.region), ENTRY_GENERATION + 8)
        self._invalidate(self._slot(loc), self._slot_bytes)
        return self.generation(loc.region) == loc.generation and self.version(loc) == loc.version

    def follow_node(self, node: int) -> None:
        """The sidecar now maps this pool as `node`: its regions are the ones
        mapped ahead."""
        self._populator.follow(node)

    def stop_ahead(self) -> None:
        """No more regions mapped ahead (the thread ends); the mapping stays."""
        self._populator.close()

    def close(self) -> None:
        self.stop_ahead()
        del self._anchor
        self._mm.close()
        os.close(self._fd)
