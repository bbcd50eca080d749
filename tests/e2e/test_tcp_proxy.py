"""bench/tcp_proxy.py's faulty link: its delay is paid each way, and its cuts, stalls and
refusals are the seed's (the same seed, the same connections cut), between real sockets."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from bench.tcp_proxy import CHUNK, Faults, TcpProxy

REQUEST = 4 * CHUNK  # each connection: this many bytes up, then b"ok" down


@pytest.fixture
def server() -> Iterator[tuple[str, int]]:
    """Reads REQUEST bytes from each connection, answers b"ok"."""
    listener = socket.create_server(("127.0.0.1", 0))

    def answer(conn: socket.socket) -> None:
        with conn:
            got = 0
            try:
                while got < REQUEST and (data := conn.recv(65536)):
                    got += len(data)
                if got == REQUEST:
                    conn.sendall(b"ok")
            except OSError:
                pass

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield ("127.0.0.1", int(listener.getsockname()[1]))
    listener.close()


def _exchange(port: int) -> bool:
    """One connection's request and answer through the proxy: True when the answer came."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(b"x" * REQUEST)
            answer = b""
            while len(answer) < 2 and (data := conn.recv(2)):
                answer += data
            return answer == b"ok"
    except OSError:
        return False


def _outcomes(
    target: tuple[str, int], faults: Faults, n: int = 30
) -> tuple[list[bool], tuple[int, int, int]]:
    """n connections one after another (so numbered in order): each one's outcome, and the
    link's (cuts, stalls, refusals)."""
    proxy = TcpProxy(target, faults=faults)
    proxy.start()
    try:
        outcomes = [_exchange(proxy.port) for _ in range(n)]
        counts = proxy.counts
    finally:
        proxy.close()
    return outcomes, (counts.cuts, counts.stalls, counts.refused)


def test_the_same_seed_cuts_the_same_connections(server: tuple[str, int]) -> None:
    faults = Faults(cut=0.05, stall=0.05, stall_seconds=0.01, refuse=0.05, seed=7)
    first, counted = _outcomes(server, faults)
    again, counted_again = _outcomes(server, faults)
    assert first == again
    assert counted == counted_again
    assert True in first and False in first  # this seed cuts some and lets others through
    assert all(counted)  # cuts, stalls and refusals each happened
    other, _ = _outcomes(server, Faults(cut=0.05, stall=0.05, stall_seconds=0.01, seed=8))
    assert other != first


def test_no_faults_every_answer_comes(server: tuple[str, int]) -> None:
    outcomes, counted = _outcomes(server, Faults(delay=0.001, jitter=0.001, seed=1), n=5)
    assert all(outcomes)
    assert counted == (0, 0, 0)


def test_the_delay_is_paid_each_way(server: tuple[str, int]) -> None:
    proxy = TcpProxy(server, faults=Faults(delay=0.2))
    proxy.start()
    try:
        started = time.monotonic()
        assert _exchange(proxy.port)
        # a lower bound only: the two delays are slept, whatever the machine's load
        assert time.monotonic() - started >= 0.4
    finally:
        proxy.close()
