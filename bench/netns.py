"""Trainer "machines" for a bench: a network namespace each, with its own address, joined to this
one (the dashboard's) by a veth pair, as a GPU node is joined to the dashboard by a link.

Each machine gets a /30 of 10.231.0.0/16 that no route here overlaps, chosen under a lock file
so that two benches at once never pick the same one, and names with the bench's pid and a random
tag. Everything is removed on the way out, also on failure; namespaces left by a bench that was
killed (its pid gone) are removed by the next one. Needs CAP_NET_ADMIN (root here and in CI);
`machines()` says why when it cannot, and the bench falls back to loopback.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

POOL = ipaddress.ip_network("10.231.0.0/16")
PREFIX = "rlbench"  # namespace names: rlbench-<pid>-<tag>-<i>
LOCK = Path("/run/lock/rollout-lens-bench-netns.lock")


class NoNamespaces(Exception):
    """Network namespaces cannot be made here (no `ip`, no CAP_NET_ADMIN)."""


@dataclass(frozen=True)
class Machine:
    namespace: str
    link: str  # the veth's end on the dashboard's side (ip link set … down: the cable pulled)
    dashboard_address: str  # that end's address: the dashboard as this machine sees it
    address: str  # the machine's own address, inside its namespace

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run on this machine."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def ip(*args: str, namespace: str | None = None) -> str:
    argv = ["ip", *args] if namespace is None else ["ip", "-n", namespace, *args]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise NoNamespaces(f"`{' '.join(argv)}`: {done.stderr.strip() or done.returncode}")
    return done.stdout


@contextlib.contextmanager
def machines(count: int) -> Iterator[list[Machine]]:
    """`count` trainer machines, removed on the way out; NoNamespaces when they cannot be made."""
    if shutil.which("ip") is None:
        raise NoNamespaces("no `ip` command (iproute2)")
    tag = secrets.token_hex(2)
    made: list[Machine] = []
    try:
        LOCK.parent.mkdir(parents=True, exist_ok=True)
        with open(LOCK, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # routes read and addresses taken as one step
            _remove_orphans()
            nets = _free_blocks(count)
            for i, net in enumerate(nets):
                dashboard, trainer = (str(a) for a in net.hosts())
                machine = Machine(
                    namespace=f"{PREFIX}-{os.getpid()}-{tag}-{i}",
                    link=f"rlb{tag}{i:02d}d",  # ≤ 15 characters, an interface name's limit
                    dashboard_address=dashboard,
                    address=trainer,
                )
                _make(machine, net.prefixlen)
                made.append(machine)
        yield made
    finally:
        for machine in made:
            _remove(machine.namespace, machine.link)


def set_link(machine: Machine, up: bool) -> None:
    """The link up or down, on the dashboard's side: down, the machine's packets go nowhere (no
    reset, no answer), as when a cable or a switch fails."""
    ip("link", "set", machine.link, "up" if up else "down")


def _make(machine: Machine, prefixlen: int) -> None:
    peer = machine.link[:-1] + "t"
    ip("netns", "add", machine.namespace)
    try:
        ip("link", "add", machine.link, "type", "veth", "peer", "name", peer)
        ip("link", "set", peer, "netns", machine.namespace)
        ip("addr", "add", f"{machine.dashboard_address}/{prefixlen}", "dev", machine.link)
        ip("link", "set", machine.link, "up")
        inside = machine.namespace
        ip("addr", "add", f"{machine.address}/{prefixlen}", "dev", peer, namespace=inside)
        ip("link", "set", peer, "up", namespace=inside)
        ip("link", "set", "lo", "up", namespace=inside)
    except NoNamespaces:
        _remove(machine.namespace, machine.link)
        raise


def _remove(namespace: str, link: str) -> None:
    # deleting either end of a veth deletes both; the namespace goes once nothing runs in it
    for argv in (["link", "del", link], ["netns", "del", namespace]):
        subprocess.run(["ip", *argv], capture_output=True)


def _remove_orphans() -> None:
    """Namespaces of a bench that was killed before it could clean up (its pid is gone)."""
    for line in ip("netns", "list").splitlines():
        found = re.match(rf"({PREFIX}-(\d+)-([0-9a-f]+)-(\d+))\b", line)
        if found and not _alive(int(found[2])):
            _remove(found[1], f"rlb{found[3]}{int(found[4]):02d}d")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")  # a zombie is dead


def _free_blocks(count: int) -> list[ipaddress.IPv4Network]:
    """`count` /30s of POOL that no route or address here overlaps (addresses too: a link that
    is down, another bench's in its cut, has no routes)."""
    taken = []
    for line in ip("-4", "-o", "addr", "show").splitlines():
        found = re.search(r"\binet (\S+)", line)
        if found:
            taken.append(ipaddress.ip_network(found[1], strict=False))
    for line in ip("-4", "route", "show", "table", "all").splitlines():
        first = line.split()[0] if line.split() else ""
        if first in ("local", "broadcast", "unreachable", "prohibit", "blackhole", "throw"):
            first = line.split()[1]
        if first == "default":
            continue
        with contextlib.suppress(ValueError):
            taken.append(ipaddress.ip_network(first, strict=False))
    free = []
    for net in POOL.subnets(new_prefix=30):
        if not any(net.overlaps(t) for t in taken):
            free.append(net)
            if len(free) == count:
                return free
    raise NoNamespaces(f"no {count} free /30s left in {POOL}")
