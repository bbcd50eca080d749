"""The proxy moved to bench/tcp_proxy.py (bench/remote.py uses it too); kept importable here for
tests written against the old place."""

from bench.tcp_proxy import TcpProxy

__all__ = ["TcpProxy"]
