"""A TCP forwarder that can be cut, slowed and made to drop: a network link for tests and benches.

Tests cut it to make a database or the dashboard "go away" for one client only; bench/remote.py
puts one on each trainer machine's link, with latency and drops (this kernel has no netem).
"""

from __future__ import annotations

import contextlib
import queue
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field

CHUNK = 16 * 1024  # bytes of a stream between two draws of the dice


@dataclass(frozen=True)
class Faults:
    """What the link does to what it carries. The dice are drawn at fixed offsets of each
    stream (every CHUNK bytes, from its first byte) from a generator of each connection's own,
    seeded by `seed` and the connection's number: the same seed and the same bytes, the same
    faults, however the reads happen to split them."""

    delay: float = 0.0  # seconds each way, every byte
    jitter: float = 0.0  # up to this many seconds more a read (order kept)
    cut: float = 0.0  # chance a chunk that the connection is reset there, both ways
    stall: float = 0.0  # chance a chunk that the link holds it (a drop, then a resend)
    stall_seconds: float = 1.0
    refuse: float = 0.0  # chance a connection that it is reset as soon as it is accepted
    seed: int = 0

    def __bool__(self) -> bool:
        return any((self.delay, self.jitter, self.cut, self.stall, self.refuse))


@dataclass
class Counts:
    """What the link did, for a bench's table."""

    connections: int = 0
    turned_away: int = 0  # reset while stopped (a client that found the store away)
    refused: int = 0  # by the dice (`refuse`), not while stopped
    cuts: int = 0
    stalls: int = 0
    bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str, n: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + n)


_CUT = object()  # a writer's queue item: reset the connection here


class TcpProxy:
    """Forwards `host`:`port` to `target`; `stop()` cuts live connections and refuses new ones
    until `start()`; `hold()` keeps what is sent in the link (a link that hangs: nothing is
    reset, nothing arrives) until `release()`; `faults` slow it and make it drop while up.

    The listening socket is kept for the proxy's whole life: a port given back while "down" can
    be taken by another socket (a client's connect to a port nobody listens on may even pick it as
    its own local port and connect to itself), and the next start would fail. Down, the proxy
    accepts and resets at once, which a database driver sees as the server going away.
    """

    def __init__(
        self, target: tuple[str, int], *, host: str = "127.0.0.1", faults: Faults | None = None
    ) -> None:
        self.target = target
        self.faults = faults or Faults()
        self.counts = Counts()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self.host = host
        self.port = int(self._listener.getsockname()[1])
        self.up = False
        self.flowing = threading.Event()  # cleared: held
        self.flowing.set()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def start(self) -> None:
        self.up = True

    def stop(self) -> None:
        self.up = False
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def hold(self) -> None:
        """What either end sends from now on stays in the link (connections stay open)."""
        self.flowing.clear()

    def release(self) -> None:
        """What was held goes on, and the link carries again."""
        self.flowing.set()

    def close(self) -> None:
        """Stop for good and give the port back."""
        self.release()
        self.stop()
        self._listener.close()

    def _accept(self) -> None:
        number = 0
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self.up:
                self.counts.add("turned_away")
                _reset(client)
                continue
            number += 1
            self.counts.add("connections")
            seed = f"{self.faults.seed}/{number}"
            if self.faults.refuse and random.Random(seed).random() < self.faults.refuse:
                self.counts.add("refused")
                _reset(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _reset(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns += [client, upstream]
            if not self.faults:
                for a, b in ((client, upstream), (upstream, client)):
                    threading.Thread(target=_pipe, args=(a, b, self.flowing), daemon=True).start()
                continue
            ends = _Ends(self, client, upstream)
            for a, b, way in ((client, upstream, "up"), (upstream, client, "down")):
                _Direction(self, a, b, f"{seed}/{way}", ends).start()

    def _forget(self, conns: tuple[socket.socket, ...]) -> None:
        with self._lock:
            self._conns = [c for c in self._conns if c not in conns]


class _Ends:
    """A connection through a faulty link: closed once both its directions have ended."""

    def __init__(self, proxy: TcpProxy, *conns: socket.socket) -> None:
        self.proxy, self.conns = proxy, conns
        self.left = 2
        self.lock = threading.Lock()

    def ended(self) -> None:
        with self.lock:
            self.left -= 1
            if self.left:
                return
        self.proxy._forget(self.conns)
        for conn in self.conns:
            conn.close()


class _Direction:
    """One direction of one connection through a faulty link: a reader that stamps each piece
    with the time it may arrive, and a writer that sends it then (so a delay is paid once a
    piece, not once a read behind the pieces before it)."""

    def __init__(
        self, proxy: TcpProxy, src: socket.socket, dst: socket.socket, seed: str, ends: _Ends
    ) -> None:
        self.proxy, self.src, self.dst, self.ends = proxy, src, dst, ends
        self.faults = proxy.faults
        self.dice = random.Random(seed)
        self.jitter = random.Random(f"{seed}/jitter")
        self.queue: queue.SimpleQueue[tuple[float, bytes] | object | None] = queue.SimpleQueue()

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        faults, counts = self.faults, self.proxy.counts
        offset = 0
        due = 0.0  # the last piece's arrival: later pieces never overtake it
        try:
            while data := self.src.recv(65536):
                now = time.monotonic()
                counts.add("bytes", len(data))
                lag = faults.delay + (self.jitter.uniform(0, faults.jitter) if faults.jitter else 0)
                begin, end = offset, offset + len(data)
                offset = end
                at = begin
                for mark in range(-(-begin // CHUNK) * CHUNK, end, CHUNK):
                    draw = self.dice.random()
                    if draw >= faults.cut + faults.stall:
                        continue
                    if mark > at:
                        due = max(due, now + lag)
                        self.queue.put((due, data[at - begin : mark - begin]))
                    at = mark
                    if draw < faults.cut:
                        counts.add("cuts")
                        self.queue.put(_CUT)
                        return
                    counts.add("stalls")  # what follows waits out the stall
                    due = max(due, now + lag) + faults.stall_seconds
                if at < end:
                    due = max(due, now + lag)
                    self.queue.put((due, data[at - begin :]))
        except OSError:
            pass
        self.queue.put(None)

    def _write(self) -> None:
        try:
            while (item := self.queue.get()) is not None:
                if item is _CUT:
                    for s in (self.src, self.dst):
                        _reset(s)
                    return
                assert isinstance(item, tuple)
                due, data = item
                time.sleep(max(0.0, due - time.monotonic()))
                self.proxy.flowing.wait()
                self.dst.sendall(data)
            self.dst.shutdown(socket.SHUT_WR)  # the sender's end of its stream, passed on
        except OSError:  # broken: the other way ends too
            for s in (self.src, self.dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        finally:
            self.ends.ended()


def database_proxy(url: str) -> tuple[TcpProxy, str]:
    """A proxy (not started) in front of the database server at `url` (an SQLAlchemy URL), and
    `url` through it."""
    from sqlalchemy import make_url

    parsed = make_url(url)
    proxy = TcpProxy((parsed.host or "127.0.0.1", parsed.port or 5432))
    through = parsed.set(host="127.0.0.1", port=proxy.port)
    return proxy, through.render_as_string(hide_password=False)


def _pipe(src: socket.socket, dst: socket.socket, flowing: threading.Event) -> None:
    try:
        while data := src.recv(65536):
            flowing.wait()
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def _reset(conn: socket.socket) -> None:
    """Close with a RST, as a server that is not there (or a link that broke). SHUT_RD first
    wakes a thread blocked reading it."""
    with contextlib.suppress(OSError):
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RD)
    conn.close()
